"""What ``KVPilotConnector`` relies on in vLLM, stated as data: :data:`CONTRACT`, which
:mod:`kvpilot.kvconnectors.vllm_contract` checks a vLLM source tree against. Pure: no
vLLM import."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.kvconnectors import vllm_metrics
from kvpilot.kvconnectors.config import NIXL_KEYS, RECOMPUTE_THRESHOLD_KEY
from kvpilot.kvconnectors.hash_contract import HASH_ALGOS
from kvpilot.kvconnectors.pull_params import PULL_DONE_KEY
from kvpilot.kvconnectors.vllm_source import Kind


@dataclass(frozen=True, slots=True)
class Method:
    """A member kvpilot calls or overrides: its parameters after ``self``/``cls``,
    in order, ``*args``/``**kwargs`` with their stars (none for a property); ``since``, the
    first vLLM version that has it (older ones lack it, and kvpilot's override of it is
    never called there), empty for every supported version."""

    name: str
    params: tuple[str, ...] = ()
    kind: Kind = "method"
    since: str = ""


@dataclass(frozen=True, slots=True)
class ClassSeam:
    """A vLLM class kvpilot subclasses, calls or reads: the methods with their
    signatures, the attributes read, and class keywords (a msgspec struct's wire options)
    that must hold."""

    module: str
    name: str
    methods: tuple[Method, ...] = ()
    attributes: tuple[str, ...] = ()
    keywords: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True, slots=True)
class FunctionSeam:
    """A module-level vLLM function kvpilot mirrors or calls, with its parameters."""

    module: str
    name: str
    params: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Literals:
    """String literals that must still appear in a vLLM module or package: the
    field names and keys kvpilot reads or writes there."""

    module: str
    what: str
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wrapped:
    """The connector kvpilot wraps: its registry name, the factory module that
    registers it, the base class whose API the wrapper forwards (the methods its
    :class:`ClassSeam` lists), the extra-config getter whose keys kvpilot must accept
    (``config.NIXL_KEYS``), and base methods deliberately left to the base default."""

    name: str
    factory: str
    base: str
    config_getter: str
    accepted_keys: frozenset[str]
    inherited: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Contract:
    classes: tuple[ClassSeam, ...]
    functions: tuple[FunctionSeam, ...]
    symbols: tuple[tuple[str, str], ...]
    literals: tuple[Literals, ...]
    metrics: tuple[str, ...]
    wrapped: Wrapped


@dataclass(frozen=True, slots=True)
class Violation:
    """One seam that moved: ``seam`` names it (``Class.member``), ``problem`` says how."""

    seam: str
    problem: str

    def __str__(self) -> str:
        return f"{self.seam}: {self.problem}"


_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_COMPLETION = "vllm.entrypoints.openai.completion.protocol"
_CHAT = "vllm.entrypoints.openai.chat_completion.protocol"

M = Method
_CONNECTOR_API = (
    # What KVPilotConnector overrides (kvconnectors/connector.py) and forwards to the inner connector.
    M("__init__", ("vllm_config", "role", "kv_cache_config")),
    M("supports_divergent_local_hybrid_hits", kind="property"),
    M("requires_kv_delivery", kind="property"),
    M("get_required_kvcache_layout", ("vllm_config",), "classmethod"),
    M("requires_piecewise_for_cudagraph", ("extra_config",), "classmethod"),
    M("build_kv_connector_stats", ("data",), "classmethod"),
    M("build_prom_metrics", ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"), "classmethod"),
    M("bind_connector_metadata", ("connector_metadata",)),
    M("clear_connector_metadata"),
    M("shutdown"),
    M("get_kv_connector_stats"),
    M("get_kv_connector_kv_cache_events"),
    M("reset_cache"),
    M("get_mem_pool_context"),
    M("register_kv_caches", ("kv_caches",)),
    M("set_host_xfer_buffer_ops", ("copy_operation",)),
    M("supports_sleep_mode", ("kv_transfer_config",), "classmethod", since="0.33.0"),
    M("unregister_kv_caches", since="0.33.0"),
    M("restore_kv_caches", since="0.33.0"),
    M("kv_cache_access", ("kv_transfer_config",), "classmethod", since="0.34.0"),
    M("finish_forward"),
    M("reset_capture_state"),
    M("handle_preemptions", ("kv_connector_metadata",)),
    M("start_load_kv", ("forward_context", "**kwargs")),
    M("wait_for_layer_load", ("layer_name",)),
    M("save_kv_layer", ("layer_name", "kv_layer", "attn_metadata", "**kwargs")),
    M("wait_for_save"),
    M("get_finished", ("finished_req_ids",)),
    M("get_transfer_results", ("finished_req_ids",)),
    M("get_block_ids_with_load_errors"),
    M("get_handshake_metadata"),
    M("build_connector_worker_meta"),
    M("get_finished_count"),
    M("bind_kv_cache_manager", ("kv_cache_manager",)),
    M("bind_gpu_block_pool", ("gpu_block_pool",)),
    M("set_xfer_handshake_metadata", ("metadata",)),
    M("set_xfer_handshake_metadata_pp_aware", ("metadata",)),
    M("get_loaded_kv_cache_group_ids", ("request",)),
    M("get_num_new_matched_tokens", ("request", "num_computed_tokens")),
    M("get_external_cache_hit_sources", ("request", "num_external_tokens")),
    M("update_state_after_alloc", ("request", "blocks", "num_external_tokens")),
    M("build_connector_meta", ("scheduler_output",)),
    M("on_new_request", ("request",)),
    M("update_connector_output", ("connector_output",)),
    M("request_finished", ("request", "block_ids")),
    M("register_finished_partial_tail", ("request", "block_ids", "partial_tail_offloads")),
    M("take_events"),
    M("has_pending_block_frees"),
    M("has_pending_push_work"),
    # Left to the base class, which KVPilotConnector's own code relies on.
    M("role", kind="property"),
    M("has_connector_metadata"),
    M("_get_connector_metadata"),
)

CONTRACT = Contract(
    classes=(
        ClassSeam(_BASE, "KVConnectorBase_V1", _CONNECTOR_API),
        ClassSeam(_BASE, "SupportsHMA", (M("request_finished_all_groups", ("request", "block_ids")),)),
        ClassSeam(_BASE, "KVConnectorRole", attributes=("SCHEDULER", "WORKER")),
        # The inner connector kvpilot builds (inner_cls(vllm_config, role, kv_cache_config)).
        ClassSeam(_NIXL, "NixlConnector", (M("__init__", ("vllm_config", "role", "kv_cache_config")),)),
        ClassSeam(f"{_NIXL}.stats", "NixlPromMetrics"),
        ClassSeam(
            _FACTORY,
            "KVConnectorFactory",
            (
                M("get_connector_class_by_name", ("connector_name",), "classmethod"),
                M("register_connector", ("name", "module_path", "class_name"), "classmethod"),
            ),
        ),
        ClassSeam(
            _METRICS,
            "KVConnectorStats",
            (M("to_dict"), M("reset"), M("aggregate", ("other",)), M("reduce"), M("is_empty")),
            attributes=("data",),
        ),
        ClassSeam(
            _METRICS,
            "KVConnectorPromMetrics",
            (
                M("__init__", ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
                M("observe", ("transfer_stats_data", "engine_idx")),
            ),
            attributes=("_counter_cls",),
        ),
        # What the scheduler layer reads (kvconnectors/scheduler.py).
        ClassSeam(
            "vllm.v1.request",
            "Request",
            attributes=(
                "request_id",
                "kv_transfer_params",
                "block_hashes",
                "num_computed_tokens",
                "all_token_ids",
                "num_prompt_tokens",
                "prompt_token_ids",
                "lora_request",
                "mm_features",
                "cache_salt",
            ),
        ),
        ClassSeam(
            "vllm.v1.core.sched.output",
            "SchedulerOutput",
            attributes=(
                "num_scheduled_tokens",
                "scheduled_new_reqs",
                "scheduled_cached_reqs",
                "total_num_scheduled_tokens",
            ),
        ),
        ClassSeam("vllm.v1.core.sched.output", "NewRequestData", attributes=("req_id", "num_computed_tokens")),
        ClassSeam(
            "vllm.v1.core.sched.output",
            "CachedRequestData",
            attributes=("req_ids", "num_computed_tokens", "num_output_tokens"),  # resumed_req_ids: up to 0.33 only
        ),
        ClassSeam(
            "vllm.v1.outputs",
            "KVConnectorOutput",
            attributes=(
                "finished_recving",
                "failed_recving",
                "invalid_block_ids",
                "kv_connector_stats",
                "kv_connector_worker_meta",
            ),
        ),
        # The worker layer's seams (kvconnectors/worker.py, kvconnectors/metadata.py).
        ClassSeam(
            _BASE,
            "KVConnectorTransferResults",
            attributes=("finished_sending", "finished_recving", "failed_recving"),
        ),
        ClassSeam(_BASE, "KVConnectorWorkerMetadata", (M("aggregate", ("other",)),)),
        ClassSeam("vllm.v1.core.kv_cache_manager", "KVCacheManager", (M("get_block_ids", ("request_id",)),)),
        # A read abandoned at its deadline is stopped inside NIXL's worker (kvconnectors/inner_abort.py).
        ClassSeam(_NIXL, "NixlConnector", attributes=("connector_worker",)),
        ClassSeam(
            f"{_NIXL}.base_worker",
            "NixlBaseConnectorWorker",
            attributes=(
                "nixl_wrapper",
                "_recving_transfers",
                "_recving_metadata",
                "_recv_failures",
                "_pending_recv_notifs",
                "_ready_requests",
            ),
        ),
        ClassSeam("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", (M("get_unhashed_block_ids_all_groups"),)),
        ClassSeam(
            "vllm.v1.kv_cache_interface",
            "KVCacheConfig",
            attributes=("kv_cache_groups", "hash_block_size", "num_blocks"),
        ),
        ClassSeam("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", attributes=("kv_cache_spec", "layer_names")),
        ClassSeam("vllm.v1.kv_cache_interface", "KVCacheSpec", (M("page_size_bytes", kind="property"),)),
        ClassSeam(
            "vllm.config",
            "VllmConfig",
            attributes=("cache_config", "model_config", "kv_transfer_config", "parallel_config"),
        ),
        ClassSeam("vllm.config", "CacheConfig", attributes=("block_size", "prefix_caching_hash_algo", "cache_dtype")),
        ClassSeam("vllm.config", "ModelConfig", attributes=("model", "dtype", "served_model_name", "hf_config")),
        ClassSeam("vllm.config", "ParallelConfig", attributes=("tensor_parallel_size", "world_size")),
        ClassSeam(
            "vllm.config",
            "KVTransferConfig",
            attributes=(
                "kv_connector",
                "kv_connector_module_path",
                "kv_connector_extra_config",
                "kv_load_failure_policy",
            ),
        ),
        ClassSeam("vllm.v1.metrics.stats", "PromptTokenStats", attributes=("ALL_SOURCES",)),
        # Where D's offer of a session's KV reaches an answer (routing/serve/withheld.py): a top-level
        # field of the whole answers, which the router reads and answers null. A stream chunk may
        # carry it too (vLLM 0.34's stream classes have it): the relay then keeps the chunk's
        # offer as a whole answer's and withholds it, and Envoy's filter withholds it.
        ClassSeam(_COMPLETION, "CompletionResponse", attributes=("kv_transfer_params",)),
        ClassSeam(_CHAT, "ChatCompletionResponse", attributes=("kv_transfer_params",)),
        # The KV events the router decodes (routing/index/events.py mirrors these fields).
        ClassSeam(
            "vllm.distributed.kv_events",
            "EventBatch",
            attributes=("ts", "events", "data_parallel_rank"),
            keywords=(("array_like", True),),
        ),
        ClassSeam(
            "vllm.distributed.kv_events",
            "BlockStored",
            attributes=(
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx",
            ),
            keywords=(("tag", True),),
        ),
        ClassSeam(
            "vllm.distributed.kv_events",
            "BlockRemoved",
            attributes=("block_hashes", "medium", "group_idx"),
            keywords=(("tag", True),),
        ),
        ClassSeam("vllm.distributed.kv_events", "AllBlocksCleared", keywords=(("tag", True),)),
        ClassSeam("vllm.distributed.kv_events", "KVConnectorKVEvents"),
    ),
    functions=(
        # kvconnectors/hash_contract.py restates it; tests/unit/kvconnectors/test_hash_contract.py runs both.
        FunctionSeam(
            "vllm.v1.core.kv_cache_utils",
            "hash_block_tokens",
            ("hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys"),
        ),
        FunctionSeam("vllm.v1.core.kv_cache_utils", "init_none_hash", ("hash_fn",)),
    ),
    symbols=(
        (_BASE, "CopyBlocksOp"),
        (_BASE, "KVConnectorHandshakeMetadata"),
        (_BASE, "KVConnectorMetadata"),
        (_BASE, "KVConnectorTransferResults"),
        (_BASE, "KVConnectorWorkerMetadata"),
        (_METRICS, "PromMetric"),
        (_METRICS, "PromMetricT"),
        ("vllm.v1.attention.backend", "AttentionMetadata"),
        ("vllm.v1.metrics.cache_hit_source", "CacheHitSource"),
        ("vllm.v1.core.kv_cache_utils", "NONE_HASH"),
        ("vllm.v1.core.block_pool", "BlockPool"),
        ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
        ("vllm.forward_context", "ForwardContext"),
        ("vllm.distributed.kv_events", "KVCacheEvent"),
        ("vllm.platforms", "current_platform"),
    ),
    literals=(
        Literals(
            _NIXL,
            "kv_transfer_params field",
            (
                "do_remote_prefill",
                "do_remote_decode",
                "remote_block_ids",
                "remote_engine_id",
                "remote_request_id",
                "remote_host",
                "remote_port",
                "remote_num_tokens",
                "remote_blocks_expiry_time",
                "remote_block_size",
                "tp_size",
                PULL_DONE_KEY,
            ),
        ),
        Literals(
            _NIXL,
            "kv_connector_extra_config key",
            ("bidirectional_kv_xfer", "decoder_kv_blocks_ttl", RECOMPUTE_THRESHOLD_KEY),
        ),
        Literals(
            f"{_NIXL}.stats",
            "NIXL stats key",
            ("transfer_duration", "bytes_transferred", "num_failed_transfers", "num_kv_expired_reqs"),
        ),
        Literals(
            "vllm.v1.metrics.stats",
            "prompt-token source",
            tuple(source.value for source in vllm_metrics.PromptTokenSource),
        ),
        Literals("vllm.config.cache", "prefix_caching_hash_algo", HASH_ALGOS),
    ),
    metrics=tuple(family.name for family in vllm_metrics.VLLM_FAMILIES + vllm_metrics.NIXL_FAMILIES),
    wrapped=Wrapped(
        name="NixlConnector",
        factory=_FACTORY,
        base="KVConnectorBase_V1",
        config_getter="get_from_extra_config",
        accepted_keys=NIXL_KEYS,
        inherited=(
            (
                "supports_lookahead_block_hashes",
                (
                    "kvpilot's block-hash contract has no lookahead tokens: the base's False keeps vLLM's "
                    "lookahead hashing off under KVPilotConnector"
                ),
            ),
        ),
    ),
)
