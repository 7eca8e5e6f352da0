"""The Prometheus families of a vLLM engine's ``/metrics`` that kvpilot reads or
exports, each name defined once. Pure: no vLLM import (the router reads these
without vLLM installed).

Three owners, one namespace (``vllm:``):

* vLLM's own, registered by ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``);
* NIXL's, as vLLM exports them: ``NixlPromMetrics``
  (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py``), which any
  connector wrapping ``NixlConnector`` forwards to (kvpilot's does);
* kvpilot's, registered by :class:`kvpilot.kvconnectors.stats.KVPilotPromMetrics` through
  vLLM's connector metrics, so they extend vLLM's families under its prefix.

vLLM's and NIXL's names and kinds are as read from vLLM 0.32.0;
``tests/unit/kvconnectors/test_vllm_metrics.py`` checks each one against those
classes as installed.

A family is named by its base name, the one given to ``prometheus_client``; the
series a scrape shows derive from it: a gauge's own name, a counter's ``_total``,
a histogram's ``_bucket``, ``_sum`` and ``_count``. The family classes give only
the series their kind has, so asking a counter for ``_sum`` is a type error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GaugeFamily:
    name: str

    @property
    def sample(self) -> str:
        """The one series a gauge exposes: its own name."""
        return self.name


@dataclass(frozen=True, slots=True)
class CounterFamily:
    name: str

    @property
    def total(self) -> str:
        return f"{self.name}_total"


@dataclass(frozen=True, slots=True)
class HistogramFamily:
    name: str

    @property
    def bucket(self) -> str:
        return f"{self.name}_bucket"

    @property
    def sum(self) -> str:
        return f"{self.name}_sum"

    @property
    def count(self) -> str:
        return f"{self.name}_count"


Family = GaugeFamily | CounterFamily | HistogramFamily

# ---- vLLM's own (PrometheusStatLogger) --------------------------------------------
NUM_REQUESTS_RUNNING = GaugeFamily("vllm:num_requests_running")
NUM_REQUESTS_WAITING = GaugeFamily("vllm:num_requests_waiting")
KV_CACHE_USAGE_PERC = GaugeFamily("vllm:kv_cache_usage_perc")
"""A fraction (0-1), despite its name."""
REQUEST_SUCCESS = CounterFamily("vllm:request_success")
"""Requests finished, labelled ``finished_reason``; vLLM counts a request with the
prompt-token, KV-transfer and connector counts of every batch up to it."""
PROMPT_TOKENS_BY_SOURCE = CounterFamily("vllm:prompt_tokens_by_source")
"""Prompt tokens by where their KV came from: the ``source`` label, a :class:`PromptTokenSource`."""
PREFIX_CACHE_QUERIES = CounterFamily("vllm:prefix_cache_queries")
PREFIX_CACHE_HITS = CounterFamily("vllm:prefix_cache_hits")
REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = HistogramFamily("vllm:request_time_per_output_token_seconds")
REQUEST_PREFILL_TIME_SECONDS = HistogramFamily("vllm:request_prefill_time_seconds")
"""Per request, the time it spent in its prefill phase (scheduled to first token)."""
INTER_TOKEN_LATENCY_SECONDS = HistogramFamily("vllm:inter_token_latency_seconds")
"""Per output token after the first, the time since the previous one: a decode step."""


class PromptTokenSource(enum.Enum):
    """The ``source`` label of :data:`PROMPT_TOKENS_BY_SOURCE` (vLLM's ``PromptTokenStats.ALL_SOURCES``)."""

    LOCAL_COMPUTE = "local_compute"
    """Prefilled by this engine."""
    LOCAL_CACHE_HIT = "local_cache_hit"
    """Found in this engine's own prefix cache."""
    EXTERNAL_KV_TRANSFER = "external_kv_transfer"
    """Loaded by the KV connector (from a peer, over NIXL)."""


VLLM_FAMILIES: tuple[Family, ...] = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE_PERC,
    REQUEST_SUCCESS,
    PROMPT_TOKENS_BY_SOURCE,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
    REQUEST_PREFILL_TIME_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
)

# ---- NIXL's, as vLLM exports them (NixlPromMetrics; on the engine that reads the KV) ----
NIXL_XFER_TIME_SECONDS = HistogramFamily("vllm:nixl_xfer_time_seconds")
"""One read, from posting it to the engine step that sees it done."""
NIXL_POST_TIME_SECONDS = HistogramFamily("vllm:nixl_post_time_seconds")
NIXL_BYTES_TRANSFERRED = HistogramFamily("vllm:nixl_bytes_transferred")
"""Bytes per read; its ``_sum`` is the bytes moved."""
NIXL_NUM_DESCRIPTORS = HistogramFamily("vllm:nixl_num_descriptors")
NIXL_NUM_FAILED_TRANSFERS = CounterFamily("vllm:nixl_num_failed_transfers")
NIXL_NUM_FAILED_NOTIFICATIONS = CounterFamily("vllm:nixl_num_failed_notifications")
NIXL_NUM_KV_EXPIRED_REQS = CounterFamily("vllm:nixl_num_kv_expired_reqs")
"""Holds on blocks for a peer that expired before the peer read them."""
NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY = CounterFamily("vllm:nixl_num_notifications_after_expiry")

NIXL_FAMILIES: tuple[Family, ...] = (
    NIXL_XFER_TIME_SECONDS,
    NIXL_POST_TIME_SECONDS,
    NIXL_BYTES_TRANSFERRED,
    NIXL_NUM_DESCRIPTORS,
    NIXL_NUM_FAILED_TRANSFERS,
    NIXL_NUM_FAILED_NOTIFICATIONS,
    NIXL_NUM_KV_EXPIRED_REQS,
    NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY,
)

# ---- kvpilot's (KVPilotPromMetrics; what each counts: kvpilot.kvconnectors.stats.COUNTERS) ----
KVPILOT_OFFERS = CounterFamily("vllm:kvpilot_offers")
KVPILOT_VERIFIED_BLOCKS = CounterFamily("vllm:kvpilot_verified_blocks")
KVPILOT_REJECTED_BLOCKS = CounterFamily("vllm:kvpilot_rejected_blocks")
KVPILOT_VERIFY_SECONDS = CounterFamily("vllm:kvpilot_verify_seconds")
KVPILOT_RECOMPUTED_TOKENS = CounterFamily("vllm:kvpilot_recomputed_tokens")
KVPILOT_PULL_DECISIONS = CounterFamily("vllm:kvpilot_pull_decisions")
KVPILOT_LOAD_FAILURES = CounterFamily("vllm:kvpilot_load_failures")
KVPILOT_HOLDS_RELEASED = CounterFamily("vllm:kvpilot_holds_released")
KVPILOT_DIGEST_CHECKED_BLOCKS = CounterFamily("vllm:kvpilot_digest_checked_blocks")
KVPILOT_DIGEST_MISMATCH_BLOCKS = CounterFamily("vllm:kvpilot_digest_mismatch_blocks")
KVPILOT_DIGEST_SECONDS = CounterFamily("vllm:kvpilot_digest_seconds")
KVPILOT_UNCHECKED_READS = CounterFamily("vllm:kvpilot_unchecked_reads")
KVPILOT_ABANDONED_READS = CounterFamily("vllm:kvpilot_abandoned_reads")
KVPILOT_UNABORTABLE_READS = CounterFamily("vllm:kvpilot_unabortable_reads")
KVPILOT_INTEGRITY_FAILED_BLOCKS = CounterFamily("vllm:kvpilot_integrity_failed_blocks")
KVPILOT_FAULTS_INJECTED = CounterFamily("vllm:kvpilot_faults_injected")

KVPILOT_FAMILIES: tuple[CounterFamily, ...] = (
    KVPILOT_OFFERS,
    KVPILOT_VERIFIED_BLOCKS,
    KVPILOT_REJECTED_BLOCKS,
    KVPILOT_VERIFY_SECONDS,
    KVPILOT_RECOMPUTED_TOKENS,
    KVPILOT_PULL_DECISIONS,
    KVPILOT_LOAD_FAILURES,
    KVPILOT_HOLDS_RELEASED,
    KVPILOT_DIGEST_CHECKED_BLOCKS,
    KVPILOT_DIGEST_MISMATCH_BLOCKS,
    KVPILOT_DIGEST_SECONDS,
    KVPILOT_UNCHECKED_READS,
    KVPILOT_ABANDONED_READS,
    KVPILOT_UNABORTABLE_READS,
    KVPILOT_INTEGRITY_FAILED_BLOCKS,
    KVPILOT_FAULTS_INJECTED,
)
