"""This engine's measured prefill rate: its steps timed, fitted, and the pull policy's
recompute side priced from it (pure: chunk sequences and a fake clock)."""

from __future__ import annotations

import pytest

from kvpilot.kvconnectors.pull_policy import RooflinePullPolicy
from kvpilot.kvconnectors.step_rates import Chunk, StepRates, step_features
from kvpilot.policies.measured_fit import MIN_SAMPLES, attention_pairs
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset
from kvpilot.policies.recompute_vs_transfer import (
    LinkTelemetry,
    MeasuredPrefill,
    PrefillLoad,
    RecomputeVsTransferPolicy,
    Span,
)

FIXED, PER_TOKEN, PER_PAIR = 0.02, 1e-4, 2e-8


def step_seconds(chunks: list[Chunk]) -> float:
    return FIXED + sum(PER_TOKEN * c.tokens + PER_PAIR * attention_pairs(c.tokens, c.context) for c in chunks)


def run(rates: StepRates, steps: list[list[Chunk]], start: float = 100.0) -> float:
    """Each step timed as the model says, on a fake clock; returns the clock's end."""
    now = start
    for chunks in steps:
        rates.started(chunks, now)
        now += step_seconds(chunks)
        rates.finished(now)
    return now


PREFILLS = [[Chunk(n, c, True)] for n, c in [(32, 0), (300, 0), (128, 320), (600, 64), (64, 1000)]]


def test_prefill_steps_recover_the_engines_rates() -> None:
    rates = StepRates()
    assert rates.measured() is None
    run(rates, PREFILLS)
    measured = rates.measured()
    assert measured is not None and measured.samples == len(PREFILLS)
    assert (measured.fixed_s, measured.per_token_s, measured.per_pair_s) == pytest.approx(
        (FIXED, PER_TOKEN, PER_PAIR), rel=1e-6
    )


def test_a_step_mixing_decodes_into_a_prefill_counts_every_token() -> None:
    """Four decodes at context 2000 ride along each prefill: priced as a pure prefill
    of the prefill chunk alone, the fit would charge the decodes' attention to it."""
    decodes = [Chunk(1, 2000 + i, False) for i in range(4)]
    rates = StepRates()
    run(rates, [chunks + decodes for chunks in PREFILLS])
    measured = rates.measured()
    assert measured is not None
    assert (measured.per_token_s, measured.per_pair_s) == pytest.approx((PER_TOKEN, PER_PAIR), rel=1e-6)
    assert step_features(decodes) == (1.0, 4.0, sum(2001 + i for i in range(4)))


def test_decode_only_empty_and_unfinished_steps_are_not_samples() -> None:
    rates = StepRates()
    now = run(rates, [[Chunk(1, 500 + i, False), Chunk(1, 90, False)] for i in range(10)])  # decode-only
    now = run(rates, [[], [Chunk(0, 40, True)]], now)  # nothing ran: only KV transfers polled
    rates.started(PREFILLS[0], now)  # its end never seen: two batches in flight
    rates.started(PREFILLS[1], now + 5.0)
    rates.finished(now + 5.0 + step_seconds(PREFILLS[1]))
    rates.finished(now + 60.0)  # no step open
    assert len(rates) == 1
    run(rates, PREFILLS[2:], now + 100.0)
    assert len(rates) == 1 + len(PREFILLS[2:])
    measured = rates.measured()
    assert measured is not None and measured.per_token_s == pytest.approx(PER_TOKEN, rel=1e-6)


def test_too_few_samples_or_one_token_count_leave_the_prior() -> None:
    rates = StepRates()
    run(rates, PREFILLS[: MIN_SAMPLES - 1])
    assert rates.measured() is None
    same = StepRates()
    run(same, [[Chunk(64, 0, True)]] * (MIN_SAMPLES + 2))
    assert same.measured() is None


def test_the_measured_marginal_cost_of_a_span_is_its_tokens_and_pairs() -> None:
    """Whatever new tokens follow the span, it adds b*s + c*pairs(s, C): the pass with it
    minus the pass that starts after it."""
    measured = MeasuredPrefill(fixed_s=FIXED, per_token_s=PER_TOKEN, per_pair_s=PER_PAIR, samples=9)
    for new in (0, 50, 900):
        span = Span(tokens=64, context=3000, new_tokens=new)
        with_span = step_seconds([Chunk(64 + new, 3000, True)])
        without = step_seconds([Chunk(new, 3064, True)]) if new else FIXED
        assert measured.marginal_seconds(span) == pytest.approx(with_span - without, rel=1e-9)


def _tiny_policy() -> RooflinePullPolicy:
    return RooflinePullPolicy(
        RecomputeVsTransferPolicy(
            model_preset("llama-8b"), kv_format_preset("bf16"), hardware_preset("cpux1"), link_preset("loopback")
        )
    )


@pytest.mark.parametrize(
    ("per_token_s", "label"),
    [(None, "pull/roofline"), (1e-7, "recompute/measured"), (1e-3, "pull/measured")],
    ids=["prior", "measured-cheap", "measured-dear"],
)
def test_the_decision_names_what_priced_recomputing(per_token_s: float | None, label: str) -> None:
    span = Span(tokens=64, context=300, new_tokens=40)
    measured = None if per_token_s is None else MeasuredPrefill(0.01, per_token_s, 0.0, samples=7)
    decision = _tiny_policy().decide(span, PrefillLoad(), LinkTelemetry(), measured)
    assert decision.label == label
    if measured is None:
        assert "roofline on cpux1" in decision.explanation
    else:
        assert "over 7 of P's passes" in decision.explanation and "measured" in decision.explanation
