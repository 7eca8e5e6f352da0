"""The roofline pull policy deciding live inside P's connector (issue 9, item 4):
with no ``kv_recompute_threshold``, each session pull's verified span is pulled or
recomputed from P's own load and measured NIXL transfers; every decision is counted
and the span's blocks are loaded or recomputed accordingly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.fleet import Fleet
from deploy.fleet_spec import FleetSpec
from deploy.metrics import delta
from routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.scenarios import PROMPT_TOKENS, RECOMPUTED
from tests.e2e.sessions import EDITS, GENERATED, PULL_DECISIONS, block_count, handshake_both_ways, run_session
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, tokenizer: PromptTokenizer) -> Iterator[Fleet]:
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("roofline-fleet"),
        disaggregation="always",
        connector_extra_config={"bidirectional_kv_xfer": True},
        **PORTS,
    )
    with running_fleet(spec) as started:
        handshake_both_ways(started.by_role("prefill")[0].url, started.by_role("decode")[0].url, tokenizer)
        yield started


def test_the_roofline_policy_decides_live(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    prefill, decode = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url
    for seed in (400, 401):
        turn = run_session(prefill, decode, tokenizer, seed=seed, edit=EDITS["unedited"])
        after, before = turn.p_after, turn.p_before
        pulls = delta(after, before, PULL_DECISIONS, decision="pull", reason="roofline")
        recomputes = delta(after, before, PULL_DECISIONS, decision="recompute", reason="roofline")
        assert pulls + recomputes == 1
        span = (block_count(len(turn.x) + GENERATED - 1) - block_count(len(turn.x))) * 32
        if pulls:
            assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == span
        else:
            assert delta(after, before, RECOMPUTED, reason="pull_policy") == span
            assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == 0
