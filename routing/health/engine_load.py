"""An engine's self-reported load, as the router's poller last read it
(:mod:`routing.ingest.engine_metrics`) and as the decision and pair health use it. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from routing.health.pair_health import TransferCounters


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's self-reported load at ``at`` (``time.monotonic()``)."""

    running: float
    waiting: float
    kv_usage: float
    at: float
    transfer: TransferCounters = field(default_factory=TransferCounters)
