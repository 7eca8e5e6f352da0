"""The router's one composition root (kvpilot.routing.core): the fronts build nothing it
builds, and what it builds reads the clock it is given."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from kvpilot.routing.config import RouterConfig
from kvpilot.routing.core import RouterCore
from kvpilot.routing.decide.lifecycle import Clock
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.refusals import BadRequest
from kvpilot.routing.serve.upstream import Api

ROOT = Path(__file__).resolve().parents[3]
FRONTS = ("routing/serve/app.py", "routing/gateway/service.py", "benchmarks/sim/kvpilot.py")
"""The HTTP relay, the picker's gRPC service and the simulator: each takes a RouterCore."""
BUILT_BY_THE_CORE = frozenset(
    {"Router", "Lifecycle", "RequestIntake", "make_index", "BlockIndex", "DynamoIndex", "LoadLedger", "SessionStore"}
)
WORKERS = [
    {"name": "p0", "role": "prefill", "url": "http://127.0.0.1:1"},
    {"name": "d0", "role": "decode", "url": "http://127.0.0.1:2"},
]


def constructed(source: str) -> set[str]:
    """The names in :data:`BUILT_BY_THE_CORE` that ``source`` calls (``Router(...)``,
    ``module.Router(...)``)."""
    calls = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in BUILT_BY_THE_CORE:
                calls.add(name)
    return calls


def test_the_scan_finds_a_front_that_builds_its_own_router():
    own = "from kvpilot.routing.decide import router\nr = router.Router(fleet, cfg, make_index(cfg.index))\n"
    assert constructed(own) == {"Router", "make_index"}


@pytest.mark.parametrize("front", FRONTS)
def test_no_front_builds_what_the_core_builds(front: str):
    assert constructed((ROOT / front).read_text()) == set(), f"{front} builds its own; take it from RouterCore"


def _core(clock: Clock) -> RouterCore:
    config = msgspec.convert({"workers": WORKERS, "disaggregation": {"model_preset": "llama-8b"}}, RouterConfig)
    return RouterCore(config, fleet_from_config(config), clock=clock)


def test_the_router_reads_the_circuits_on_the_core_s_clock():
    now = [1000.0]
    core = _core(Clock(monotonic=lambda: now[0], wall=lambda: now[0]))
    d = WorkerId("d0")
    for _ in range(core.config.server.circuit_failures):
        core.breaker.failed(d, now[0])
    assert d in core.router.barred()
    now[0] += core.config.server.circuit_open_s + 1
    assert d not in core.router.barred()


def test_a_core_without_prompts_takes_no_client_s_prompt():
    core = _core(Clock())
    with pytest.raises(BadRequest) as refused:
        core.intake.prompt({}, {"prompt": "hello"}, Api.COMPLETIONS)
    assert refused.value.status == 503 and "server.model_dir" in str(refused.value)
