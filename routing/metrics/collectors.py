"""Scrape-time Prometheus collectors, one per router component (llm-d's
``instrumented_index.go`` is the model: the component does not know about metrics;
a collector beside it reads its public state when Prometheus scrapes).

Each collector is registered into :class:`kvpilot.routing.metrics.router_metrics.RouterMetrics`'s
registry by the server that owns the component; none reaches into another. The
per-worker ones ask for the workers at each scrape (``workers()``), so workers that
join or leave a live fleet are listed as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.ids import Tier, WorkerId
from kvpilot.routing.index.kvindex import KVIndex

if TYPE_CHECKING:
    from kvpilot.routing.health.event_watch import EventWatch
    from kvpilot.routing.health.pair_health import Pair, PairHealth
    from kvpilot.routing.ingest.engine_metrics import EngineLoadPoller
    from kvpilot.routing.ingest.feeder import IndexFeeder

P = "kvpilot_router_"
SUBSCRIBER_STATS = ("batches", "replayed", "replayed_blocks", "gaps", "unrecoverable_gaps", "restarts", "bad_frames")


class LedgerCollector(Collector):
    """The router's own load per worker: ``kvpilot_router_active_{prefill_blocks,decode_blocks,requests}``."""

    FIELDS = ("active_prefill_blocks", "active_decode_blocks", "active_requests")

    def __init__(self, ledger: LoadLedger, workers: Callable[[], Sequence[WorkerId]]) -> None:
        self.ledger, self.workers = ledger, workers

    def collect(self) -> Iterator[Metric]:
        families = {
            f: GaugeMetricFamily(P + f, f"The router's own count of {f.replace('_', ' ')}", labels=["worker"])
            for f in self.FIELDS
        }
        for worker in self.workers():
            load = self.ledger.load(worker)
            for f, family in families.items():
                family.add_metric([worker], getattr(load, f))
        yield from families.values()


class IndexCollector(Collector):
    """``kvpilot_router_index_blocks{worker,tier}``, read on the thread that owns the index
    (the router's event loop, which serves ``/metrics``)."""

    def __init__(self, index: KVIndex, workers: Callable[[], Sequence[WorkerId]], tiers: Sequence[str]) -> None:
        self.index, self.workers, self.tiers = index, workers, tuple(tiers)

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(P + "index_blocks", "Blocks in the index", labels=["worker", "tier"])
        for worker in self.workers():
            for tier in self.tiers:
                blocks.add_metric([worker, tier], self.index.block_count(worker, Tier(tier)))
        yield blocks


class FeederCollector(Collector):
    """KV-event ingest per worker: ``kvpilot_router_kv_event_<stat>_total`` and
    ``kvpilot_router_kv_events_rejected_total{worker,reason}``. ``feeder()`` is the
    running feeder, or None (before the app starts, or without KV events): the
    families are then exposed empty."""

    def __init__(self, feeder: Callable[[], IndexFeeder | None]) -> None:
        self.feeder = feeder

    def collect(self) -> Iterator[Metric]:
        families = {
            s: CounterMetricFamily(f"{P}kv_event_{s}", f"KV-event {s} per worker", labels=["worker"])
            for s in SUBSCRIBER_STATS
        }
        rejected = CounterMetricFamily(
            P + "kv_events_rejected", "Malformed KV events skipped", labels=["worker", "reason"]
        )
        feeder = self.feeder()
        for sub in feeder.subscribers if feeder is not None else ():
            for s in SUBSCRIBER_STATS:
                families[s].add_metric([sub.worker], getattr(sub.stats, s))
            for rejection, n in dict(sub.decoder.rejections).items():  # a copy: the feeder's thread counts on
                rejected.add_metric([sub.worker, rejection.value], n)
        yield from families.values()
        yield rejected


class EngineLoadCollector(Collector):
    """The engines' own gauges as last polled (``kvpilot_router_engine_{running,waiting,kv_usage}``,
    absent while stale) and unreadable polls (``kvpilot_router_engine_metrics_failures_total``)."""

    FIELDS = ("running", "waiting", "kv_usage")

    def __init__(self, poller: EngineLoadPoller, workers: Callable[[], Sequence[WorkerId]]) -> None:
        self.poller, self.workers = poller, workers

    def collect(self) -> Iterator[Metric]:
        families = {
            f: GaugeMetricFamily(f"{P}engine_{f}", f"The engine's own {f} (its /metrics)", labels=["worker"])
            for f in self.FIELDS
        }
        failures = CounterMetricFamily(
            P + "engine_metrics_failures", "Unreadable engine /metrics polls", labels=["worker", "reason"]
        )
        for worker in self.workers():
            reported = self.poller.latest(worker)
            if reported is not None:
                for f, family in families.items():
                    family.add_metric([worker], getattr(reported, f))
        for (worker, reason), n in self.poller.failures.items():
            failures.add_metric([worker, reason], n)
        yield from families.values()
        yield failures


class EventWatchCollector(Collector):
    """``kvpilot_router_kv_events_stale{worker}`` and ``_went_stale_total{worker}``."""

    def __init__(self, watch: EventWatch, workers: Callable[[], Sequence[WorkerId]]) -> None:
        self.watch, self.workers = watch, workers

    def collect(self) -> Iterator[Metric]:
        stale = GaugeMetricFamily(
            P + "kv_events_stale",
            "1 while a worker's KV events have stopped after it prefilled new blocks: routed on load alone",
            labels=["worker"],
        )
        went_stale = CounterMetricFamily(
            P + "kv_events_went_stale", "Times a worker's KV events were found stopped", labels=["worker"]
        )
        for worker in self.workers():
            stale.add_metric([worker], float(self.watch.is_stale(worker)))
            went_stale.add_metric([worker], self.watch.went_stale.get(worker, 0))
        yield stale
        yield went_stale


class PairHealthCollector(Collector):
    """``kvpilot_router_pair_penalty_blocks{pair}`` for every (P, D) pair of the fleet."""

    def __init__(self, health: PairHealth, pairs: Callable[[], Sequence[tuple[str, Pair]]]) -> None:
        """``pairs()``: (the pair's name, (P, D)) for each pair."""
        self.health, self.pairs = health, pairs

    def collect(self) -> Iterator[Metric]:
        penalty = GaugeMetricFamily(
            P + "pair_penalty_blocks",
            "Blocks added to a (P, D) pair's cost for its recent transfer failures and transfer time",
            labels=["pair"],
        )
        now = time.monotonic()
        for name, (prefill, decode) in self.pairs():
            penalty.add_metric([name], self.health.penalty_blocks(prefill, decode, now))
        yield penalty
