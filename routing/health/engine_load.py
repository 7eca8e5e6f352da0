"""An engine's self-reported load, as the router's poller last read it
(:mod:`kvpilot.routing.ingest.engine_metrics`) and as the decision and pair health use it. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.routing.health.pair_health import TransferCounters


@dataclass(frozen=True, slots=True)
class RateCounters:
    """One engine's cumulative counters behind its rates, as its ``/metrics`` reported
    them (summed over label sets): ``vllm:request_prefill_time_seconds`` (``_sum``,
    ``_count``), ``vllm:prompt_tokens_by_source_total`` by source,
    ``vllm:inter_token_latency_seconds`` (``_sum``, ``_count``), and the bytes it read
    over NIXL (``vllm:nixl_bytes_transferred_sum``; the reads' count and time are in
    :class:`~kvpilot.routing.health.pair_health.TransferCounters`)."""

    prefill_seconds: float = 0.0
    prefill_requests: float = 0.0
    computed_tokens: float = 0.0
    cached_tokens: float = 0.0
    external_tokens: float = 0.0
    decode_step_seconds: float = 0.0
    decode_steps: float = 0.0
    read_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's self-reported load at ``at`` (``time.monotonic()``)."""

    running: float
    waiting: float
    kv_usage: float
    at: float
    transfer: TransferCounters = field(default_factory=TransferCounters)
    rates: RateCounters = field(default_factory=RateCounters)
