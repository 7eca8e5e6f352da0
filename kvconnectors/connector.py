"""``KVPilotConnector``: a vLLM ``KVConnectorBase_V1`` built by composition.

An inner connector (``NixlConnector`` by default, named in the extra config) owns the
data plane: NIXL agents, handshakes, pull and push, leases, heartbeats, its metrics.
This facade forwards every call to it, and adds kvpilot's layers at the
scheduler-side seams through :class:`kvpilot.kvconnectors.scheduler.KVPilotScheduler`.
The worker side is the inner connector's, unchanged, except that the engine thread
keeps its CPU binding (:mod:`kvpilot.kvconnectors.thread_binding`).

Loaded by name through the ``vllm.general_plugins`` entry point
(:mod:`kvpilot.kvconnectors.plugin`); ``kv_connector_module_path`` is not needed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from kvpilot.kvconnectors import CONNECTOR_NAME
from kvpilot.kvconnectors.attach_plan import apply_plan
from kvpilot.kvconnectors.config import KVPilotConfig, KVPilotConfigError
from kvpilot.kvconnectors.faults import FaultInjector
from kvpilot.kvconnectors.integrity import IntegrityLedger
from kvpilot.kvconnectors.metadata import DigestReport, KVPilotMetadata
from kvpilot.kvconnectors.policy_setup import build_pull_policy
from kvpilot.kvconnectors.pull_params import PULL_DONE_KEY
from kvpilot.kvconnectors.scheduler import KVPilotScheduler
from kvpilot.kvconnectors.stats import KVPilotPromMetrics, KVPilotStats
from kvpilot.kvconnectors.thread_binding import keeping_thread_binding
from kvpilot.kvconnectors.transfer_params import PARAMS_KEY, TransferParamsError, decode_offer
from kvpilot.kvconnectors.worker import KVPilotWorker

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def parse_config(vllm_config: VllmConfig) -> KVPilotConfig:
    """Parse our extra config and check the inner connector against vLLM's registry."""
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    config = KVPilotConfig.parse(ktc.kv_connector_extra_config)
    try:
        KVConnectorFactory.get_connector_class_by_name(config.inner_connector)
    except ValueError:
        raise KVPilotConfigError(
            "inner_connector", f"{config.inner_connector!r} is not a connector registered with vLLM"
        ) from None
    return config


def inner_transfer_config(ktc: KVTransferConfig, config: KVPilotConfig) -> KVTransferConfig:
    """``ktc`` naming the inner connector, with its extra config."""
    return dataclasses.replace(
        ktc,
        kv_connector=config.inner_connector,
        kv_connector_module_path=None,
        kv_connector_extra_config=config.inner_config_for_vllm(),
    )


def inner_vllm_config(vllm_config: VllmConfig, config: KVPilotConfig) -> VllmConfig:
    """A shallow copy of ``vllm_config`` whose kv_transfer_config names the inner connector."""
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = inner_transfer_config(ktc, config)
    return inner


def _inner_of_transfer_config(ktc: KVTransferConfig) -> tuple[type[KVConnectorBase_V1], KVTransferConfig]:
    config = KVPilotConfig.parse(ktc.kv_connector_extra_config)
    return KVConnectorFactory.get_connector_class_by_name(config.inner_connector), inner_transfer_config(ktc, config)


def _inner_class(vllm_config: VllmConfig) -> tuple[type[KVConnectorBase_V1], VllmConfig]:
    config = parse_config(vllm_config)
    cls = KVConnectorFactory.get_connector_class_by_name(config.inner_connector)
    return cls, inner_vllm_config(vllm_config, config)


class KVPilotConnector(KVConnectorBase_V1, SupportsHMA):
    """Forwards to the inner connector; kvpilot's scheduler layer sits in between."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = parse_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class_by_name(self.config.inner_connector)
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if groups > 1 and not issubclass(inner_cls, SupportsHMA):  # checked once, as multi_connector.py does
            raise KVPilotConfigError(
                "inner_connector", f"{self.config.inner_connector} does not support {groups} KV cache groups (HMA)"
            )
        with keeping_thread_binding():
            self._inner: KVConnectorBase_V1 = inner_cls(
                inner_vllm_config(vllm_config, self.config), role, kv_cache_config
            )
        self._pilot: KVPilotScheduler | None = None
        self._ledger: IntegrityLedger | None = None
        self._worker: KVPilotWorker | None = None
        # the digest needs one worker per engine: its report is the engine's, not a shard's
        digests = self.config.kv_digest and vllm_config.parallel_config.world_size == 1
        if role == KVConnectorRole.SCHEDULER:
            layout = inner_cls.get_required_kvcache_layout(inner_vllm_config(vllm_config, self.config))
            policy = build_pull_policy(vllm_config, self.config)
            self._pilot = KVPilotScheduler(
                vllm_config, kv_cache_config, layout, policy, peer_retry_after_s=self.config.peer_retry_after_s
            )
            bidirectional = bool(self.config.inner_extra_config.get("bidirectional_kv_xfer"))
            self._ledger = IntegrityLedger(kv_cache_config, digests, self.config.deadline_rule(), bidirectional)
        elif kv_cache_config is not None:
            spec = self.config.fault_injection
            self._worker = KVPilotWorker(
                self._inner,
                tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups),
                kv_cache_config.num_blocks,
                digests,
                FaultInjector(spec) if spec is not None else None,
            )

    @property
    def inner(self) -> KVConnectorBase_V1:
        return self._inner

    # ---------------------------------------------------------------- properties
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    # ---------------------------------------------------------------- class methods
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner_cls, inner_config = _inner_class(vllm_config)
        return inner_cls.get_required_kvcache_layout(inner_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        config = KVPilotConfig.parse(extra_config)
        inner_cls = KVConnectorFactory.get_connector_class_by_name(config.inner_connector)
        return inner_cls.requires_piecewise_for_cudagraph(config.inner_config_for_vllm())

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """The inner connector's answer (vLLM 0.33 on asks; NixlConnector follows sleep mode's
        KV cache remap only over UCX)."""
        inner_cls, inner = _inner_of_transfer_config(kv_transfer_config)
        return bool(getattr(inner_cls, "supports_sleep_mode")(inner))  # noqa: B009 - not in vLLM 0.32's base

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """How the inner connector's workers reach the KV cache (vLLM 0.34 on asks: NIXL
        registers it, which decides how the extensible KV cache allocates it)."""
        inner_cls, inner = _inner_of_transfer_config(kv_transfer_config)
        return getattr(inner_cls, "kv_cache_access")(inner)  # noqa: B009 - not in vLLM 0.32's base

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPilotStats() if data is None else KVPilotStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        inner_cls, inner_config = _inner_class(vllm_config)
        inner = inner_cls.build_prom_metrics(inner_config, metric_types, labelnames, per_engine_labelvalues)
        return KVPilotPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, inner)

    # ---------------------------------------------------------------- shared
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Unwraps kvpilot's metadata: the inner connector gets its own, the worker layer the rest."""
        inner = connector_metadata
        if isinstance(connector_metadata, KVPilotMetadata):
            if self._worker is not None:
                self._worker.bind(connector_metadata)
            inner = connector_metadata.inner if connector_metadata.inner is not None else connector_metadata
        self._inner.bind_connector_metadata(inner)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        self._inner.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        inner = self._inner.get_kv_connector_stats()
        if self._pilot is None:
            wrapped = KVPilotStats.wrap(self.config.inner_connector, inner)
            if self._worker is not None:
                wrapped.aggregate(self._worker.take_stats())
            return None if wrapped.is_empty() else wrapped
        stats = self._pilot.take_stats()
        if inner is not None:
            stats.aggregate(KVPilotStats.wrap(self.config.inner_connector, inner))
        return None if stats.is_empty() else stats

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self._inner.get_kv_connector_kv_cache_events()

    def reset_cache(self) -> bool | None:
        return self._inner.reset_cache()

    # ---------------------------------------------------------------- worker side
    def get_mem_pool_context(self) -> AbstractContextManager[object] | None:
        return self._inner.get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._inner.register_kv_caches(kv_caches)
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        self._inner.set_host_xfer_buffer_ops(copy_operation)

    def unregister_kv_caches(self) -> None:
        """Before sleep (vLLM 0.33 on): the inner connector drops its NIXL registrations."""
        getattr(self._inner, "unregister_kv_caches")()  # noqa: B009 - not in vLLM 0.32's base

    def restore_kv_caches(self) -> None:
        """After wake-up (vLLM 0.33 on): the inner connector registers the KV cache again."""
        getattr(self._inner, "restore_kv_caches")()  # noqa: B009 - not in vLLM 0.32's base

    def finish_forward(self) -> None:
        self._inner.finish_forward()

    def reset_capture_state(self) -> None:
        self._inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._inner.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._inner.start_load_kv(forward_context, **kwargs)
        if self._worker is not None:
            self._worker.after_start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        """After the forward pass: the inner connector's saves, then the step's digests."""
        self._inner.wait_for_save()
        if self._worker is not None:
            self._worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The inner connector's results with kvpilot's checks applied: reads whose bytes
        differ from the holder's digests, or past their deadline, fail their blocks
        (:class:`~kvpilot.kvconnectors.worker.KVPilotWorker`)."""
        results = self._inner.get_transfer_results(finished_req_ids)
        if self._worker is None:
            return results
        finished, failed = self._worker.transfer_results(results.finished_recving, results.failed_recving)
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending, finished_recving=finished, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._inner.get_block_ids_with_load_errors()
        if self._worker is not None:
            errors |= self._worker.take_load_errors()
        return errors

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The step's digests (:class:`DigestReport`) around the inner connector's own metadata."""
        inner = self._inner.build_connector_worker_meta()
        report = self._worker.take_report() if self._worker is not None else None
        if report is None:
            return inner if inner is None else DigestReport(inner=inner)
        report.inner = inner
        return report

    def get_finished_count(self) -> int | None:
        return self._inner.get_finished_count()

    # ---------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._inner.bind_kv_cache_manager(kv_cache_manager)
        if self._ledger is not None:
            self._ledger.bind(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._inner.bind_gpu_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The inner connector's answer when the peer's whole offer verified; else only
        the verified blocks beyond the local hit (or nothing). A session pull already
        made once (it landed in the local cache, or failed and is being prefilled) is
        not asked again: vLLM 0.32's NIXL scheduler would count its tokens as a new
        asynchronous load without starting one, and the request would wait forever."""
        params = request.kv_transfer_params
        if params is not None and params.get(PULL_DONE_KEY):
            return 0, False
        plan = self._scheduler_layer().plan_attach(request, num_computed_tokens)
        if plan is None or plan.attach_blocks is None:
            return self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        external = self._scheduler_layer().external_tokens(plan, num_computed_tokens)
        return (external, True) if external > 0 else (0, False)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pilot = self._scheduler_layer()
        plan = pilot.take_plan(request.request_id)
        if plan is not None and request.kv_transfer_params is not None:
            apply_plan(plan, request.kv_transfer_params)
        if num_external_tokens > 0:
            unhashed = blocks.get_unhashed_block_ids_all_groups()
            pilot.pull_started(request, (b for group in unhashed for b in group), num_external_tokens)
            self._read_started(request, unhashed)
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def _read_started(self, request: Request, local_block_ids: list[list[int]]) -> None:
        params = request.kv_transfer_params or {}
        try:
            offer = decode_offer(params[PARAMS_KEY]) if PARAMS_KEY in params else None
        except TransferParamsError:
            offer = None
        rate = self._scheduler_layer().link_rate()
        self._integrity().read_started(request.request_id, local_block_ids, params.get("remote_block_ids"), offer, rate)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The inner connector's metadata, wrapped with the step's digest jobs and new reads."""
        self._scheduler_layer().observe_step(scheduler_output)
        inner = self._inner.build_connector_meta(scheduler_output)
        ledger = self._integrity()
        return KVPilotMetadata(inner=inner, digest_jobs=ledger.digest_jobs(scheduler_output), reads=ledger.take_reads())

    def on_new_request(self, request: Request) -> None:
        self._scheduler_layer().screen_new_request(request)
        self._integrity().track(request)
        self._inner.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Observes the worker's report (digests complete the offers made this pass); the
        inner connector gets it with its own worker metadata in place of kvpilot's."""
        self._scheduler_layer().observe_transfers(connector_output)
        report = connector_output.kv_connector_worker_meta
        self._integrity().merge(report)
        if isinstance(report, DigestReport):
            connector_output = dataclasses.replace(connector_output, kv_connector_worker_meta=report.inner)
        self._inner.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The inner connector's verdict, given no blocks to hold when the router declined
        this engine's hold (:meth:`KVPilotScheduler.finished`): they are freed at once."""
        if self._scheduler_layer().finished(request):
            block_ids = []
        delay_free, params = self._inner.request_finished(request, block_ids)
        return delay_free, self._stamp(request, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As :meth:`request_finished`, per KV-cache group."""
        if self._scheduler_layer().finished(request):
            block_ids = tuple([] for _ in block_ids)
        if isinstance(self._inner, SupportsHMA):  # vLLM's supports_hma(), narrowing the type
            delay_free, params = self._inner.request_finished_all_groups(request, block_ids)
        else:  # one KV cache group: checked at construction
            delay_free, params = self._inner.request_finished(request, block_ids[0])
        return delay_free, self._stamp(request, params)

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        return self._inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """The inner connector's push work, or a pull still in flight: vLLM keeps the
        engine stepping only while this (or a runnable request) says so, and a request
        waiting for a peer's KV is not runnable, so without it a D->P pull can sit
        received but uncollected until the next request arrives."""
        if self._pilot is not None and self._pilot.has_pulls_in_flight():
            return True
        return self._inner.has_pending_push_work()

    def _stamp(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        stamped = self._scheduler_layer().stamp_offer(request, params)
        self._integrity().offer(request.request_id, stamped, PARAMS_KEY)
        return stamped

    def _integrity(self) -> IntegrityLedger:
        assert self._ledger is not None, "called on the scheduler-side connector only"
        return self._ledger

    def _scheduler_layer(self) -> KVPilotScheduler:
        assert self._pilot is not None, "called on the scheduler-side connector only"
        return self._pilot


__all__ = ["CONNECTOR_NAME", "KVPilotConnector"]
