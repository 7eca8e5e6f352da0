"""kvpilot.policies.session_hold: whether D holds a session's finished step for its next one."""

from __future__ import annotations

import pytest

from kvpilot.policies.session_hold import HoldReason, decide_hold, expected_gap_s

TOOL_GAPS = (1.5, 2.0, 2.5, 3.0)
HUMAN_GAPS = (45.0, 60.0, 90.0)


@pytest.mark.parametrize(
    ("gaps", "kv_usage", "release_at", "reason"),
    [
        ((), 0.2, 0.9, HoldReason.FIRST_STEP),  # nothing measured: vLLM's own hold
        (TOOL_GAPS, 0.2, 0.9, HoldReason.RETURNS_WITHIN_HOLD),
        (HUMAN_GAPS, 0.2, 0.9, HoldReason.OUTLASTS_HOLD),
        ((*TOOL_GAPS, *HUMAN_GAPS), 0.2, 0.9, HoldReason.RETURNS_WITHIN_HOLD),  # mostly tool calls
        ((2.0, *HUMAN_GAPS), 0.2, 0.9, HoldReason.OUTLASTS_HOLD),  # mostly human turns
        (TOOL_GAPS, 0.9, 0.9, HoldReason.MEMORY_PRESSURE),  # at the threshold: released
        ((), 0.95, 0.9, HoldReason.MEMORY_PRESSURE),
        (TOOL_GAPS, 0.99, None, HoldReason.RETURNS_WITHIN_HOLD),  # no threshold: never for pressure
    ],
)
def test_hold_follows_the_session_s_gaps_and_d_s_memory(
    gaps: tuple[float, ...], kv_usage: float, release_at: float | None, reason: HoldReason
) -> None:
    decision = decide_hold(gaps, horizon_s=25.0, kv_usage=kv_usage, release_kv_usage=release_at)
    assert decision.reason is reason
    assert decision.hold is (reason in (HoldReason.FIRST_STEP, HoldReason.RETURNS_WITHIN_HOLD))
    assert decision.expected_gap_s == expected_gap_s(gaps)
    assert decision.explain().startswith("hold" if decision.hold else "release")


def test_a_gap_exactly_at_the_horizon_is_held() -> None:
    assert decide_hold((25.0,), horizon_s=25.0, kv_usage=0.0, release_kv_usage=0.9).hold
    assert not decide_hold((25.01,), horizon_s=25.0, kv_usage=0.0, release_kv_usage=0.9).hold
