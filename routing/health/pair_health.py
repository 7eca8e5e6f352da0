"""How well each (P, D) pair has been moving KV lately, as a cost in blocks. Pure;
the caller passes the clock.

Two sources feed it:

- the router's own outcomes: a remote prefill on P that failed for a request
  bound to D (:meth:`PairHealth.failed`);
- the engines' own cumulative counters, as the router polls their ``/metrics``
  (:class:`TransferCounters`): failed NIXL transfers and pulls given up
  (``vllm:nixl_num_failed_transfers_total``, ``vllm:kvpilot_load_failures_total``),
  leases that expired before the reader pulled (``vllm:nixl_num_kv_expired_reqs_total``),
  and transfer time (``vllm:nixl_xfer_time_seconds`` ``_sum`` / ``_count``).

An engine's counters do not name the peer, so the increase since its last
sample is shared evenly among the pairs it took part in (as P or D, from
:meth:`PairHealth.routed`) within :data:`ATTRIBUTION_WINDOW_S` before the
sample; a counter that went down (the engine restarted) starts a new baseline.
With one P per D the attribution is exact.

A pair's penalty, added to its Dynamo cost (:func:`kvpilot.routing.decide.cost.worker_terms`)::

    penalty = pair_failure_cost_blocks * failures  (halved every pair_failure_half_life_s)
            + pair_transfer_cost_blocks_per_s * mean transfer seconds (its last measured interval)

so a pair whose transfers keep failing or run slow loses to an equal healthy
one, and wins again as its failures age out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.routing.config import CostConfig
from kvpilot.routing.ids import WorkerId

Pair = tuple[WorkerId, WorkerId]
"""(prefill worker, decode worker)."""

ATTRIBUTION_WINDOW_S = 30.0
"""A request routed this long before an engine's sample may have caused what the
sample counts (its prefill, then the transfer, happen after routing)."""


@dataclass(frozen=True, slots=True)
class TransferCounters:
    """One engine's cumulative transfer counters, as its ``/metrics`` reported them."""

    failures: float = 0.0
    expired_leases: float = 0.0
    transfer_seconds: float = 0.0
    transfers: float = 0.0


@dataclass
class _PairState:
    failures: float = 0.0
    failures_at: float = 0.0
    mean_transfer_s: float = 0.0


@dataclass
class _WorkerState:
    counters: TransferCounters | None = None
    at: float | None = None
    routed: dict[Pair, float] = field(default_factory=dict)
    """Each pair the worker took part in, and when it was last routed."""


class PairHealth:
    def __init__(self, cfg: CostConfig) -> None:
        self.failure_cost_blocks = cfg.pair_failure_cost_blocks
        self.half_life_s = cfg.pair_failure_half_life_s
        self.transfer_cost_blocks_per_s = cfg.pair_transfer_cost_blocks_per_s
        self._pairs: dict[Pair, _PairState] = {}
        self._workers: dict[WorkerId, _WorkerState] = {}

    def routed(self, prefill: WorkerId, decode: WorkerId, now: float) -> None:
        """A request went to P then D at ``now``: their counters' next increases are
        partly this pair's."""
        for worker in (prefill, decode):
            self._workers.setdefault(worker, _WorkerState()).routed[(prefill, decode)] = now

    def failed(self, prefill: WorkerId, decode: WorkerId, now: float, count: float = 1.0) -> None:
        """``count`` transfer failures of the pair at ``now``."""
        state = self._pairs.setdefault((prefill, decode), _PairState())
        state.failures = self._decayed(state, now) + count
        state.failures_at = now

    def observe(self, worker: WorkerId, counters: TransferCounters, at: float) -> None:
        """``worker``'s counters as sampled at ``at``: attribute what grew since its
        previous sample. The same sample (same ``at``) again is a no-op."""
        state = self._workers.setdefault(worker, _WorkerState())
        if state.at == at:
            return
        last, state.counters, state.at = state.counters, counters, at
        state.routed = {pair: t for pair, t in state.routed.items() if t >= at - ATTRIBUTION_WINDOW_S}
        if last is None or counters == last or not state.routed:
            return
        grew = TransferCounters(
            counters.failures - last.failures,
            counters.expired_leases - last.expired_leases,
            counters.transfer_seconds - last.transfer_seconds,
            counters.transfers - last.transfers,
        )
        if min(grew.failures, grew.expired_leases, grew.transfer_seconds, grew.transfers) < 0:
            return  # the engine restarted: a new baseline
        share = 1.0 / len(state.routed)
        for pair in state.routed:
            if grew.failures + grew.expired_leases > 0:
                self.failed(*pair, at, (grew.failures + grew.expired_leases) * share)
            if grew.transfers > 0:
                self._pairs.setdefault(pair, _PairState()).mean_transfer_s = grew.transfer_seconds / grew.transfers

    def penalty_blocks(self, prefill: WorkerId, decode: WorkerId, now: float) -> float:
        """The pair's extra cost in blocks at ``now`` (0 for a pair never seen)."""
        state = self._pairs.get((prefill, decode))
        if state is None:
            return 0.0
        return (
            self.failure_cost_blocks * self._decayed(state, now)
            + self.transfer_cost_blocks_per_s * state.mean_transfer_s
        )

    def penalties(self, now: float) -> dict[Pair, float]:
        """:meth:`penalty_blocks` of every pair seen (every other pair's is 0): one call per
        request, however many pairs the fleet has."""
        return {(p, d): self.penalty_blocks(p, d, now) for p, d in self._pairs}

    def pairs(self) -> list[Pair]:
        """Every pair with a recorded failure or transfer time."""
        return list(self._pairs)

    def _decayed(self, state: _PairState, now: float) -> float:
        if not state.failures:
            return 0.0
        return float(state.failures * 0.5 ** (max(0.0, now - state.failures_at) / self.half_life_s))
