"""The router's layering, as the README draws it: its pure packages (and the proxy,
which knows the engines only through ``Upstream``) import no network or thread I/O
library. Checked by importing every module of them in a fresh interpreter in which
aiohttp and zmq cannot be imported."""

from __future__ import annotations

import subprocess
import sys

PURE = (
    "kvpilot.routing.ids",
    "kvpilot.routing.config",
    "kvpilot.routing.fleet",
    "kvpilot.routing.index",
    "kvpilot.routing.decide",
    "kvpilot.routing.health",
    "kvpilot.routing.gateway.contract",
)
IO_FREE = (
    "kvpilot.routing.serve.proxy",
    "kvpilot.routing.serve.upstream",
    "kvpilot.routing.serve.refusals",
    "kvpilot.routing.serve.request_fields",
)
BLOCKED = ("aiohttp", "zmq", "redis")

SCRIPT = f"""
import importlib, pkgutil, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(name + " is an I/O library: a pure module must not import it")
sys.meta_path.insert(0, Blocked())
names = []
for top in {PURE!r}:
    module = importlib.import_module(top)
    names.append(top)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), top + "."):
        if info.name != "kvpilot.routing.index.dynamo":  # needs ai-dynamo-runtime, an optional extra
            importlib.import_module(info.name)
            names.append(info.name)
for name in {IO_FREE!r}:
    importlib.import_module(name)
    names.append(name)
print(len(names))
"""


def test_pure_packages_and_the_proxy_import_no_io_library():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) >= 20  # every module was reached, not just the package roots
