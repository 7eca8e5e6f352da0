"""The **kvpilot / Transfers** dashboard: NIXL's timings, bytes and failures, where prompt
tokens came from, what kvpilot verified, rejected and recomputed, and the KV bytes checked
after every read (digest mismatches, abandoned reads, the blocks they failed). Plain data
(:mod:`kvpilot.grafana.panel_spec`); no Grafana import."""

from __future__ import annotations

from kvpilot.grafana.panel_spec import (
    DATASOURCE,
    ENGINE,
    INSTANCE,
    MODEL,
    RATE,
    WORKER_VAR,
    DashboardSpec,
    Panel,
    Query,
    Row,
    mean,
    per_interval,
    quantiles,
)
from kvpilot.kvconnectors import vllm_metrics as vm

XFER, POST = vm.NIXL_XFER_TIME_SECONDS, vm.NIXL_POST_TIME_SECONDS
BYTES, DESCS = vm.NIXL_BYTES_TRANSFERRED, vm.NIXL_NUM_DESCRIPTORS

NIXL_ROW = Row(
    "NIXL transfers (vLLM's vllm:nixl_* on the engine that reads the KV)",
    (
        Panel(
            "Transfer time",
            "Duration of each NIXL read, from vLLM's histogram: p50, p95, p99 and the mean.",
            "s",
            (*quantiles(XFER, ENGINE), Query(mean(XFER, ENGINE), "mean")),
        ),
        Panel(
            "Post time",
            "Time to post a transfer (before the wire moves anything).",
            "s",
            (*quantiles(POST, ENGINE, (0.5, 0.99)), Query(mean(POST, ENGINE), "mean")),
        ),
        Panel(
            "Bytes per transfer",
            "KV bytes moved by one NIXL transfer: the mean and p90.",
            "bytes",
            (Query(mean(BYTES, ENGINE), "mean"), *quantiles(BYTES, ENGINE, (0.9,))),
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
            (Query(mean(DESCS, ENGINE), "mean"), *quantiles(DESCS, ENGINE, (0.9,))),
        ),
        Panel(
            "Failed transfers and notifications",
            "Transfers that failed (handshake, transfer or notification) and failed notifications, per interval.",
            "short",
            (
                Query(per_interval(vm.NIXL_NUM_FAILED_TRANSFERS.total, ENGINE, "instance"), "{{instance}} transfers"),
                Query(
                    per_interval(vm.NIXL_NUM_FAILED_NOTIFICATIONS.total, ENGINE, "instance"),
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
                Query(per_interval(vm.NIXL_NUM_KV_EXPIRED_REQS.total, ENGINE, "instance"), "{{instance}} expired"),
                Query(
                    per_interval(vm.NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY.total, ENGINE, "instance"),
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
            (Query(per_interval(vm.KVPILOT_REJECTED_BLOCKS.total, ENGINE, "reason"), "{{reason}}"),),
            stacked=True,
        ),
        Panel(
            "Recomputed tokens by reason",
            "Prompt tokens prefilled here although a peer offered their KV, by reason.",
            "short",
            (Query(per_interval(vm.KVPILOT_RECOMPUTED_TOKENS.total, ENGINE, "reason"), "{{reason}}"),),
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
                    per_interval(vm.KVPILOT_PULL_DECISIONS.total, ENGINE, "decision, reason"),
                    "{{decision}} ({{reason}})",
                ),
            ),
        ),
        Panel(
            "Failed pulls",
            "Pulls that failed in flight, by what vLLM did with the request.",
            "short",
            (Query(per_interval(vm.KVPILOT_LOAD_FAILURES.total, ENGINE, "action"), "{{action}}"),),
        ),
    ),
)

INTEGRITY_ROW = Row(
    "KV bytes checked after every read (vllm:kvpilot_*, issue 52)",
    (
        Panel(
            "Blocks checked and digest mismatches",
            "Blocks a reader digested after a read and compared with the holder's digests, and those whose bytes "
            "differed (never attached: recomputed from the first bad block).",
            "ops",
            (
                Query(
                    f"sum by (instance) (rate({vm.KVPILOT_DIGEST_CHECKED_BLOCKS.total}{{{ENGINE}}}[{RATE}]))",
                    "{{instance}} checked",
                ),
                Query(
                    f"sum by (instance) (rate({vm.KVPILOT_DIGEST_MISMATCH_BLOCKS.total}{{{ENGINE}}}[{RATE}]))",
                    "{{instance}} mismatched",
                ),
            ),
        ),
        Panel(
            "Reads abandoned at their deadline",
            "Reads of a peer's KV stopped past max(floor, bytes / measured rate x factor), and reads past it that "
            "the inner connector could not stop.",
            "short",
            (
                Query(per_interval(vm.KVPILOT_ABANDONED_READS.total, ENGINE, "instance"), "{{instance}} abandoned"),
                Query(per_interval(vm.KVPILOT_UNABORTABLE_READS.total, ENGINE, "instance"), "{{instance}} unstoppable"),
            ),
        ),
        Panel(
            "Blocks failed by the checks",
            "Blocks the reader's worker reported as failed loads, by why: a digest mismatch or a read past its "
            "deadline; vLLM's kv_load_failure_policy recomputes them (or fails the request).",
            "short",
            (Query(per_interval(vm.KVPILOT_INTEGRITY_FAILED_BLOCKS.total, ENGINE, "reason"), "{{reason}}"),),
            stacked=True,
        ),
        Panel(
            "Digest time",
            "Share of worker time spent digesting KV blocks (the holder's offered blocks, the reader's landed ones).",
            "percentunit",
            (
                Query(
                    f"sum by (instance) (rate({vm.KVPILOT_DIGEST_SECONDS.total}{{{ENGINE}}}[{RATE}]))", "{{instance}}"
                ),
            ),
        ),
        Panel(
            "Reads attached unchecked",
            "Reads attached on the token check alone: the holder's offer carried no KV digests (digests off there, "
            "or an engine with more than one worker), or digests are off here.",
            "ops",
            (
                Query(
                    f"sum by (instance) (rate({vm.KVPILOT_UNCHECKED_READS.total}{{{ENGINE}}}[{RATE}]))",
                    "{{instance}}",
                ),
            ),
        ),
        Panel(
            "Faults injected (tests only)",
            "Faults the data-plane fault injector put into reads, by kind; zero outside a test fleet.",
            "short",
            (Query(per_interval(vm.KVPILOT_FAULTS_INJECTED.total, ENGINE, "kind"), "{{kind}}"),),
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
            (Query(per_interval("agent_errors_total", AGENT, "worker, status"), "{{worker}} {{status}}"),),
        ),
    ),
)

TRANSFERS = DashboardSpec(
    "kvpilot-transfers",
    "kvpilot / Transfers",
    "KV transfers between vLLM engines: NIXL's timings, bytes and failures, where prompt tokens came from, and "
    "what kvpilot verified, rejected and recomputed, and the KV bytes checked after every read.",
    (NIXL_ROW, SOURCES_ROW, KVPILOT_ROW, INTEGRITY_ROW, NIXL_AGENT_ROW),
    (DATASOURCE, MODEL, INSTANCE, WORKER_VAR),
)
