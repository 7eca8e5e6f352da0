"""Which workers' KV events have gone quiet while they keep serving. Pure; the
caller passes the clock and each worker's count of applied event batches.

A worker that computes a full block it did not have publishes a ``BlockStored``
for it. So once the router has seen a worker prefill past its indexed prefix,
it *expects* a batch from that worker. If ``stale_after_s`` passes with no new
batch, the worker's events have stopped (a broken publisher, a dropped
connection, a misconfigured endpoint) and its index entries can no longer be
trusted: the router routes to it on load alone (no overlap credit), and says so
in ``kvpilot_router_kv_events_stale{worker}``. The first batch that arrives
clears the flag. ``stale_after_s == 0`` disables the watch.

A false alarm costs only the worker's overlap credit until its next batch; the
expectation is raised only by a prefill of at least one block the index did not
hold for that worker, which a live publisher always reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.routing.ids import WorkerId


@dataclass(frozen=True, slots=True)
class Transitions:
    """What one :meth:`EventWatch.update` changed: the workers it flagged and the ones it
    cleared."""

    went_stale: tuple[WorkerId, ...] = ()
    heard_again: tuple[WorkerId, ...] = ()


@dataclass
class _Expectation:
    since: float
    batches_then: int


_NOTHING = Transitions()


class EventWatch:
    def __init__(self, stale_after_s: float) -> None:
        if stale_after_s < 0:
            raise ValueError("stale_after_s must be >= 0")
        self.stale_after_s = stale_after_s
        self._expected: dict[WorkerId, _Expectation] = {}
        self._stale: set[WorkerId] = set()
        self.went_stale: dict[WorkerId, int] = {}
        """How many times each worker was flagged (a counter)."""

    @property
    def enabled(self) -> bool:
        return self.stale_after_s > 0

    def expect(self, worker: WorkerId, batches: int, now: float) -> None:
        """``worker`` prefilled at least one block its index entries lacked; it had
        applied ``batches`` event batches by then. Keeps an older expectation."""
        if self.enabled and worker not in self._expected:
            self._expected[worker] = _Expectation(now, batches)

    def update(self, batches: dict[WorkerId, int], now: float) -> Transitions:
        """Settle expectations against each worker's applied-batch count at ``now``:
        a worker with a new batch is heard (and no longer stale); one still silent
        ``stale_after_s`` after its expectation is flagged. Returns who changed, in the
        order their expectations were raised."""
        flagged: list[WorkerId] = []
        cleared: list[WorkerId] = []
        for worker, expectation in list(self._expected.items()):
            if batches.get(worker, expectation.batches_then) > expectation.batches_then:
                del self._expected[worker]
                if worker in self._stale:
                    self._stale.discard(worker)
                    cleared.append(worker)
            elif now - expectation.since >= self.stale_after_s and worker not in self._stale:
                self._stale.add(worker)
                self.went_stale[worker] = self.went_stale.get(worker, 0) + 1
                flagged.append(worker)
        if not flagged and not cleared:
            return _NOTHING
        return Transitions(tuple(flagged), tuple(cleared))

    def is_stale(self, worker: WorkerId) -> bool:
        return worker in self._stale

    @property
    def stale(self) -> frozenset[WorkerId]:
        return frozenset(self._stale)
