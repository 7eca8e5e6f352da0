"""The router's layering, as the README draws it: its pure packages (and the proxy,
which knows the engines only through ``Upstream``) import no network or thread I/O
library, checked by importing every module of them in a fresh interpreter in which
aiohttp and zmq cannot be imported; and, read from the source of every module of the
installed packages, no import circle and no import that points up the layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PURE = (
    "kvpilot.routing.ids",
    "kvpilot.routing.config",
    "kvpilot.routing.fleet",
    "kvpilot.routing.refusals",
    "kvpilot.routing.index",
    "kvpilot.routing.decide",
    "kvpilot.routing.health",
    "kvpilot.routing.gateway.contract",
)
IO_FREE = (
    "kvpilot.routing.serve.proxy",
    "kvpilot.routing.serve.driver",
    "kvpilot.routing.serve.upstream",
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


# ---- the import graph, read from the source ------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
PACKAGE_DIRS = ("policies", "kvconnectors", "routing", "deploy")
"""The installed packages' folders, lowest first: each imports only those before it."""
ROUTING_LAYERS = (
    ("ids",),
    ("config", "refusals"),
    ("config_load", "fleet"),
    ("index", "health"),
    ("decide",),
    ("ingest",),
    ("metrics",),
    ("state",),
    ("serve",),
    ("gateway",),
    ("cli",),
)
"""``routing/``'s modules and packages, lowest first: each imports only those of an earlier
row (names in one row import none of each other). A name in no row (a composition root that
wires several of them) is held to no import circle only."""


def _modules() -> dict[str, Path]:
    modules = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(("kvpilot", *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return modules


def _import_graph() -> dict[str, set[str]]:
    """Each module's imports of the others: every ``import`` statement, at the top, in a
    function or under ``TYPE_CHECKING``, named as the module it reaches (``from a import b``
    is ``a.b`` where that is a module, else ``a``)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                base = ".".join(filter(None, (base, node.module)))
                targets |= {known(f"{base}.{alias.name}") for alias in node.names}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _rank(module: str) -> tuple[int, str] | None:
    """Where ``module`` sits: its folder's place and, within ``routing/``, its row (``None``:
    in no row)."""
    parts = module.split(".")
    folder = PACKAGE_DIRS.index(parts[1]) * 100
    if parts[1] != "routing" or len(parts) == 2:
        return (folder, parts[1])
    rows = [i for i, row in enumerate(ROUTING_LAYERS) if parts[2] in row]
    return (folder + 1 + rows[0], f"routing.{parts[2]}") if rows else None


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _import_graph()
    assert len(graph) > 100  # every module was read, not just the package roots
    assert _cycles(graph) == []


def test_every_import_points_down_the_layers() -> None:
    """``policies`` < ``kvconnectors`` < ``routing`` < ``deploy``, and within ``routing/`` the
    rows of :data:`ROUTING_LAYERS` (``metrics/`` below ``serve/``: the series name the
    refusals, they do not reach into the HTTP front)."""
    upward = []
    for module, targets in sorted(_import_graph().items()):
        for target in sorted(targets):
            here, there = _rank(module), _rank(target)
            if here and there and here[1] != there[1] and there[0] >= here[0]:
                upward.append(f"{module} -> {target}")
    assert upward == []
