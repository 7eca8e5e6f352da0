"""The shared fit: non-negative least squares over a window, and the prefill model (pure)."""

from __future__ import annotations

import pytest

from policies.measured_fit import (
    MIN_SAMPLES,
    PREFILL_DROP_ORDER,
    PREFILL_SPREAD_FEATURE,
    LinearFit,
    attention_pairs,
    prefill_features,
)


def _prefill_fit() -> LinearFit:
    return LinearFit(PREFILL_DROP_ORDER, PREFILL_SPREAD_FEATURE)


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
    fit = LinearFit(PREFILL_DROP_ORDER, PREFILL_SPREAD_FEATURE, window=4)
    for new in (10, 20, 30, 40):
        fit.add(prefill_features(new, 0), 1.0 * new)  # 0.1 s per token... of an old build
    for new in (10, 20, 30, 40):
        fit.add(prefill_features(new, 0), 0.001 * new)
    assert len(fit) == 4
    coef = fit.coefficients()
    assert coef is not None and coef[1] == pytest.approx(0.001)
