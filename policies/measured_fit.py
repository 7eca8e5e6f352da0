"""Fitting measured durations: non-negative least squares over the newest samples,
and the prefill model both the router (:mod:`kvpilot.routing.decide.rates`) and the
connector's pull policy (:mod:`kvpilot.kvconnectors.step_rates`) fit. Pure: no I/O, no
clock (a window is a count of samples, not a time).

The prefill of ``n`` new (uncached) tokens after ``C`` cached ones::

    seconds = a + b * n + c * (n * C + n * (n + 1) / 2)

a fixed cost, the linear layers (per token) and attention over the causal (query,
key) pairs (per pair): :func:`prefill_features` are its features, in that order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

MIN_SAMPLES = 4
"""Samples a model needs before its fit replaces the prior."""
WINDOW = 64
"""The newest samples each model fits (older ones are forgotten: the engine's load and
build may change)."""
PREFILL_SPREAD_FEATURE = 1
"""The prefill model needs samples at two token counts or more (:class:`LinearFit`'s
``spread_feature``)."""


def attention_pairs(new: int, cached: int) -> float:
    """The (query, key) pairs ``new`` tokens attend to after ``cached`` ones (causal)."""
    return new * cached + new * (new + 1) / 2


def prefill_features(new: int, cached: int) -> tuple[float, float, float]:
    """The prefill model's features: ``(1, n, attention_pairs(n, C))``."""
    return (1.0, float(new), attention_pairs(new, cached))


OUTLIER_SPREADS = 4.0
"""A sample is an outlier when its residual is off the residuals' median by over this many
robust standard deviations (1.4826 x their median absolute deviation) ..."""
OUTLIER_SHARE = 0.5
"""... and over this share of the fitted value: far off both for the noise and for the sample."""


def outliers(y: np.ndarray, fitted: np.ndarray) -> np.ndarray:
    """Which samples ``y`` the ``fitted`` values explain worst (a boolean mask): see
    :data:`OUTLIER_SPREADS` and :data:`OUTLIER_SHARE`."""
    residual = y - fitted
    off = np.abs(residual - np.median(residual))  # a far outlier shifts every residual: measured from their median
    spread = 1.4826 * float(np.median(off))
    mask: np.ndarray = (off > OUTLIER_SPREADS * spread) & (off > OUTLIER_SHARE * np.abs(fitted))
    return mask


@dataclass
class LinearFit:
    """``y ~ features . coef`` over the traffic's newest ``window`` samples (and the
    calibration probes where the traffic has not been: :meth:`add`), coefficients >= 0: the
    exact non-negative least squares (of every subset of the features whose own fit has
    no negative coefficient, the one with the least squared error; the models have two
    or three features). A greedy "drop a term while one is negative" is not it: samples
    whose seconds barely vary with the tokens (a fixed cost that dominates) give a
    slightly negative per-token slope, and dropping the fixed cost for it prices a
    prompt by its length alone, many times off.

    :meth:`coefficients` is ``None`` with fewer than ``min_samples``
    samples or when the first varying feature (``spread_feature``) takes one value only,
    unless ``flat_spread_ok``: then that feature is dropped (coefficient 0) and the rest
    fitted (a decode step timed at one stream count only is that count's mean, not the
    prior's)."""

    spread_feature: int
    window: int = WINDOW
    min_samples: int = MIN_SAMPLES
    flat_spread_ok: bool = False
    _rows: deque[tuple[tuple[float, ...], float]] = field(init=False)
    """The traffic's newest ``window`` samples."""
    _probes: list[tuple[tuple[float, ...], float]] = field(init=False, default_factory=list)
    """The provisional samples (:meth:`add`), outside the window."""
    _fitted: tuple[tuple[float, ...] | None] | None = field(init=False, default=None)
    """The last :meth:`coefficients`, until the next :meth:`add` (each route asks many times)."""
    _in_fit: list[tuple[tuple[float, ...], float]] | None = field(init=False, default=None)
    """The last :meth:`_fitted_rows`, until the next :meth:`add` (``len`` is asked per estimate)."""

    def __post_init__(self) -> None:
        self._rows = deque(maxlen=self.window)

    def add(self, features: Sequence[float], y: float, *, provisional: bool = False) -> None:
        """One sample. A ``provisional`` one (a calibration probe's, timed before any
        traffic) stands in until ``min_samples`` samples that are not have arrived and
        theirs span its ``spread_feature`` (a probe of 1,024 tokens, once the traffic has
        prefilled both shorter and longer prompts); then it leaves the fit: probes are not
        the traffic, and kept where the traffic has been they would blend into its fit
        (their lengths, not the traffic's, would set its curve). Where the traffic has not
        been, the probe is the engine's only measurement, and stays however much traffic
        passes: without it, a D whose traffic was a session's short increments alone would
        price a long local prefill by a per-token rate extrapolated far beyond those
        increments."""
        row = (tuple(float(f) for f in features), float(y))
        (self._probes if provisional else self._rows).append(row)
        self._fitted = self._in_fit = None

    def _fitted_rows(self) -> list[tuple[tuple[float, ...], float]]:
        """The traffic's rows and the probes that still stand in (:meth:`add`)."""
        if self._in_fit is None:
            probes = self._probes
            if len(self._rows) >= self.min_samples:
                spread = [features[self.spread_feature] for features, _ in self._rows]
                low, high = min(spread), max(spread)
                probes = [p for p in probes if not low <= p[0][self.spread_feature] <= high]
            self._in_fit = [*probes, *self._rows]
        return self._in_fit

    def __len__(self) -> int:
        return len(self._fitted_rows())

    def coefficients(self) -> tuple[float, ...] | None:
        """The fit, once more with the samples it explains worst left out
        (:func:`outliers`: a step that stalled for seconds among steps of milliseconds
        must not set the rates), when at least ``min_samples`` remain."""
        if self._fitted is None:
            self._fitted = (self._fit(),)
        return self._fitted[0]

    def _fit(self) -> tuple[float, ...] | None:
        rows = self._fitted_rows()
        if len(rows) < self.min_samples:
            return None
        x = np.array([features for features, _ in rows])
        y = np.array([value for _, value in rows])
        coef = self._solve(x, y)
        if coef is None:
            return None
        inliers = ~outliers(y, x @ np.array(coef))
        if inliers.all() or inliers.sum() < self.min_samples:
            return coef
        refit = self._solve(x[inliers], y[inliers])
        return refit if refit is not None else coef

    def _solve(self, x: np.ndarray, y: np.ndarray) -> tuple[float, ...] | None:
        features = list(range(x.shape[1]))
        if np.ptp(x[:, self.spread_feature]) == 0:
            if not self.flat_spread_ok:
                return None
            features.remove(self.spread_feature)
        best: tuple[float, list[int], np.ndarray] | None = None
        for size in range(len(features), 0, -1):
            for keep in map(list, combinations(features, size)):
                coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
                if (coef < 0).any():
                    continue
                error = float(np.sum((x[:, keep] @ coef - y) ** 2))
                if best is None or error < best[0]:
                    best = (error, keep, coef)
            if best is not None and size == len(features):
                break  # every feature's own fit is non-negative: no subset fits better
        if best is None:
            return None
        out = [0.0] * x.shape[1]
        for i, c in zip(best[1], best[2], strict=True):
            out[i] = float(c)
        return tuple(out)

    def predict(self, features: Sequence[float]) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        return sum(c * f for c, f in zip(coef, features, strict=True))
