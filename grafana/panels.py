"""What each kvpilot dashboard shows, as plain data: :data:`DASHBOARDS`. The transfers
dashboard is :mod:`kvpilot.grafana.transfer_panels`; the router's is here; the vocabulary
(rows, panels, queries, template variables) is :mod:`kvpilot.grafana.panel_spec`. No Grafana
import: :mod:`kvpilot.grafana.generate` turns this into the committed JSON."""

from __future__ import annotations

from kvpilot.grafana.panel_spec import (
    DATASOURCE,
    ENGINE,
    INSTANCE,
    MODEL,
    RATE,
    WORKER,
    WORKER_VAR,
    DashboardSpec,
    Panel,
    Query,
    Row,
    Variable,
    mean,
    per_interval,
    quantiles,
)
from kvpilot.grafana.transfer_panels import TRANSFERS
from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.kvconnectors.vllm_metrics import HistogramFamily

__all__ = ["DASHBOARDS", "DashboardSpec", "Panel", "Query", "Row", "Variable"]

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
            (Query(per_interval("kvpilot_router_session_options_total", "", "option"), "{{option}}"),),
        ),
        Panel(
            "Session offers by outcome",
            "D's offers of a session's KV at its next step: sent to P, expired first, or unused.",
            "short",
            (Query(per_interval("kvpilot_router_session_offers_total", "", "outcome"), "{{outcome}}"),),
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
                Query(mean(STAGE, "", "stage"), "{{stage}}"),
                Query(mean(vm.NIXL_XFER_TIME_SECONDS, ENGINE), "transfer (NIXL read)"),
                Query(mean(ROUTER_TTFT, ""), "client TTFT (streams)"),
            ),
        ),
        Panel(
            "TTFT p50 / p95 / p99",
            "Time to first token as a streaming client sees it, through the router.",
            "s",
            quantiles(ROUTER_TTFT, ""),
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
                Query(per_interval(f"{EVENTS}_{s}_total", WORKER, "worker"), f"{{{{worker}}}} {s}")
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
            (Query(per_interval("kvpilot_router_retries_total", WORKER, "worker"), "{{worker}}"),),
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
