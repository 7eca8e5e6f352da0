"""What each kvpilot dashboard shows, as plain data: rows of panels, each panel a few
PromQL queries. No Grafana import: :mod:`kvpilot.grafana.generate` turns this into the
committed JSON, and ``kvpilot.deploy.dashboards`` reads that JSON back (the e2e test, the
PNG renderer).

Template variables the queries use (Grafana substitutes them; so does
``kvpilot.deploy.dashboards.substitute``):

* ``$datasource``: the Prometheus data source;
* ``$model``: vLLM's ``model_name`` label;
* ``$instance``: the engines' scrape ``instance`` (host:port of each engine);
* ``$worker``: the router's ``worker`` label (an engine's name in the router config);
* ``$__rate_interval``: Grafana's rate window (at least four scrape intervals).

Counters that the router creates at their first event (failures, refusals, rejected
KV events) are drawn as totals since the router started: ``rate()`` and
``increase()`` over a series whose first sample is already 1 read 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.kvconnectors.vllm_metrics import HistogramFamily

ENGINE = 'model_name=~"$model", instance=~"$instance"'
"""Selects the engines the dashboard's ``model`` and ``instance`` variables name."""
WORKER = 'worker=~"$worker"'
"""Selects the router's per-worker series by the ``worker`` variable."""
RATE = "$__rate_interval"


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    stacked: bool = False


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    label: str
    query: str
    """``label_values(...)`` for a query variable; empty for the data source variable."""


@dataclass(frozen=True, slots=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...]


def _vec(metric: str, sel: str) -> str:
    """``metric{sel}``, or the bare name (PromQL refuses an empty ``{}``)."""
    return f"{metric}{{{sel}}}" if sel else metric


def _quantiles(metric: HistogramFamily, sel: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le) (rate({_vec(metric.bucket, sel)}[{RATE}])))",
            f"p{round(q * 100)}",
        )
        for q in qs
    )


def _mean(metric: HistogramFamily, sel: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    total, count = _vec(metric.sum, sel), _vec(metric.count, sel)
    return f"sum{group} (rate({total}[{RATE}])) / sum{group} (rate({count}[{RATE}]))"


def _per_interval(series: str, sel: str, by: str) -> str:
    return f"sum by ({by}) (increase({_vec(series, sel)}[{RATE}]))"


DATASOURCE = Variable("datasource", "Data source", "")
RUNNING = vm.NUM_REQUESTS_RUNNING.sample
MODEL = Variable("model", "Model", f"label_values({RUNNING}, model_name)")
INSTANCE = Variable("instance", "Engine", f'label_values({RUNNING}{{model_name=~"$model"}}, instance)')
WORKER_VAR = Variable("worker", "Worker (router)", "label_values(kvpilot_router_active_requests, worker)")

XFER, POST = vm.NIXL_XFER_TIME_SECONDS, vm.NIXL_POST_TIME_SECONDS
BYTES, DESCS = vm.NIXL_BYTES_TRANSFERRED, vm.NIXL_NUM_DESCRIPTORS

NIXL_ROW = Row(
    "NIXL transfers (vLLM's vllm:nixl_* on the engine that reads the KV)",
    (
        Panel(
            "Transfer time",
            "Duration of each NIXL read, from vLLM's histogram: p50, p95, p99 and the mean.",
            "s",
            (*_quantiles(XFER, ENGINE), Query(_mean(XFER, ENGINE), "mean")),
        ),
        Panel(
            "Post time",
            "Time to post a transfer (before the wire moves anything).",
            "s",
            (*_quantiles(POST, ENGINE, (0.5, 0.99)), Query(_mean(POST, ENGINE), "mean")),
        ),
        Panel(
            "Bytes per transfer",
            "KV bytes moved by one NIXL transfer: the mean and p90.",
            "bytes",
            (Query(_mean(BYTES, ENGINE), "mean"), *_quantiles(BYTES, ENGINE, (0.9,))),
        ),
        Panel(
            "Throughput and per-transfer bandwidth",
            "Bytes read per second by each engine, and bytes over transfer time (the link speed one transfer sees).",
            "Bps",
            (
                Query(f"sum by (instance) (rate({BYTES.sum}{{{ENGINE}}}[{RATE}]))", "{{instance}} throughput"),
                Query(
                    f"sum(rate({BYTES.sum}{{{ENGINE}}}[{RATE}])) / sum(rate({XFER.sum}{{{ENGINE}}}[{RATE}]))",
                    "per-transfer bandwidth",
                ),
            ),
        ),
        Panel(
            "Transfers per second",
            "NIXL transfers completed per second, per engine.",
            "ops",
            (Query(f"sum by (instance) (rate({XFER.count}{{{ENGINE}}}[{RATE}]))", "{{instance}}"),),
        ),
        Panel(
            "Descriptors per transfer",
            "NIXL descriptors (one per contiguous block region) per transfer.",
            "short",
            (Query(_mean(DESCS, ENGINE), "mean"), *_quantiles(DESCS, ENGINE, (0.9,))),
        ),
        Panel(
            "Failed transfers and notifications",
            "Transfers that failed (handshake, transfer or notification) and failed notifications, per interval.",
            "short",
            (
                Query(_per_interval(vm.NIXL_NUM_FAILED_TRANSFERS.total, ENGINE, "instance"), "{{instance}} transfers"),
                Query(
                    _per_interval(vm.NIXL_NUM_FAILED_NOTIFICATIONS.total, ENGINE, "instance"),
                    "{{instance}} notifications",
                ),
            ),
        ),
        Panel(
            "Expired leases",
            "Requests whose KV the holder freed before the reader pulled it (counted on the holder), and completion "
            "notifications that arrived after that.",
            "short",
            (
                Query(_per_interval(vm.NIXL_NUM_KV_EXPIRED_REQS.total, ENGINE, "instance"), "{{instance}} expired"),
                Query(
                    _per_interval(vm.NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY.total, ENGINE, "instance"),
                    "{{instance}} notified after expiry",
                ),
            ),
        ),
    ),
)

BY_SOURCE = vm.PROMPT_TOKENS_BY_SOURCE.total
TRANSFERRED = vm.PromptTokenSource.EXTERNAL_KV_TRANSFER.value
SOURCES_ROW = Row(
    "Prompt tokens by source",
    (
        Panel(
            "Prompt tokens by source",
            "Where each prompt token's KV came from: computed here, a local prefix-cache hit, or a transfer.",
            "short",
            (Query(f"sum by (source) (rate({BY_SOURCE}{{{ENGINE}}}[{RATE}]))", "{{source}}"),),
            stacked=True,
        ),
        Panel(
            "Share of prompt tokens transferred",
            "Transferred prompt tokens over all prompt tokens.",
            "percentunit",
            (
                Query(
                    f'sum(rate({BY_SOURCE}{{{ENGINE}, source="{TRANSFERRED}"}}[{RATE}])) '
                    f"/ sum(rate({BY_SOURCE}{{{ENGINE}}}[{RATE}]))",
                    "transferred",
                ),
            ),
        ),
    ),
)

KVPILOT_ROW = Row(
    "kvpilot verification and pulls (vllm:kvpilot_*)",
    (
        Panel(
            "Offers and verified blocks",
            "Offers kvpilot stamped on a holder's answers, and remote blocks a reader verified and loaded.",
            "ops",
            (
                Query(
                    f"sum by (instance) (rate({vm.KVPILOT_OFFERS.total}{{{ENGINE}}}[{RATE}]))", "{{instance}} offers"
                ),
                Query(
                    f"sum by (instance) (rate({vm.KVPILOT_VERIFIED_BLOCKS.total}{{{ENGINE}}}[{RATE}]))",
                    "{{instance}} verified blocks",
                ),
            ),
        ),
        Panel(
            "Rejected blocks by reason",
            "Offered blocks a reader needed but did not load: token or contract mismatch, malformed params, a partial "
            "tail, an expired lease, a failed peer.",
            "short",
            (Query(_per_interval(vm.KVPILOT_REJECTED_BLOCKS.total, ENGINE, "reason"), "{{reason}}"),),
            stacked=True,
        ),
        Panel(
            "Recomputed tokens by reason",
            "Prompt tokens prefilled here although a peer offered their KV, by reason.",
            "short",
            (Query(_per_interval(vm.KVPILOT_RECOMPUTED_TOKENS.total, ENGINE, "reason"), "{{reason}}"),),
            stacked=True,
        ),
        Panel(
            "Verification time",
            "Share of scheduler time spent checking offers against this engine's block hashes.",
            "percentunit",
            (
                Query(
                    f"sum by (instance) (rate({vm.KVPILOT_VERIFY_SECONDS.total}{{{ENGINE}}}[{RATE}]))", "{{instance}}"
                ),
            ),
        ),
        Panel(
            "Pull vs recompute decisions",
            "Session pulls decided, by decision and by what decided: the policy pricing recomputing by the "
            "roofline prior (roofline) or by the engine's measured prefill rate (measured), or a fixed "
            "threshold (threshold).",
            "short",
            (
                Query(
                    _per_interval(vm.KVPILOT_PULL_DECISIONS.total, ENGINE, "decision, reason"),
                    "{{decision}} ({{reason}})",
                ),
            ),
        ),
        Panel(
            "Failed pulls",
            "Pulls that failed in flight, by what vLLM did with the request.",
            "short",
            (Query(_per_interval(vm.KVPILOT_LOAD_FAILURES.total, ENGINE, "action"), "{{action}}"),),
        ),
    ),
)

AGENT = 'agent_name=~".+"'
NIXL_AGENT_ROW = Row(
    "NIXL agent telemetry (NIXL's own Prometheus exporter)",
    (
        Panel(
            "NIXL agent bytes",
            "Bytes each engine's NIXL agent received (reads) and sent, per second.",
            "Bps",
            (
                Query(f"sum by (worker) (rate(agent_rx_bytes_total{{{AGENT}}}[{RATE}]))", "{{worker}} rx"),
                Query(f"sum by (worker) (rate(agent_tx_bytes_total{{{AGENT}}}[{RATE}]))", "{{worker}} tx"),
            ),
        ),
        Panel(
            "NIXL agent mean transfer time",
            "The agent's transfer time over its transfer requests (NIXL counts µs).",
            "s",
            (
                Query(
                    f"sum by (worker) (rate(agent_xfer_time_total{{{AGENT}}}[{RATE}])) / 1e6 / sum by (worker) "
                    f"(rate(agent_rx_requests_num_total{{{AGENT}}}[{RATE}]) "
                    f"+ rate(agent_tx_requests_num_total{{{AGENT}}}[{RATE}]))",
                    "{{worker}}",
                ),
            ),
        ),
        Panel(
            "NIXL agent errors by status",
            "Errors NIXL's agent counted, by status.",
            "short",
            (Query(_per_interval("agent_errors_total", AGENT, "worker, status"), "{{worker}} {{status}}"),),
        ),
    ),
)

TRANSFERS = DashboardSpec(
    "kvpilot-transfers",
    "kvpilot / Transfers",
    "KV transfers between vLLM engines: NIXL's timings, bytes and failures, where prompt tokens came from, and "
    "what kvpilot verified, rejected and recomputed.",
    (NIXL_ROW, SOURCES_ROW, KVPILOT_ROW, NIXL_AGENT_ROW),
    (DATASOURCE, MODEL, INSTANCE, WORKER_VAR),
)

DECISIONS = "kvpilot_router_decisions_total"
STAGE = HistogramFamily("kvpilot_router_ttft_stage_seconds")
ROUTER_TTFT = HistogramFamily("kvpilot_router_ttft_seconds")
DECISIONS_ROW = Row(
    "Routing decisions",
    (
        Panel(
            "Decisions by kind",
            "Routing decisions per second: remote prefill, local prefill on D, co-located.",
            "ops",
            (Query(f"sum by (kind) (rate({DECISIONS}[{RATE}]))", "{{kind}}"),),
            stacked=True,
        ),
        Panel(
            "Decisions by pair",
            "Routing decisions per second by (prefill worker, decode worker).",
            "ops",
            (
                Query(
                    f'sum by (prefill, decode) (rate({DECISIONS}{{decode=~"$worker"}}[{RATE}]))',
                    "{{prefill}} -> {{decode}}",
                ),
            ),
        ),
        Panel(
            "Session steps by option",
            "A session's later steps by the option chosen (re-prefill, pull D's KV, affinity, shared tier, local).",
            "short",
            (Query(_per_interval("kvpilot_router_session_options_total", "", "option"), "{{option}}"),),
        ),
        Panel(
            "Session offers by outcome",
            "D's offers of a session's KV at its next step: sent to P, expired first, or unused.",
            "short",
            (Query(_per_interval("kvpilot_router_session_offers_total", "", "outcome"), "{{outcome}}"),),
        ),
    ),
)

TTFT_ROW = Row(
    "Time to first token by stage",
    (
        Panel(
            "Mean TTFT by stage",
            "The router's stages (route; P's prefill answer; D's first token, which includes D's NIXL read) beside "
            "the NIXL transfer time itself and the client's TTFT.",
            "s",
            (
                Query(_mean(STAGE, "", "stage"), "{{stage}}"),
                Query(_mean(XFER, ENGINE), "transfer (NIXL read)"),
                Query(_mean(ROUTER_TTFT, ""), "client TTFT (streams)"),
            ),
        ),
        Panel(
            "TTFT p50 / p95 / p99",
            "Time to first token as a streaming client sees it, through the router.",
            "s",
            _quantiles(ROUTER_TTFT, ""),
        ),
        Panel(
            "TTFT stage p95",
            "p95 of each stage.",
            "s",
            (Query(f"histogram_quantile(0.95, sum by (le, stage) (rate({STAGE.bucket}[{RATE}])))", "{{stage}}"),),
        ),
    ),
)

HITS_ROW = Row(
    "Cache hits: the router's prediction beside the engines' measurement",
    (
        Panel(
            "Predicted vs measured prefix-cache hit ratio",
            "The router's predicted hit ratio (cached over prompt blocks on the prefilling worker) beside the "
            'prefix-cache hit ratio the engines that prefill measured (role!="decode": every engine where the '
            "scrape has no role label).",
            "percentunit",
            (
                Query(
                    f"sum(rate(kvpilot_router_cached_blocks_total[{RATE}])) "
                    f"/ sum(rate(kvpilot_router_prompt_blocks_total[{RATE}]))",
                    "predicted (router)",
                ),
                Query(
                    f'sum(rate({vm.PREFIX_CACHE_HITS.total}{{{ENGINE}, role!="decode"}}[{RATE}])) '
                    f'/ sum(rate({vm.PREFIX_CACHE_QUERIES.total}{{{ENGINE}, role!="decode"}}[{RATE}]))',
                    "measured (engines)",
                ),
                Query("kvpilot_router_cache_hit_ratio", "predicted since router start"),
            ),
        ),
        Panel(
            "Predicted cached blocks by tier",
            "Prompt blocks routed per second, and those predicted cached, by tier.",
            "short",
            (
                Query(f"sum by (tier) (rate(kvpilot_router_cached_blocks_total[{RATE}]))", "cached {{tier}}"),
                Query(f"sum(rate(kvpilot_router_prompt_blocks_total[{RATE}]))", "prompt blocks"),
            ),
        ),
    ),
)

EVENTS = "kvpilot_router_kv_event"
INDEX_ROW = Row(
    "Block index and KV events",
    (
        Panel(
            "Index blocks per worker and tier",
            "Blocks the router's index holds for each worker, by tier.",
            "short",
            (Query(f"sum by (worker, tier) (kvpilot_router_index_blocks{{{WORKER}}})", "{{worker}} {{tier}}"),),
        ),
        Panel(
            "KV-event batches",
            "KV-event batches ingested per second, per worker.",
            "ops",
            (Query(f"sum by (worker) (rate({EVENTS}_batches_total{{{WORKER}}}[{RATE}]))", "{{worker}}"),),
        ),
        Panel(
            "KV-event gaps, replays and restarts",
            "Per interval: gaps in an engine's sequence, batches replayed to fill them, gaps the engine could no "
            "longer replay (the worker's entries are dropped), engine restarts, bad frames.",
            "short",
            tuple(
                Query(_per_interval(f"{EVENTS}_{s}_total", WORKER, "worker"), f"{{{{worker}}}} {s}")
                for s in ("gaps", "replayed", "unrecoverable_gaps", "restarts", "bad_frames")
            ),
        ),
        Panel(
            "Workers whose KV events stopped",
            "1 while a worker that prefilled new blocks has published no KV event for "
            "index.events_stale_after_s: it is routed on load alone until its next batch.",
            "short",
            (Query(f"max by (worker) (kvpilot_router_kv_events_stale{{{WORKER}}})", "{{worker}}"),),
        ),
        Panel(
            "KV events rejected (since router start)",
            "Malformed KV events skipped, by worker and reason.",
            "short",
            (
                Query(
                    f"sum by (worker, reason) (kvpilot_router_kv_events_rejected_total{{{WORKER}}})",
                    "{{worker}} {{reason}}",
                ),
            ),
        ),
    ),
)

LOAD_ROW = Row(
    "Load per worker",
    (
        Panel(
            "Active prefill and decode blocks",
            "The router's own ledger of blocks in flight per worker.",
            "short",
            (
                Query(f"sum by (worker) (kvpilot_router_active_prefill_blocks{{{WORKER}}})", "{{worker}} prefill"),
                Query(f"sum by (worker) (kvpilot_router_active_decode_blocks{{{WORKER}}})", "{{worker}} decode"),
            ),
        ),
        Panel(
            "Active requests",
            "Requests in flight per worker (router's ledger).",
            "short",
            (Query(f"sum by (worker) (kvpilot_router_active_requests{{{WORKER}}})", "{{worker}}"),),
        ),
        Panel(
            "Engine load",
            "Each engine's running and waiting requests, as the router last polled them.",
            "short",
            (
                Query(f"sum by (worker) (kvpilot_router_engine_running{{{WORKER}}})", "{{worker}} running"),
                Query(f"sum by (worker) (kvpilot_router_engine_waiting{{{WORKER}}})", "{{worker}} waiting"),
            ),
        ),
        Panel(
            "Engine KV-cache usage",
            "Each engine's KV-cache usage, as the router last polled it.",
            "percentunit",
            (Query(f"max by (worker) (kvpilot_router_engine_kv_usage{{{WORKER}}})", "{{worker}}"),),
        ),
    ),
)

FAILURES_ROW = Row(
    "Failures and admission",
    (
        Panel(
            "Prefill failures (since router start)",
            "Remote prefills that failed, by P and reason.",
            "short",
            (
                Query(
                    f"sum by (worker, reason) (kvpilot_router_prefill_failures_total{{{WORKER}}})",
                    "{{worker}} {{reason}}",
                ),
            ),
        ),
        Panel(
            "Prefill fallbacks",
            "Requests prefilled on D after P failed, per interval.",
            "short",
            (Query(f"sum(increase(kvpilot_router_prefill_fallbacks_total[{RATE}]))", "fallbacks"),),
        ),
        Panel(
            "Engine errors passed to clients (since router start)",
            "Engine errors the router returned, per worker.",
            "short",
            (Query(f"sum by (worker) (kvpilot_router_upstream_errors_total{{{WORKER}}})", "{{worker}}"),),
        ),
        Panel(
            "Retries on another decode worker",
            "Requests routed again without a D that failed before anything reached the client, per interval.",
            "short",
            (Query(_per_interval("kvpilot_router_retries_total", WORKER, "worker"), "{{worker}}"),),
        ),
        Panel(
            "Open circuits",
            "1 while a worker's circuit is open (it failed server.circuit_failures times in a row): not routed to.",
            "short",
            (Query(f"max by (worker) (kvpilot_router_circuit_open{{{WORKER}}})", "{{worker}}"),),
        ),
        Panel(
            "Pair penalty (blocks)",
            "Blocks added to each (P, D) pair's cost for its recent transfer failures and transfer time.",
            "short",
            (Query("max by (pair) (kvpilot_router_pair_penalty_blocks)", "{{pair}}"),),
        ),
        Panel(
            "Requests refused before routing (since router start)",
            "Admission and limits: body too large, prompt too long, max_tokens, queue full or timed out, unauthorized.",
            "short",
            (Query("sum by (reason) (kvpilot_router_rejected_total)", "{{reason}}"),),
        ),
    ),
)

ROUTER = DashboardSpec(
    "kvpilot-router",
    "kvpilot / Router",
    "The KV-aware router: decisions, TTFT by stage, predicted vs measured cache hits, the block index and its KV "
    "events, load per worker, failures and admission.",
    (DECISIONS_ROW, TTFT_ROW, HITS_ROW, INDEX_ROW, LOAD_ROW, FAILURES_ROW),
    (DATASOURCE, MODEL, INSTANCE, WORKER_VAR),
)

DASHBOARDS: tuple[DashboardSpec, ...] = (TRANSFERS, ROUTER)
