"""The roofline pull policy deciding live inside P's connector (issue 9, item 4):
with no ``kv_recompute_threshold``, each session pull's verified span is pulled or
recomputed by :class:`policies.RecomputeVsTransferPolicy` on P's own load and NIXL
transfers; the decision is counted and the span's blocks are loaded or recomputed.

Two fleets, one after the other, each pricing P so that the decision is known before
the session runs, whatever P's link meter measures on this box:

* ``pull``: P priced as DeepSeek-V3 (MLA: little KV for its compute) on one CPU
  core: recomputing the 64-token span costs 82 s, pulling its KV 0.4 s at the
  ~12 ms per read measured here and 41 s over reads 100x slower;
* ``recompute``: P priced as eight B200s running the tiny model: the span fits in a
  weight-bound pass for free, and any transfer costs more than nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.fleet import Fleet
from deploy.fleet_spec import FleetSpec
from deploy.metrics import delta
from policies.presets import hardware_preset, kv_format_preset, link_preset, model_from_hf_config, model_preset
from policies.recompute_vs_transfer import (
    Choice,
    LinkTelemetry,
    PrefillLoad,
    RecomputeVsTransferPolicy,
    Span,
    TransferSample,
)
from routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.scenarios import BLOCK_SIZE, KV_BYTES_PER_TOKEN, NIXL_BYTES, PROMPT_TOKENS, RECOMPUTED, VERIFIED
from tests.e2e.sessions import EDITS, GENERATED, PULL_DECISIONS, block_count, handshake_both_ways, run_session
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()
MEASURED_READ_S = 0.012
"""What one NIXL read costs on this box whatever its size (docs/sessions.md)."""


@dataclass(frozen=True)
class Pricing:
    name: str
    extra_config: dict[str, str]
    """kvpilot's pricing keys in ``kv_connector_extra_config`` (docs/sessions.md)."""
    expected: Choice


PRICINGS = (
    Pricing("pull", {"policy_model": "deepseek-v3", "policy_hardware": "cpux1"}, Choice.TRANSFER),
    Pricing("recompute", {"policy_hardware": "b200x8"}, Choice.RECOMPUTE),
)


def _choices_over_any_link(pricing: Pricing, model_dir: Path, span: Span) -> set[Choice]:
    """What the policy P builds from ``pricing`` chooses for ``span``, on an idle or a
    busy P, with the link prior or reads measured at 1/100, 1 and 100 times the
    ~12 ms measured here (P's link meter replaces the prior after 3 reads)."""
    extra = pricing.extra_config
    model = (
        model_preset(extra["policy_model"])
        if "policy_model" in extra
        else model_from_hf_config(json.loads((model_dir / "config.json").read_text()), "tiny", "the tiny model")
    )
    policy = RecomputeVsTransferPolicy(
        model, kv_format_preset("bf16"), hardware_preset(extra["policy_hardware"]), link_preset("loopback")
    )
    read = TransferSample(span.tokens * KV_BYTES_PER_TOKEN, MEASURED_READ_S)
    links = [LinkTelemetry()] + [
        LinkTelemetry(samples=(TransferSample(read.nbytes, read.seconds * factor),) * 3) for factor in (0.01, 1, 100)
    ]
    loads = (PrefillLoad(), PrefillLoad(queued_prefill_tokens=4096, running_batch_tokens=4096))
    return {policy.decide(span, load, link).choice for link in links for load in loads}


@pytest.fixture(scope="module", params=PRICINGS, ids=lambda p: p.name)
def priced_fleet(
    request: pytest.FixtureRequest,
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer: PromptTokenizer,
) -> Iterator[tuple[Pricing, Fleet]]:
    pricing: Pricing = request.param
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp(f"roofline-{pricing.name}-fleet"),
        disaggregation="always",
        connector_extra_config={"bidirectional_kv_xfer": True, **pricing.extra_config},
        **PORTS,
    )
    with running_fleet(spec) as started:
        handshake_both_ways(started.by_role("prefill")[0].url, started.by_role("decode")[0].url, tokenizer)
        yield pricing, started


def test_the_roofline_policy_decides_live_as_priced(
    priced_fleet: tuple[Pricing, Fleet], model_dir: Path, tokenizer: PromptTokenizer
) -> None:
    pricing, fleet = priced_fleet
    prefill, decode = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url
    chosen = "pull" if pricing.expected is Choice.TRANSFER else "recompute"
    other = "recompute" if chosen == "pull" else "pull"
    for seed in (400, 401):
        turn = run_session(prefill, decode, tokenizer, seed=seed, edit=EDITS["unedited"])
        # P holds x's full blocks from turn 1; the span is the blocks D's generated
        # tokens completed (the last one has no KV yet); the rest of x2 follows it.
        context = block_count(len(turn.x)) * BLOCK_SIZE
        span = block_count(len(turn.x) + GENERATED - 1) * BLOCK_SIZE - context
        assert span > 0
        assert _choices_over_any_link(pricing, model_dir, Span(span, context, len(turn.x2) - context - span)) == {
            pricing.expected
        }

        after, before = turn.p_after, turn.p_before
        assert delta(after, before, PULL_DECISIONS, decision=chosen, reason="roofline") == 1
        assert delta(after, before, PULL_DECISIONS, decision=other, reason="roofline") == 0
        pulled = span if chosen == "pull" else 0
        assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == pulled
        assert delta(after, before, VERIFIED) == pulled // BLOCK_SIZE
        assert delta(after, before, NIXL_BYTES) == pulled * KV_BYTES_PER_TOKEN  # P's own reads from D
        assert delta(after, before, RECOMPUTED, reason="pull_policy") == span - pulled
