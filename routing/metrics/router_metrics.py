"""The router's Prometheus metrics (see docs/guides/router.md for the list)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvpilot.policies.failure import Recovery
from kvpilot.policies.session_hold import HoldDecision, HoldReason
from kvpilot.policies.session_options import Option
from kvpilot.routing.decide.session_record import StoreOp
from kvpilot.routing.decide.sessions import OfferUse
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.refusals import RejectReason

if TYPE_CHECKING:
    from kvpilot.routing.decide.lifecycle import CircuitChange
    from kvpilot.routing.decide.router import Route

log = logging.getLogger(__name__)

_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_DECISION_BUCKETS = (
    *(25e-6, 50e-6, 100e-6, 150e-6, 200e-6, 300e-6, 400e-6, 500e-6, 750e-6),
    *(0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1),
)
"""The decision alone takes tens of microseconds to milliseconds: finer than the TTFT buckets."""
_RATIO_BUCKETS = (0.125, 0.25, 0.5, 0.8, 1.25, 2, 4, 8, 16, 64, 256, 1024)
"""Observed over predicted: within 2x is (0.5, 2]; the wide top holds a roofline prior priced for
hardware other than the engine's."""


class RouterMetrics:
    """The router's Prometheus families, in a registry of its own.

    Counted per decision: ``kvpilot_router_decisions_total{kind,prefill,decode}``,
    ``kvpilot_router_overlap_blocks{tier}`` (the prefilling worker's creditable
    blocks per tier class), ``kvpilot_router_prompt_blocks_total`` and
    ``kvpilot_router_cached_blocks_total{tier}`` (hit rate = cached / prompt,
    also as the gauge ``kvpilot_router_cache_hit_ratio``). TTFT by stage
    (article section 10.4): ``kvpilot_router_ttft_stage_seconds{stage}`` with
    ``route`` (parse, tokenize, decide), ``prefill``
    (P's answer), ``decode_first_token`` (D's first SSE event; streams only),
    and the client's ``kvpilot_router_ttft_seconds``. The decision alone (the prompt's
    chain, the index match, the cost of every candidate: ``Router.route``; ``/debug/route``'s
    dry runs not counted):
    ``kvpilot_router_decision_seconds``. Failures:
    ``kvpilot_router_prefill_failures_total{worker,reason}``,
    ``kvpilot_router_prefill_fallbacks_total``, ``kvpilot_router_upstream_errors_total{worker}``.
    Sessions across pools: ``kvpilot_router_session_offers_total{outcome="sent"|"expired"|"unused"}``,
    ``kvpilot_router_session_options_total{option}`` (the article's option per later step),
    ``kvpilot_router_session_holds_total{decision,reason}`` (whether D holds a step's KV).
    The shared session store (``sessions.store: redis``): ``kvpilot_router_session_store_seconds{op}``
    (each read or write), ``kvpilot_router_session_store_errors_total{op}`` (each one that
    failed or timed out: the step was routed on local state, or the write dropped),
    ``kvpilot_router_session_store_restored_total`` (records newer than this router's view).
    Limits and admission: ``kvpilot_router_rejected_total{reason}``. Worker health:
    ``kvpilot_router_circuit_trips_total{worker}``, ``kvpilot_router_circuit_open{worker}``.
    Read at scrape time by the components' own collectors (:mod:`kvpilot.routing.metrics.collectors`),
    which the server registers into :attr:`registry`: KV-event ingest, index blocks,
    the ledger's load, the engines' own gauges, stopped KV events, pair penalties.
    """

    def __init__(self, workers: Sequence[WorkerId]) -> None:
        """``workers``: every worker's name, for the label sets that exist from the start."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "kvpilot_router_"
        self.decisions = Counter(p + "decisions", "Routing decisions", ["kind", "prefill", "decode"], registry=r)
        self.overlap = Histogram(
            p + "overlap_blocks",
            "Creditable prefix blocks of the prefilling worker, per tier class",
            ["tier"],
            buckets=_BLOCK_BUCKETS,
            registry=r,
        )
        self.prompt_blocks = Counter(p + "prompt_blocks", "Full prompt blocks routed", registry=r)
        self.cached_blocks = Counter(
            p + "cached_blocks", "Prompt blocks cached on the prefilling worker, per tier class", ["tier"], registry=r
        )
        self.hit_ratio = Gauge(p + "cache_hit_ratio", "Cached over prompt blocks since start (all tiers)", registry=r)
        self.ttft_stage = Histogram(
            p + "ttft_stage_seconds", "Time to first token by stage", ["stage"], buckets=_SECONDS_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Time to first token seen by the client (streams)", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.decision = Histogram(
            p + "decision_seconds",
            "Time of one routing decision (chain, index match, cost of every candidate)",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.predicted_ratio = Histogram(
            p + "ttft_observed_over_predicted",
            "Observed over predicted (measured rates, else the roofline prior), per decision: "
            "stage prefill = P's answer against its predicted queue + prefill; ttft = the client's "
            "first token (streams) against the predicted TTFT",
            ["stage"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.prefill_failures = Counter(
            p + "prefill_failures", "Remote prefills that failed", ["worker", "reason"], registry=r
        )
        self.fallbacks = Counter(
            p + "prefill_fallbacks", "Requests D prefilled and answered itself after P failed", registry=r
        )
        self.prefill_recoveries = Counter(
            p + "prefill_recoveries",
            "How requests whose prefill failed went on: another prefill worker, D itself, or an error at once",
            ["action"],
            registry=r,
        )
        for action in Recovery:
            self.prefill_recoveries.labels(action.value)
        self.upstream_errors = Counter(
            p + "upstream_errors", "Engine errors returned to clients", ["worker"], registry=r
        )
        self.retries = Counter(
            p + "retries",
            "Requests tried again on another decode worker after this one failed before anything reached the client",
            ["worker"],
            registry=r,
        )
        self.rejected = Counter(
            p + "rejected",
            "Requests refused before routing: " + ", ".join(reason.value for reason in RejectReason),
            ["reason"],
            registry=r,
        )
        self.circuit_trips = Counter(
            p + "circuit_trips", "Times a worker's circuit opened (it stopped being routed to)", ["worker"], registry=r
        )
        self.circuit_open = Gauge(p + "circuit_open", "1 while a worker's circuit is open", ["worker"], registry=r)
        self.session_offers = Counter(
            p + "session_offers",
            "D's offers of a session's KV at the session's next step: sent to P, dropped "
            "because D's hold ends before P could read it, or unused (another option was chosen)",
            ["outcome"],
            registry=r,
        )
        self.session_options = Counter(
            p + "session_options",
            "A session's later steps by the option chosen (article section 9.2)",
            ["option"],
            registry=r,
        )
        self.session_holds = Counter(
            p + "session_holds",
            "Sessions' steps handed to D, by whether D holds the step's KV for the next step once it "
            "finishes (vLLM's bidirectional mode) and why (kvpilot.policies.session_hold)",
            ["decision", "reason"],
            registry=r,
        )
        self.session_store_seconds = Histogram(
            p + "session_store_seconds",
            "Session store reads (before routing, bounded by sessions.store_read_timeout_s) "
            "and writes (after serving, bounded by sessions.store_write_timeout_s), answered or not",
            ["op"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.session_store_errors = Counter(
            p + "session_store_errors",
            "Session store reads that failed or timed out (the step was routed on this router's own "
            "state), writes that failed or timed out (the next step writes again), and the start's "
            "connect when the store did not answer",
            ["op"],
            registry=r,
        )
        self.session_store_restored = Counter(
            p + "session_store_restored",
            "Sessions whose stored record was newer than this router's view (after a restart, or "
            "a step served by another replica) and was taken",
            registry=r,
        )
        self._prompt, self._cached = 0, 0
        # Every label set that can be known up front exists from the start at 0, so a
        # dashboard's rate() or increase() sees the first event as an increase.
        for worker in workers:
            self.circuit_open.labels(worker).set(0)
            for per_worker in (self.circuit_trips, self.upstream_errors, self.retries):
                per_worker.labels(worker)
        for reason in RejectReason:
            self.rejected.labels(reason.value)
        for option in Option:
            self.session_options.labels(option.value)
        for op in StoreOp:
            self.session_store_errors.labels(op.value)
        for why in HoldReason:
            self.session_holds.labels(why.verdict, why.value)
        for outcome in get_args(OfferUse):
            if outcome != "none":  # no offer at all is not counted
                self.session_offers.labels(outcome)

    def held(self, decision: HoldDecision) -> None:
        """A session's step went to D with ``decision`` on its hold."""
        self.session_holds.labels(decision.reason.verdict, decision.reason.value).inc()

    def decided(self, route: Route, route_seconds: float) -> None:
        self.decisions.labels(route.kind.value, route.prefill_worker.name, route.decode.name).inc()
        if route.option is not None:
            self.session_options.labels(route.option.value).inc()
        self.prompt_blocks.inc(route.prompt_blocks)
        for tier, blocks in route.overlap._asdict().items():
            self.overlap.labels(tier).observe(blocks)
            self.cached_blocks.labels(tier).inc(blocks)
        self._prompt += route.prompt_blocks
        self._cached += sum(route.overlap)
        self.hit_ratio.set(self._cached / self._prompt if self._prompt else 0.0)
        self.ttft_stage.labels("route").observe(route_seconds)

    def prefill_failed(self, worker: str, reason: str, recovery: Recovery) -> None:
        """P's prefill failed for ``reason`` and the request went on by ``recovery`` (a
        fallback is counted in ``fallbacks`` once D answered it)."""
        self.prefill_failures.labels(worker, reason).inc()
        self.prefill_recoveries.labels(recovery.value).inc()

    def circuit_changed(self, change: CircuitChange | None) -> None:
        """A worker's circuit opened or closed: counted, its gauge set, logged."""
        if change is None:
            return
        worker = change.worker
        self.circuit_open.labels(worker).set(1 if change.opened else 0)
        if change.opened:
            self.circuit_trips.labels(worker).inc()
            log.warning("worker %s: circuit open for %.0f s; not routed to until then", worker, change.open_s)
        else:
            log.info("worker %s: answered again; circuit closed", worker)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
