"""This engine's prefill rate, fitted from the timings of its own steps: the recompute
side of the pull policy once measured (issue 20). Pure: no vLLM, no clock; the
scheduler layer (:mod:`kvpilot.kvconnectors.scheduler`) reads the step from vLLM's scheduler
output and the times from its clock.

A *step* is one scheduler output and the model pass that runs it: it begins when vLLM's
scheduler builds the connector's metadata for it (``build_connector_meta``) and ends
when the scheduler hands the connector that pass's output (``update_connector_output``,
which vLLM 0.32 calls after every pass that ran, since a pass with a connector always
returns connector output). Its model is :mod:`kvpilot.policies.measured_fit`'s prefill model,
summed over the requests the step ran::

    seconds = a + b * N + c * P,   N = sum_r n_r,   P = sum_r attention_pairs(n_r, C_r)

for each request ``r`` scheduled ``n_r`` tokens after its ``C_r`` computed ones (a
decode token is a one-token chunk at its context): ``a`` the pass's fixed cost (the
weights, the step's overheads), ``b`` per token (the linear layers), ``c`` per (query,
key) pair (attention).

Which steps are samples:

- a step that runs a prefill chunk (a request that has produced no token yet, or that
  was resumed after a preemption) is one, with every token it ran, decodes included: a
  step that mixes decodes into a prefill is priced as both, never as a pure prefill of
  its prefill tokens;
- a decode-only step is not: a window of them (D decodes far more steps than it
  prefills) would hold one token count per batch size and crowd out the prefills the
  span's price is about;
- a step that ran nothing (only KV transfers polled) is not;
- a step whose end is not seen before the next one begins is dropped: that interval is
  not one step's (two batches in flight, as vLLM's async scheduling or pipeline
  parallelism run; vLLM's CPU backend switches async scheduling off). On such an
  engine no step is sampled and the roofline prior stands.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.policies.measured_fit import (
    MIN_SAMPLES,
    PREFILL_SPREAD_FEATURE,
    WINDOW,
    LinearFit,
    attention_pairs,
)
from kvpilot.policies.recompute_vs_transfer import MeasuredPrefill


@dataclass(frozen=True, slots=True)
class Chunk:
    """One request's share of a step: ``tokens`` scheduled after ``context`` computed
    ones; ``prefill`` if the request is still prefilling."""

    tokens: int
    context: int
    prefill: bool


def step_features(chunks: Iterable[Chunk]) -> tuple[float, float, float]:
    """The step model's features ``(1, N, P)`` (module doc)."""
    n = pairs = 0.0
    for chunk in chunks:
        n += chunk.tokens
        pairs += attention_pairs(chunk.tokens, chunk.context)
    return (1.0, n, pairs)


class StepRates:
    """The step model fitted over the newest ``window`` sampled steps; answers
    :class:`MeasuredPrefill` once ``min_samples`` of them span two token counts.
    Not thread-safe (the scheduler's thread only)."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self._fit = LinearFit(PREFILL_SPREAD_FEATURE, window, min_samples)
        self._open: tuple[tuple[float, float, float], float] | None = None

    def started(self, chunks: Iterable[Chunk], now: float) -> None:
        """A step was scheduled at ``now``. Drops a step still open (its end was not
        seen); opens this one if it is a sample (module doc)."""
        chunks = [c for c in chunks if c.tokens > 0]
        self._open = (step_features(chunks), now) if any(c.prefill for c in chunks) else None

    def finished(self, now: float) -> None:
        """The open step's pass ended at ``now`` (no open step: nothing to do)."""
        if self._open is None:
            return
        (features, at), self._open = self._open, None
        if now > at:
            self._fit.add(features, now - at)

    def __len__(self) -> int:
        """Steps sampled (at most the window)."""
        return len(self._fit)

    def measured(self) -> MeasuredPrefill | None:
        """The fitted rates, or ``None`` while the fit has too few usable samples."""
        coef = self._fit.coefficients()
        if coef is None:
            return None
        fixed, per_token, per_pair = coef
        return MeasuredPrefill(fixed_s=fixed, per_token_s=per_token, per_pair_s=per_pair, samples=len(self._fit))
