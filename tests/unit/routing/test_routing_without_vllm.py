"""The router runs beside Dynamo on boxes without vLLM: nothing in it may import vLLM."""

from __future__ import annotations

import subprocess
import sys


def test_the_router_imports_and_builds_without_vllm(model_dir):
    """Every router module, both index backends and a built server, with vLLM made unimportable."""
    code = f"""
import sys
class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torch"):
            raise ImportError(name + " is not installed here")
sys.meta_path.insert(0, NoVllm())
import kvpilot.routing.index.chain, kvpilot.routing.cli, kvpilot.routing.index.dynamo
import kvpilot.routing.ingest.engine_metrics
import kvpilot.routing.decide.ledger, kvpilot.routing.serve.app
from kvpilot.routing.config import IndexConfig, Role, RouterConfig, ServerConfig, Worker
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.fleet import fleet_from_config
for backend in ("kvpilot", "dynamo"):
    cfg = RouterConfig(index=IndexConfig(backend=backend), server=ServerConfig(model_dir={str(model_dir)!r}),
                       workers=(Worker(WorkerId("w"), Role.COLOCATED, "http://127.0.0.1:9"),))
    kvpilot.routing.serve.app.build_server(cfg, fleet_from_config(cfg), feed_index=False)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
