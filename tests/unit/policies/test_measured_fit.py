"""The shared fit: non-negative least squares over a window, and the prefill model (pure)."""

from __future__ import annotations

import pytest

from kvpilot.policies.measured_fit import (
    MIN_SAMPLES,
    PREFILL_SPREAD_FEATURE,
    LinearFit,
    attention_pairs,
    prefill_features,
)


def _prefill_fit() -> LinearFit:
    return LinearFit(PREFILL_SPREAD_FEATURE)


def test_attention_pairs_count_the_causal_query_key_pairs() -> None:
    assert attention_pairs(1, 0) == 1
    assert attention_pairs(3, 0) == 1 + 2 + 3
    assert attention_pairs(2, 10) == 11 + 12
    assert prefill_features(2, 10) == (1.0, 2.0, 23.0)


def test_the_prefill_fit_recovers_its_coefficients() -> None:
    fit = _prefill_fit()
    truth = (0.01, 2e-4, 3e-7)
    for new, cached in [(32, 0), (300, 0), (64, 320), (900, 100), (128, 2000), (10, 50)]:
        features = prefill_features(new, cached)
        fit.add(features, sum(c * f for c, f in zip(truth, features, strict=True)))
    assert fit.coefficients() == pytest.approx(truth, rel=1e-6)
    assert fit.predict(prefill_features(100, 100)) == pytest.approx(0.01 + 0.02 + 3e-7 * attention_pairs(100, 100))


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([(100, 0, 0.5)] * MIN_SAMPLES, None),  # one token count: no rate
        ([(100, 0, 0.5), (200, 0, 1.0), (300, 0, 1.5)], None),  # fewer than MIN_SAMPLES
        # seconds falling with the pairs: attention dropped first, then the rest refitted
        ([(100, 0, 0.3), (200, 1000, 0.2), (300, 5000, 0.25), (400, 0, 0.4)], "no attention"),
    ],
    ids=["one-count", "too-few", "negative-attention"],
)
def test_the_fit_waits_for_usable_samples_and_drops_negative_terms(
    samples: list[tuple[int, int, float]], expected: str | None
) -> None:
    fit = _prefill_fit()
    for new, cached, seconds in samples:
        fit.add(prefill_features(new, cached), seconds)
    coef = fit.coefficients()
    if expected is None:
        assert coef is None and fit.predict(prefill_features(1, 0)) is None
    else:
        assert coef is not None and coef[2] == 0.0 and all(c >= 0 for c in coef)


def test_the_fit_forgets_samples_beyond_its_window() -> None:
    fit = LinearFit(PREFILL_SPREAD_FEATURE, window=4)
    for new in (10, 20, 30, 40):
        fit.add(prefill_features(new, 0), 1.0 * new)  # 0.1 s per token... of an old build
    for new in (10, 20, 30, 40):
        fit.add(prefill_features(new, 0), 0.001 * new)
    assert len(fit) == 4
    coef = fit.coefficients()
    assert coef is not None and coef[1] == pytest.approx(0.001)


def test_a_stalled_sample_does_not_set_the_rates() -> None:
    """A 5 s step among steps of tens of milliseconds (the box stalled) is left out of the
    refit: the rates stay those of the other steps. Noisy samples stay in."""
    fit = _prefill_fit()
    truth = (0.01, 1e-4, 0.0)
    noise = (1.05, 0.97, 1.02, 0.99, 1.03, 0.96, 1.0, 1.01)
    for n, jitter in zip(range(100, 900, 100), noise, strict=True):
        fit.add(prefill_features(n, 0), (truth[0] + truth[1] * n) * jitter)
    clean = fit.coefficients()
    fit.add(prefill_features(450, 0), 5.0)
    coef = fit.coefficients()
    assert clean is not None and coef is not None
    assert coef == pytest.approx(clean, rel=1e-9)  # the stall is dropped, every noisy sample kept
    assert coef[1] == pytest.approx(truth[1], rel=0.2)
    assert coef[0] < 0.05  # with the stall in, least squares puts the fixed cost at 0.56 s


def test_a_fixed_cost_that_dominates_is_kept_when_the_slope_comes_out_negative() -> None:
    """Dynamo's mockers through its frontend: ~50 ms whatever the prompt's length, the
    slope slightly negative in the noise. The fit is the fixed cost, not a per-token rate
    that would price a long prompt many times over (the greedy drop of the fixed cost did)."""
    fit = _prefill_fit()
    for new, seconds in [(64, 0.052), (64, 0.049), (128, 0.051), (1280, 0.050), (1792, 0.048), (384, 0.050)]:
        fit.add(prefill_features(new, 0), seconds)
    coef = fit.coefficients()
    assert coef is not None and coef[0] == pytest.approx(0.05, rel=0.05) and coef[1] == 0.0
    assert fit.predict(prefill_features(1152, 0)) == pytest.approx(0.05, rel=0.05)


def test_provisional_rows_price_until_enough_real_ones_then_leave_the_fit() -> None:
    """Calibration's probes stand in for traffic, then leave: kept, they would bend the
    traffic's fit (here a probe set on another line entirely)."""
    fit = LinearFit(spread_feature=1, min_samples=4)
    for x in (1.0, 2.0, 3.0, 4.0):
        fit.add((1.0, x), 10.0 * x, provisional=True)  # the probes: y = 10 x
    assert fit.coefficients() == pytest.approx((0.0, 10.0), abs=1e-9)
    for x in (1.0, 2.0, 3.0):
        fit.add((1.0, x), 1.0 + x)  # traffic: y = 1 + x, not enough of it yet
    assert len(fit) == 7
    fit.add((1.0, 4.0), 5.0)  # the fourth: the probes leave
    assert len(fit) == 4
    assert fit.coefficients() == pytest.approx((1.0, 1.0), abs=1e-9)


def test_a_probe_beyond_the_traffic_stays_however_much_traffic_passes() -> None:
    """Traffic of short prefills alone cannot tell a per-token rate from a fixed cost: a
    long probe where the traffic has not been stays in the fit (outside the window), and
    prices a long prefill as measured; a probe within the traffic's span leaves."""
    fit = LinearFit(spread_feature=1, min_samples=4, window=8)
    for x in (50.0, 1000.0):
        fit.add((1.0, x), 1.0 + 0.01 * x, provisional=True)  # the engine: y = 1 + 0.01 x
    for n in range(20):  # traffic of short prefills, timed with noise that tilts the slope
        x = 40.0 + n % 3 * 10
        fit.add((1.0, x), 1.0 + 0.01 * x + (0.2 if x == 60.0 else 0.0))
    assert len(fit) == 9  # the window's 8 and the 1,000-token probe; the 50-token one is covered
    assert fit.predict((1.0, 1000.0)) == pytest.approx(11.0, rel=0.05)
