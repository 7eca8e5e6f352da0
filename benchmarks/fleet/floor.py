"""The TTFT floor of a fleet benchmark's workload: the mean TTFT no router can beat. Pure.

A request served alone, on an idle worker that already holds every block of its prompt
that any fleet could reuse (:func:`fleet_trace.ideal_hits`), computes only the rest: its
TTFT is the serving path's fixed cost plus the prefill of those new tokens. Routing can
at best give every request that; a queue, a colder worker or a longer path only add.

The floor is measured, not taken from the mocker's preset: calibration requests, each
alone on an idle worker of the same fleet (same speedup, same frontend), with prompts no
trace request shares (:func:`calibration_prompt`), give TTFT against the prompt length;
:func:`fit` fits the prefill model of :mod:`kvpilot.policies.measured_fit` (fixed cost, per
token, per causal attention pair) with nothing cached, and :func:`floor_ttfts` prices each
request's new tokens with the attention to its cached prefix left out. Where the fit's
attention term is positive that makes each floor lower than the same model's price of the
request: a lower bound under the model, whatever the mocker charges for cached context.

So a target of ``(1 - margin)`` times an arm's mean TTFT is out of every router's reach
when it lies below the floor's mean (:func:`reachable`). Each request's floor and the
calibration's ITL (each request alone on its worker) are what the scale-free SLOs multiply
(:meth:`fleet_goodput.Slo.scale_free`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.fleet.trace import FIRST_ORDINARY_ID
from kvpilot.policies.measured_fit import PREFILL_SPREAD_FEATURE, LinearFit, prefill_features

QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Where the calibration lengths sit among the workload's new-token counts."""
REPEATS = 2
"""Calibration requests per length."""
OUTPUT_TOKENS = 16
"""Tokens each calibration request asks for: its ITL is an idle worker's."""
WARMUP = 2
"""Calibration requests sent first and left out of the fit (a path's first request pays
its connections and caches)."""


@dataclass(frozen=True, slots=True)
class Floor:
    """The fitted floor: ``(fixed s, s per token, s per attention pair)``, each request's
    floor and their mean over the workload, and an idle worker's ITL."""

    coefficients: tuple[float, ...]
    samples: tuple[tuple[int, float], ...]
    """The calibration's (prompt tokens, TTFT s), warm-up excluded."""
    request_ttft_s: tuple[float, ...]
    """Each request's floor (:func:`floor_ttfts`), by index."""
    idle_itl_s: float = math.nan
    """The median ITL of the calibration's requests, each alone on its worker."""

    @property
    def mean_s(self) -> float:
        """The mean of the requests' floors: the mean TTFT no router can beat."""
        return statistics.fmean(self.request_ttft_s)


def calibration_lengths(new_tokens: Sequence[int], floor_tokens: int = 32) -> list[int]:
    """Prompt lengths spanning the workload's new-token counts (:data:`QUANTILES`, each at
    least ``floor_tokens``), each :data:`REPEATS` times, shortest first; at least two
    distinct lengths (the fit needs a spread). Raises ValueError for no requests."""
    if not new_tokens:
        raise ValueError("no requests to calibrate for")
    picked = sorted({max(floor_tokens, int(np.quantile(new_tokens, q))) for q in QUANTILES})
    if len(picked) < 2:
        picked.append(2 * picked[0])
    return [n for n in picked for _ in range(REPEATS)]


def calibration_prompt(length: int, index: int, vocab_size: int, seed: int) -> list[int]:
    """``length`` seeded token ids in ``[FIRST_ORDINARY_ID, vocab_size)`` for calibration
    request ``index``: a stream apart from :class:`fleet_trace.PromptSynth`'s (whose seeds
    are ``[seed, hash_id]``), so no block is shared with the trace or another calibration
    request but by chance (a 32-token block: ``vocab ** -32``)."""
    rng = np.random.default_rng([seed, index, length, 0xF100])
    return [int(i) for i in rng.integers(FIRST_ORDINARY_ID, vocab_size, length)]


def fit(samples: Sequence[tuple[int, float]]) -> tuple[float, ...]:
    """The prefill model's coefficients (non-negative) fitted to ``(prompt tokens, TTFT s)``
    with nothing cached. Raises ValueError when they do not determine it (too few samples,
    one length only)."""
    model = LinearFit(PREFILL_SPREAD_FEATURE, window=max(1, len(samples)))
    for tokens, ttft in samples:
        model.add(prefill_features(tokens, 0), ttft)
    coefficients = model.coefficients()
    if coefficients is None:
        raise ValueError(f"{len(samples)} calibration samples do not determine a fit")
    return coefficients


def floor_ttfts(coefficients: Sequence[float], new_tokens: Sequence[int]) -> list[float]:
    """Each request's floor: the model's price of its new tokens alone (module doc)."""
    return [float(np.dot(coefficients, prefill_features(n, 0))) for n in new_tokens]


def measure(samples: Sequence[tuple[int, float]], new_tokens: Sequence[int], itls: Sequence[float] = ()) -> Floor:
    """:func:`fit` of ``samples``, its :func:`floor_ttfts` of ``new_tokens`` and their mean,
    and the median of the calibration's ``itls`` (NaN without one)."""
    coefficients = fit(samples)
    floors = tuple(floor_ttfts(coefficients, new_tokens))
    idle_itl = statistics.median(itls) if itls else math.nan
    return Floor(coefficients, tuple(samples), floors, idle_itl)


def reachable(ttft_mean_s: float, margin: float, floor: Floor) -> bool:
    """Whether a mean TTFT ``margin`` below ``ttft_mean_s`` (0.2: 20% below) is at or above
    the floor, so that some router could reach it."""
    return (1.0 - margin) * ttft_mean_s >= floor.mean_s
