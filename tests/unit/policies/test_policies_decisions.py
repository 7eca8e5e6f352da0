"""Local vs remote prefill (7), session tier (5.3)."""

from __future__ import annotations

import pytest

from kvpilot.policies.disaggregation import (
    DYNAMO_DEFAULT,
    KVPILOT_DEFAULT,
    DecodeState,
    LocalPrefillConfig,
    LocalVsRemotePolicy,
    PromptState,
    Where,
)
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset
from kvpilot.policies.roofline import kv_bytes, prefill, weight_stream_seconds

M = model_preset("llama-70b")
BF16 = kv_format_preset("bf16")
HW = hardware_preset("b200x2")
RDMA, PCIE = link_preset("rdma"), link_preset("pcie")

# Section 9.2 option 5: step 20 lands on the D that holds the session; 1,500 new tokens of ~63,000.
STEP20_ON_D = PromptState(prompt_tokens=63_450, d_cached_tokens=61_950, p_cached_tokens=32_000)


@pytest.mark.parametrize(
    ("config", "prompt", "decode", "where"),
    [
        (DYNAMO_DEFAULT, STEP20_ON_D, DecodeState(0.5, 8), Where.LOCAL),  # Dynamo ignores D's load
        (DYNAMO_DEFAULT, STEP20_ON_D, DecodeState(0.95, 0), Where.LOCAL),
        (DYNAMO_DEFAULT, PromptState(5_000), DecodeState(), Where.REMOTE),  # >= 2,048 effective tokens
        (DYNAMO_DEFAULT, PromptState(1_000), DecodeState(), Where.REMOTE),  # no D hit: 100% >= 70%
        (DYNAMO_DEFAULT, PromptState(1_000, 400), DecodeState(), Where.LOCAL),
        (KVPILOT_DEFAULT, STEP20_ON_D, DecodeState(0.5, 0), Where.LOCAL),  # a lightly loaded D: good option
        (KVPILOT_DEFAULT, STEP20_ON_D, DecodeState(0.5, 8), Where.REMOTE),  # ~170 ms stall on 8 streams
        (KVPILOT_DEFAULT, STEP20_ON_D, DecodeState(0.95, 0), Where.REMOTE),  # decode-busy guard
        (KVPILOT_DEFAULT, PromptState(2_000, 1_800), DecodeState(0.3, 8), Where.LOCAL),  # short stall
        # P already holds all but D's 150 tokens: remote is cheaper than a 1,500-token local prefill
        (KVPILOT_DEFAULT, PromptState(63_450, 61_950, 63_300), DecodeState(0.3, 0), Where.REMOTE),
    ],
)
def test_local_vs_remote(config: LocalPrefillConfig, prompt: PromptState, decode: DecodeState, where: Where) -> None:
    decision = LocalVsRemotePolicy(M, BF16, HW, HW, RDMA, config).decide(prompt, decode)
    assert decision.where is where, decision.explain()


def test_local_prefill_costs_match_section_9_2() -> None:
    decision = LocalVsRemotePolicy(M, BF16, HW, HW, RDMA).decide(STEP20_ON_D, DecodeState(0.5, 8))
    assert decision.local_s == pytest.approx(0.170, rel=0.05)  # "roughly 170 ms of compute"
    # each running stream's step streams the weights anyway: the prefill stalls it by the rest
    assert decision.stall_s == pytest.approx(decision.local_s - weight_stream_seconds(M, HW))
    assert decision.local_priced_s == pytest.approx(decision.local_s + 8 * decision.stall_s)
    assert "NO: stall on 8 streams" in decision.explain()


def test_remote_cost_counts_queue_prefill_and_handoff() -> None:
    prompt = PromptState(10_000, d_cached_tokens=0, p_cached_tokens=4_000, p_queued_tokens=8_000)
    decision = LocalVsRemotePolicy(M, BF16, HW, HW, RDMA).decide(prompt)
    queue = 8_000 * 2 * M.params_active / HW.effective_flops
    expected = queue + prefill(M, BF16, HW, 6_000, 4_000).seconds + RDMA.transfer_seconds(kv_bytes(M, BF16, 10_000))
    assert decision.remote_s == pytest.approx(expected)


SESSION = kv_bytes(M, BF16, 63_450)
RECOMPUTE_S = prefill(M, BF16, HW, 63_450).seconds


def test_restores_beat_recompute_as_the_article_says() -> None:
    """Section 5.3: restoring a session from host memory is "about 25x faster" than recomputing it."""
    assert RECOMPUTE_S / PCIE.transfer_seconds(SESSION) == pytest.approx(25, rel=0.05)
    c2c = link_preset("c2c").transfer_seconds(SESSION)
    assert RECOMPUTE_S / c2c > 100  # "the GB200 path about 125x"; 114x with 450 GB/s per direction
