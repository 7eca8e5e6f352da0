"""kvpilot's connector stats and Prometheus metrics, layered over the inner connector's.

vLLM collects ``KVConnectorStats`` from both sides of a connector (the worker's
transfer telemetry, the scheduler's decisions), aggregates them in the engine core,
ships ``to_dict()`` to the API server, and rebuilds them there with the connector
class's ``build_kv_connector_stats``. ``KVPilotStats`` carries two parts:

* ``inner``: the inner connector's own stats (NIXL's transfer histograms), passed
  through untouched, so ``vllm:nixl_*`` families keep their names and meaning;
* ``counters``: kvpilot's own counts, keyed ``"<counter>"`` or
  ``"<counter>:<reason>"`` for a labelled counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvpilot.kvconnectors import reasons, vllm_metrics
from kvpilot.kvconnectors.faults import FAULT_KINDS
from kvpilot.kvconnectors.pull_policy import DecidedBy


@dataclass(frozen=True, slots=True)
class CounterSpec:
    """One kvpilot counter family. ``reasons`` non-empty means a ``reason`` label."""

    key: str
    metric: vllm_metrics.CounterFamily
    doc: str
    reasons: tuple[str, ...] = ()
    label_names: tuple[str, ...] = ("reason",)
    """The labels a reason fills; a reason is their values joined by ``/``."""


REASONS = tuple(reason.value for reason in reasons.REJECT_REASONS)
RECOMPUTE_REASONS = tuple(reason.value for reason in reasons.RECOMPUTE_REASONS)
INTEGRITY_REASONS = ("digest_mismatch", "deadline")
"""Why the worker failed a read's blocks: their bytes differ from the holder's, or the read was too slow."""
PULL_DECISIONS = tuple(f"{choice}/{by.value}" for choice in ("pull", "recompute") for by in DecidedBy)

COUNTERS: tuple[CounterSpec, ...] = (
    CounterSpec(
        "offers",
        vllm_metrics.KVPILOT_OFFERS,
        "Requests whose kv_transfer_params kvpilot stamped with a verifiable block offer for a peer.",
    ),
    CounterSpec(
        "verified_blocks",
        vllm_metrics.KVPILOT_VERIFIED_BLOCKS,
        "Remote blocks whose token hashes matched this engine's and that it loaded (beyond its local hit).",
    ),
    CounterSpec(
        "rejected_blocks",
        vllm_metrics.KVPILOT_REJECTED_BLOCKS,
        "Remote blocks offered and needed but not loaded, by reason.",
        REASONS,
    ),
    CounterSpec(
        "verify_seconds",
        vllm_metrics.KVPILOT_VERIFY_SECONDS,
        "Scheduler time spent checking peers' offers against this engine's block hashes.",
    ),
    CounterSpec(
        "recomputed_tokens",
        vllm_metrics.KVPILOT_RECOMPUTED_TOKENS,
        "Prompt tokens prefilled locally although a peer offered their KV, by reason (rejected, a partial "
        "last block, or the pull policy chose to recompute).",
        RECOMPUTE_REASONS,
    ),
    CounterSpec(
        "pull_decisions",
        vllm_metrics.KVPILOT_PULL_DECISIONS,
        "Session pulls (a peer's verified KV beyond the local hit) decided, by decision and by what decided "
        "(the policy on live load and link with recomputing priced by the roofline prior or by this engine's "
        "measured prefill rate, or a fixed kv_recompute_threshold).",
        PULL_DECISIONS,
        ("decision", "reason"),
    ),
    CounterSpec(
        "load_failures",
        vllm_metrics.KVPILOT_LOAD_FAILURES,
        "Pulls that failed in flight (dead holder, broken link, expired hold), by what vLLM's "
        "kv_load_failure_policy did with the request: recompute it here, or fail it.",
        ("fail", "recompute"),
        ("action",),
    ),
    CounterSpec(
        "holds_released",
        vllm_metrics.KVPILOT_HOLDS_RELEASED,
        "Finished requests whose blocks this engine freed at once because the router declined its hold "
        "for the session's next step (bidirectional mode holds them for decoder_kv_blocks_ttl otherwise).",
    ),
    CounterSpec(
        "checked_blocks",
        vllm_metrics.KVPILOT_DIGEST_CHECKED_BLOCKS,
        "Blocks read from a peer whose KV bytes this engine digested and compared with the holder's digests.",
    ),
    CounterSpec(
        "digest_mismatch_blocks",
        vllm_metrics.KVPILOT_DIGEST_MISMATCH_BLOCKS,
        "Blocks read from a peer whose KV bytes differ from the holder's digest: never attached.",
    ),
    CounterSpec(
        "digest_seconds",
        vllm_metrics.KVPILOT_DIGEST_SECONDS,
        "Worker time spent digesting KV blocks (offered blocks on the holder, landed blocks on the reader).",
    ),
    CounterSpec(
        "unchecked_reads",
        vllm_metrics.KVPILOT_UNCHECKED_READS,
        "Reads attached on the token check alone: the offer carried no KV digests, or digests are off here.",
    ),
    CounterSpec(
        "abandoned_reads",
        vllm_metrics.KVPILOT_ABANDONED_READS,
        "Reads of a peer's KV abandoned past their deadline: stopped, their blocks failed to load.",
    ),
    CounterSpec(
        "unabortable_reads",
        vllm_metrics.KVPILOT_UNABORTABLE_READS,
        "Reads past their deadline that the inner connector could not stop: left to finish.",
    ),
    CounterSpec(
        "integrity_failed_blocks",
        vllm_metrics.KVPILOT_INTEGRITY_FAILED_BLOCKS,
        "Blocks this engine's worker reported as failed loads (recomputed under kv_load_failure_policy: "
        "recompute), by why: a digest mismatch (from the first bad block on) or a read past its deadline.",
        INTEGRITY_REASONS,
    ),
    CounterSpec(
        "faults_injected",
        vllm_metrics.KVPILOT_FAULTS_INJECTED,
        "Faults the data-plane fault injector put into reads (testing only), by kind.",
        FAULT_KINDS,
        ("kind",),
    ),
)
_SPECS = {spec.key: spec for spec in COUNTERS}


def counter_key(counter: str, reason: str | None = None) -> str:
    """The key under which ``counter`` (with ``reason``, if labelled) is counted."""
    spec = _SPECS[counter]
    if bool(spec.reasons) != (reason is not None) or (reason is not None and reason not in spec.reasons):
        raise ValueError(f"counter {counter!r} takes reasons {spec.reasons}, got {reason!r}")
    return counter if reason is None else f"{counter}:{reason}"


@dataclass
class KVPilotStats(KVConnectorStats):
    """``data = {"counters": {key: number}, "inner_connector": str | None, "inner": stats}``.

    ``inner`` is a ``KVConnectorStats`` in-process and its ``to_dict()`` on the wire.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.data = {"counters": {}, "inner_connector": None, "inner": None}

    @classmethod
    def wrap(cls, inner_connector: str, inner: KVConnectorStats | None) -> KVPilotStats:
        return cls({"counters": {}, "inner_connector": inner_connector, "inner": inner})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVPilotStats:
        """Rebuild from ``to_dict()`` output (the API-server side of the wire)."""
        name = data.get("inner_connector")
        inner = data.get("inner")
        if name is not None and isinstance(inner, dict):
            inner_cls = KVConnectorFactory.get_connector_class_by_name(name)
            inner = inner_cls.build_kv_connector_stats(data=inner)
        return cls({"counters": dict(data.get("counters", {})), "inner_connector": name, "inner": inner})

    @property
    def counters(self) -> dict[str, float]:
        counters: dict[str, float] = self.data["counters"]
        return counters

    @property
    def inner(self) -> KVConnectorStats | None:
        inner: KVConnectorStats | None = self.data["inner"]
        return inner

    def count(self, counter: str, n: float = 1, reason: str | None = None) -> None:
        key = counter_key(counter, reason)
        self.counters[key] = self.counters.get(key, 0) + n

    def to_dict(self) -> dict[str, Any]:
        inner = self.inner
        return {
            "counters": dict(self.counters),
            "inner_connector": self.data["inner_connector"],
            "inner": inner.to_dict() if isinstance(inner, KVConnectorStats) else inner,
        }

    def reset(self) -> None:
        self.counters.clear()
        if self.inner is not None:
            self.inner.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVPilotStats):
            raise TypeError(f"cannot aggregate KVPilotStats with {type(other).__name__}")
        for key, n in other.counters.items():
            self.counters[key] = self.counters.get(key, 0) + n
        if other.inner is not None:
            if self.inner is None:
                self.data["inner"] = other.inner
                self.data["inner_connector"] = other.data["inner_connector"]
            else:
                self.data["inner"] = self.inner.aggregate(other.inner)
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {f"kvpilot {k}": v for k, v in sorted(self.counters.items())}
        if self.inner is not None and not self.inner.is_empty():
            reduced.update(self.inner.reduce())
        return reduced

    def is_empty(self) -> bool:
        return not any(self.counters.values()) and (self.inner is None or self.inner.is_empty())


class KVPilotPromMetrics(KVConnectorPromMetrics):
    """Registers kvpilot's counter families; forwards the inner part to the inner
    connector's own Prometheus metrics (e.g. ``NixlPromMetrics``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        inner: KVConnectorPromMetrics | None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._inner = inner
        self._children: dict[str, dict[int, Counter]] = {}
        # vLLM types _counter_cls as any metric class; it is the counter class it was given for Counter
        counter_cls = cast("type[Counter]", self._counter_cls)
        for spec in COUNTERS:
            names = labelnames + (list(spec.label_names) if spec.reasons else [])
            family = counter_cls(name=spec.metric.name, documentation=spec.doc, labelnames=names)
            for reason in spec.reasons or (None,):
                extra = [] if reason is None else reason.split("/")
                self._children[counter_key(spec.key, reason)] = {
                    idx: family.labels(*values, *extra) for idx, values in per_engine_labelvalues.items()
                }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, n in transfer_stats_data.get("counters", {}).items():
            if n and key in self._children:
                self._children[key][engine_idx].inc(n)
        inner = transfer_stats_data.get("inner")
        if self._inner is not None and inner:
            self._inner.observe(inner, engine_idx)
