""":class:`FleetHealth`: the health records of one router, held together with the clock they
are timed by and the engines' own reports, so that the decision reads them through one view
and the request's lifecycle books them through it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field

from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.engine_load import EngineLoad
from kvpilot.routing.health.event_watch import EventWatch
from kvpilot.routing.health.pair_health import Pair, PairHealth
from kvpilot.routing.ids import WorkerId


def _no_batches() -> Mapping[WorkerId, int]:
    return {}


@dataclass(frozen=True, slots=True)
class FleetHealth:
    """Who is fit to serve now: each worker's circuit (``breaker``), each (P, D) pair's recent
    transfers (``pair_health``), the workers whose KV events stopped (``event_watch``), each
    engine's self-reported load as last polled (``engine_load``: ``None`` for none polled),
    each subscribed worker's count of applied KV-event batches (``event_batches``), read on
    ``monotonic``'s clock. The records are owned here; the router reads them, the lifecycle
    books them."""

    breaker: CircuitBreaker
    pair_health: PairHealth
    event_watch: EventWatch
    engine_load: Callable[[WorkerId], EngineLoad | None] | None = None
    event_batches: Callable[[], Mapping[WorkerId, int]] = _no_batches
    monotonic: Callable[[], float] = field(default=time.monotonic)

    def barred(self) -> Set[WorkerId]:
        """The workers not to route to now: their circuits are open."""
        return self.breaker.barred(self.monotonic())

    def events_stale(self, worker: WorkerId) -> bool:
        """Whether ``worker``'s KV events stopped while it serves (it gets no overlap credit)."""
        return self.event_watch.is_stale(worker)

    def pair_penalties(self) -> Mapping[Pair, float]:
        """Per (P, D) pair with a record, the blocks its recent transfers add to its cost."""
        return self.pair_health.penalties(self.monotonic())
