"""The router's configuration: frozen, typed, parsed once (YAML, then CLI flags).

The ``cost`` section uses NVIDIA Dynamo's ``KvRouterConfig`` names and defaults
(read from ``ai-dynamo-runtime`` 1.6.1's ``dynamo/_core.pyi``), so a Dynamo
user can paste them::

    cost:
      overlap_score_credit: 1.0          # credit per GPU-overlapped block
      overlap_score_credit_decay: 0.0    # 0 = no decay (Dynamo's default)
      host_cache_hit_weight: 0.75
      disk_cache_hit_weight: 0.25
      shared_cache_multiplier: 0.5       # Dynamo's default when a shared cache exists
      prefill_load_scale: 1.0
      decode_active_request_weight: 0.0  # the optional active-request term, off
      router_temperature: 0.0            # 0 = argmin; > 0 = seeded softmax sampling
      session_affinity_credit: 16.0      # kvpilot's own: blocks of credit for the session's last worker
      router_seed: 0
      pair_failure_cost_blocks: 32.0     # kvpilot's own: per recent transfer failure of a (P, D) pair
      pair_failure_half_life_s: 60.0
      pair_transfer_cost_blocks_per_s: 64.0   # per second of the pair's mean NIXL transfer time
      objective: blocks                  # blocks (Dynamo's cost) | predicted_ttft (from the measured rates)
    index:
      backend: kvpilot                   # kvpilot | dynamo (Dynamo's RadixTree; needs kvpilot[dynamo])
      block_size: 16
      tiers: {GPU: gpu, CPU: host, STORAGE: disk}   # medium -> gpu | host | disk | shared
      events_stale_after_s: 0.0          # > 0: a worker silent this long after a prefill is routed on load alone
    sessions:
      max_sessions: 10000
      force_option: ""                   # reprefill | pull | affinity | shared_tier | local; "" = cheapest
      store: memory                      # memory | redis (shared by replicas, kept across restarts)
      redis_url: redis://127.0.0.1:6379/0    # with store: redis
      store_key_prefix: "kvpilot:"
      store_read_timeout_s: 0.05         # past it, the step is routed on this router's own state
      store_write_timeout_s: 0.05        # the answer waits for the write at most this long
      store_ttl_s: 600.0                 # a record's life when D stated no lease (else D's lease)
    server:                              # the HTTP front (routing.serve.app)
      host: 127.0.0.1
      port: 8000
      model_name: tiny
      model_dir: /path/to/model          # tokenizer.json + tokenizer_config.json
      prefill_timeout_s: 30.0            # P slower than this: local prefill on D
      request_timeout_s: 600.0
      engine_metrics_interval_s: 5.0     # poll each engine's /metrics (load, KV usage); 0 = off
    disaggregation:                      # policies.disaggregation (local vs remote prefill)
      max_local_tokens: 2048             # null disables a check
      max_local_fraction: 0.7
      decode_busy_kv_usage: 0.9          # D's KV usage: the larger of ledger / kv_blocks and D's own gauge
      compare_costs: true                # the stall budget and local-cheaper checks (false: Dynamo's rule)
      max_stall_s: 0.05
      model_preset: ""                   # "": server.model_dir's config.json; or a policies.presets name
      p_hardware: h100                   # the prior's hardware until the measured rates replace it
      d_hardware: h100
      link_preset: rdma
      kv_format: bf16
      measured_rates: true               # price with the measured rates (routing/decide/rates.py)
    dynamo:                              # beside NVIDIA Dynamo (docs/dynamo.md); off while frontend_url is ""
      frontend_url: http://127.0.0.1:8090   # Dynamo's frontend in direct mode: every request goes there
      discovery_backend: file            # file ($DYN_FILE_KV) | etcd | kubernetes: Dynamo's own client reads it
      decode_endpoint: dynamo.backend.generate
      prefill_endpoint: dynamo.prefill.generate
      discovery_interval_s: 1.0          # how often joins and departures are picked up
      kv_events_port_offset: 0           # a worker's vLLM KV events: its request-plane port + this, or
      kv_events_port: 0                  #   this same port on every worker's host (one worker per host)
      kv_events_endpoints: {}            # instance id (hex) -> tcp://host:port, before both rules (several
                                         #   workers in one process share a request-plane port)
      kv_replay_port_offset: 0           # a worker's KV-event replay: its request-plane port + this (0: none)
    gateway:                             # the endpoint picker behind Envoy (routing.gateway; docs/gateway.md)
      picker_port: 0                     # > 0: serve Envoy's ext_proc and its OTLP access log here (gRPC, server.host)
    workers:                             # Worker; routing.fleet checks the fleet (empty beside Dynamo)
      - name: prefill-0
        role: prefill                    # prefill | decode | colocated
        url: http://127.0.0.1:8100
        kv_events_endpoint: tcp://127.0.0.1:5700   # the router binds it; the engine connects
        replay_endpoint: tcp://127.0.0.1:5800      # the engine binds it
        topic: kv
        kv_blocks: 0                     # the engine's KV capacity in blocks (0 = unknown)

Every scalar leaf outside ``workers`` also has a flag (``--overlap-score-credit 0.5``,
``--compare-costs true``, ``--max-local-tokens none``, ``--backend dynamo``: an enum
leaf's flag takes only its values); flags override YAML, YAML overrides defaults.
:func:`policies.typed_config.convert` (the one converter, shared with
``kvconnectors/config.py`` and ``policies/presets.py``) turns the merged mapping into
these frozen structs, running each section's own range checks; an unknown key is a
:class:`ConfigError` naming its path (``cost.overlap_score_credt``), and so is a value
of the wrong type (``cost.router_seed: Expected `int`, got `float```), outside its
enum (``index.backend``, ``index.tiers.GPU``, ``sessions.force_option``,
``sessions.store``, a worker's ``role``) or out of range.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import msgspec
import yaml

from policies.disaggregation import LocalPrefillConfig
from policies.presets import model_from_mapping, model_preset
from policies.session_options import Option
from policies.specs import ModelSpec, SpecError
from policies.typed_config import TypedConfig, TypedConfigError, check_range, convert
from routing.ids import WorkerId

log = logging.getLogger(__name__)


class ConfigError(TypedConfigError):
    """A router config value or key is wrong: ``key`` names it by its dotted path
    (``cost.router_seed``, ``workers[0].url``), ``problem`` says what is wrong."""

    ROOT_KEY = "top level"


class IndexBackend(str, enum.Enum):
    """``index.backend``: the block index the router keeps."""

    KVPILOT = "kvpilot"
    """:class:`routing.index.block_index.BlockIndex`."""
    DYNAMO = "dynamo"
    """Dynamo's ``RadixTree`` (:mod:`routing.index.dynamo`; needs ``kvpilot[dynamo]``)."""


class TierClass(str, enum.Enum):
    """What a KV event's medium counts as in the cost (``index.tiers`` maps media to
    these), best first: blocks are credited only beyond the better classes."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"
    SHARED = "shared"


class ForcedOption(str, enum.Enum):
    """``sessions.force_option``: a :class:`~policies.session_options.Option` by its
    name, or ``""`` (:attr:`CHEAPEST`): the cheapest by the roofline."""

    CHEAPEST = ""
    REPREFILL = Option.REPREFILL.value
    PULL = Option.PULL.value
    AFFINITY = Option.AFFINITY.value
    SHARED_TIER = Option.SHARED_TIER.value
    LOCAL = Option.LOCAL.value

    @property
    def option(self) -> Option | None:
        """The option a session's later steps take while it is available; ``None``: the cheapest."""
        return None if self is ForcedOption.CHEAPEST else Option(self.value)


class CostObjective(str, enum.Enum):
    """What the router minimizes over its candidates (``cost.objective``)."""

    BLOCKS = "blocks"
    """Dynamo's cost in blocks (:mod:`routing.decide.cost`'s formula): the default."""
    PREDICTED_TTFT = "predicted_ttft"
    """Each candidate's predicted TTFT from the measured rates
    (:func:`routing.decide.rates.predict_ttft`: the prefill queue ahead, the prefill of its
    uncached tokens, the KV read for a pair, the first decode step beside the worker's
    running streams). Needs ``disaggregation.measured_rates``."""


class CostConfig(TypedConfig, frozen=True):
    """Dynamo's cost parameters (same names, same defaults) plus session affinity, and
    what is minimized (``objective``)."""

    error_type = ConfigError

    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.5
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0
    session_affinity_credit: float = 16.0
    router_seed: int = 0
    pair_failure_cost_blocks: float = 32.0
    """kvpilot's own (``routing.health.pair_health``): blocks added to a (P, D) pair's cost per
    recent transfer failure or expired lease, halved every ``pair_failure_half_life_s``."""
    pair_failure_half_life_s: float = 60.0
    pair_transfer_cost_blocks_per_s: float = 64.0
    """Blocks added per second of the pair's mean NIXL transfer time."""
    objective: CostObjective = CostObjective.BLOCKS

    def __post_init__(self) -> None:
        weights = (f.name for f in msgspec.structs.fields(self) if f.name not in ("router_seed", "objective"))
        check_range(self, *weights, at_least=0)
        check_range(self, "pair_failure_half_life_s", above=0)


class IndexConfig(TypedConfig, frozen=True):
    """Which block index, and how it reads KV events."""

    error_type = ConfigError

    backend: IndexBackend = IndexBackend.KVPILOT
    block_size: int = 16
    kv_group: int = 0
    removal_log_capacity: int = 65536
    events_stale_after_s: float = 0.0
    """A worker that prefilled blocks its entries lacked and then published no KV
    event for this long is routed on load alone (``routing.health.event_watch``); 0 = off
    (the default: right after a router restart the index can lack blocks an engine
    holds, and a prefill of those publishes nothing)."""
    tiers: Mapping[str, TierClass] = msgspec.field(
        default_factory=lambda: {"GPU": TierClass.GPU, "CPU": TierClass.HOST, "STORAGE": TierClass.DISK}
    )
    """A KV event's medium -> its :class:`TierClass`; media not listed earn nothing."""

    def __post_init__(self) -> None:
        check_range(self, "block_size", "removal_log_capacity", above=0)
        check_range(self, "kv_group", "events_stale_after_s", at_least=0)
        msgspec.structs.force_setattr(self, "tiers", MappingProxyType(dict(self.tiers)))


class SessionStoreKind(str, enum.Enum):
    """``sessions.store``: where the sessions' placement, affinity and D's offers live."""

    MEMORY = "memory"
    """This router's memory only (lost on a restart, not seen by another replica)."""
    REDIS = "redis"
    """Also Redis at ``sessions.redis_url`` (:mod:`routing.state`; needs ``kvpilot[redis]``)."""


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class SessionConfig(TypedConfig, frozen=True):
    error_type = ConfigError

    max_sessions: int = 10000
    force_option: ForcedOption = ForcedOption.CHEAPEST
    """A session's later steps take this option of the article's section 9.2 while it
    is available (``reprefill``, ``pull``, ``affinity``, ``shared_tier``, ``local``);
    ``""``: the cheapest by the roofline."""
    store: SessionStoreKind = SessionStoreKind.MEMORY
    redis_url: str = ""
    """``redis://host:port/db`` (or ``rediss://``, ``unix://``) when ``store`` is ``redis``."""
    store_key_prefix: str = "kvpilot:"
    """Every key the router writes starts with this (one Redis may serve several fleets)."""
    store_read_timeout_s: float = 0.05
    """A session's record not read within this is routed on the local state (counted)."""
    store_write_timeout_s: float = 0.05
    """A write not acknowledged within this is given up (counted); the answer waits for it
    at most this long (:mod:`routing.state.sync` says why it waits)."""
    store_ttl_s: float = 600.0
    """How long a record lives when D stated no hold on the session's blocks (else: D's lease)."""

    def __post_init__(self) -> None:
        check_range(self, "max_sessions", above=0)
        check_range(self, "store_read_timeout_s", "store_write_timeout_s", "store_ttl_s", above=0)
        if self.store is SessionStoreKind.REDIS and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ConfigError(
                "redis_url", f"must be redis://, rediss:// or unix:// with store: redis, got {self.redis_url!r}"
            )


class ServerConfig(TypedConfig, frozen=True):
    """The HTTP front: where it listens, the model it serves, upstream timeouts."""

    error_type = ConfigError

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "tiny"
    model_dir: str = ""
    prefill_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    engine_metrics_interval_s: float = 5.0
    max_body_bytes: int = 4 << 20
    """Larger bodies are refused (413): 4 MiB holds 8K token ids or a long chat."""
    max_prompt_tokens: int = 0
    """Prompts longer than this are refused (400) before routing; 0: no limit. The
    fleet sets the engines' max model length."""
    max_output_tokens: int = 0
    """``max_tokens`` (``max_completion_tokens``) above this is refused (400); 0: no limit."""
    max_concurrent_requests: int = 0
    """Requests in flight at once; 0: no limit (no queue)."""
    max_queued_requests: int = 256
    """Requests waiting for a slot; more are refused at once (429)."""
    queue_timeout_s: float = 30.0
    """A queued request not admitted within this is refused (503)."""
    ttft_slo_s: float = 0.0
    """A routed request whose predicted TTFT (:mod:`routing.decide.rates`: queue,
    prefill, transfer, first decode step) is over this is refused before any engine
    sees it: 429 when the queue ahead of it is what puts it over, else 503, both with
    ``Retry-After`` (:func:`routing.serve.admission.check_ttft_slo`). 0: no SLO (the
    router's default; ``kvpilot fleet up`` sets one, docs/policies.md)."""
    max_retries: int = 1
    """A request whose decode worker failed before anything reached the client
    (no answer, 5xx, timeout) is tried again this many times on other decode workers."""
    circuit_failures: int = 3
    """Consecutive failures (no answer, timeout, 5xx) that open a worker's circuit; 0: off."""
    circuit_open_s: float = 10.0
    """How long an open circuit keeps a worker out of routing before it is tried again."""
    api_key_env: str = ""
    """The environment variable holding the router's API key (``""``: no key). With a
    key, every endpoint except ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <key>``. Named, not stored, so no config file or command
    line carries the secret."""

    engine_api_key_env: str = ""
    """The environment variable holding the engines' API key (vLLM's ``--api-key``),
    sent to every engine as ``Authorization: Bearer <key>``; ``""``: none."""

    def __post_init__(self) -> None:
        check_range(self, "port", at_least=0, below=65536)
        check_range(
            self,
            "engine_metrics_interval_s",
            "max_prompt_tokens",
            "max_output_tokens",
            "max_concurrent_requests",
            "max_queued_requests",
            "circuit_failures",
            "max_retries",
            "ttft_slo_s",
            at_least=0,
        )
        check_range(self, "max_body_bytes", at_least=1024)
        check_range(self, "queue_timeout_s", "circuit_open_s", "prefill_timeout_s", "request_timeout_s", above=0)


class DisaggregationConfig(LocalPrefillConfig, frozen=True):
    """The policy's own :class:`~policies.disaggregation.LocalPrefillConfig` (one type:
    the router hands this section to the policy as it is) plus the preset names it
    costs with. Its defaults are kvpilot's (:data:`~policies.disaggregation.KVPILOT_DEFAULT`),
    not Dynamo's (:data:`~policies.disaggregation.DYNAMO_DEFAULT`): the decode-busy guard at
    90% of D's KV, and the cost checks (the stall budget on D's running streams, local only
    when cheaper than remote), priced from the measured rates."""

    error_type = ConfigError

    decode_busy_kv_usage: float | None = 0.9
    compare_costs: bool = True
    model_preset: str = ""
    """The model the roofline prior prices: ``""``, the served model's own ``config.json`` in
    ``server.model_dir`` (:func:`prior_model`); a :mod:`policies.presets` name overrides it."""
    p_hardware: str = "h100"
    d_hardware: str = "h100"
    link_preset: str = "rdma"
    kv_format: str = "bf16"
    measured_rates: bool = True
    """True (the default): the local-vs-remote verdict and the session options are priced
    with the measured rates (:mod:`routing.decide.rates`) where they exist, the roofline
    prior otherwise; False: the roofline of the presets alone."""

    def __post_init__(self) -> None:
        check_range(self, "max_stall_s", "max_local_tokens", "max_local_fraction", "decode_busy_kv_usage", at_least=0)


class DiscoveryBackend(str, enum.Enum):
    """Where Dynamo's own discovery client finds the workers (its ``--discovery-backend``)."""

    FILE = "file"  # the directory in $DYN_FILE_KV
    ETCD = "etcd"  # ETCD_ENDPOINTS
    KUBERNETES = "kubernetes"


class DynamoConfig(TypedConfig, frozen=True):
    """Routing a Dynamo deployment through its frontend in direct mode
    (:mod:`routing.ingest.dynamo_discovery`, :mod:`routing.serve.dynamo_upstream`).

    The workers are the instances of ``decode_endpoint`` (decode, or aggregated when
    no prefill instance exists) and ``prefill_endpoint``, read through Dynamo's own
    discovery client every ``discovery_interval_s``. Each worker's vLLM-format KV events
    are read at ``tcp://<its request-plane host>:<port>``, the port being its
    request-plane port plus ``kv_events_port_offset`` (many workers on one host, each
    started with its own ``DYN_TCP_RPC_PORT``) or ``kv_events_port`` (the same port on
    every host); both 0: no KV events (routed on load alone). ``kv_events_endpoints``
    names the endpoint of an instance by its id in hex (``40c4d0cf81efebb0``) and comes
    before both rules: workers that share one process (``dynamo.mocker --num-workers``)
    share its request-plane port, so no port rule tells them apart."""

    error_type = ConfigError

    frontend_url: str = ""
    discovery_backend: DiscoveryBackend = DiscoveryBackend.FILE
    decode_endpoint: str = "dynamo.backend.generate"
    prefill_endpoint: str = "dynamo.prefill.generate"
    discovery_interval_s: float = 1.0
    kv_events_port_offset: int = 0
    kv_events_port: int = 0
    kv_events_endpoints: Mapping[str, str] = msgspec.field(default_factory=dict)
    kv_replay_port_offset: int = 0
    """With ``kv_events_port_offset``: each worker serves its KV-event replay at its
    request-plane port plus this (``dynamo.mocker --zmq-replay-ports``), so a restarted
    router reads back the blocks the workers hold; 0: no replay."""

    @property
    def enabled(self) -> bool:
        return bool(self.frontend_url)

    def __post_init__(self) -> None:
        if self.frontend_url:
            parts = urlsplit(self.frontend_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError("frontend_url", f"must be http(s)://host:port, got {self.frontend_url!r}")
            msgspec.structs.force_setattr(self, "frontend_url", self.frontend_url.rstrip("/"))
        for name in ("decode_endpoint", "prefill_endpoint"):
            if len(getattr(self, name).split(".")) != 3:
                raise ConfigError(name, f"must be namespace.component.endpoint, got {getattr(self, name)!r}")
        check_range(self, "discovery_interval_s", above=0)
        if self.kv_events_port and self.kv_events_port_offset:
            raise ConfigError("kv_events_port", "set kv_events_port or kv_events_port_offset, not both")
        check_range(self, "kv_events_port", at_least=0, below=65536)
        check_range(self, "kv_events_port_offset", above=-65536, below=65536)
        check_range(self, "kv_replay_port_offset", above=-65536, below=65536)
        if self.kv_replay_port_offset and not self.kv_events_port_offset:
            raise ConfigError("kv_replay_port_offset", "needs kv_events_port_offset (the same port rule)")
        for instance, endpoint in self.kv_events_endpoints.items():
            try:
                int(instance, 16)
            except ValueError:
                raise ConfigError("kv_events_endpoints", f"keys are instance ids in hex, got {instance!r}") from None
            if not endpoint.startswith("tcp://"):
                raise ConfigError("kv_events_endpoints", f"{instance}: must be tcp://host:port, got {endpoint!r}")
        endpoints = {instance.lower(): endpoint for instance, endpoint in self.kv_events_endpoints.items()}
        msgspec.structs.force_setattr(self, "kv_events_endpoints", MappingProxyType(endpoints))


class GatewayConfig(TypedConfig, frozen=True):
    """kvpilot as Envoy's endpoint picker (:mod:`routing.gateway`): with ``picker_port``
    set the router also serves, on ``server.host:picker_port``, the gRPC services Envoy
    calls: ``ext_proc`` (each request's headers and body; the answer names the
    destination) and the OpenTelemetry logs service (Envoy's access log: each request's
    end and first-token time). Streams then go from the engines to the clients through
    Envoy, not through the router (``deploy/envoy_spec.py`` writes Envoy's config).
    ``picker_port`` 0: no picker (the HTTP front alone)."""

    error_type = ConfigError

    picker_port: int = 0

    def __post_init__(self) -> None:
        check_range(self, "picker_port", at_least=0, below=65536)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class Worker(TypedConfig, frozen=True):
    """One engine: an OpenAI-compatible server at ``url`` with optional KV events, as
    written in YAML and as the router uses it (:mod:`routing.fleet` checks the fleet)."""

    error_type = ConfigError

    name: WorkerId
    role: Role
    url: str
    kv_events_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = "kv"
    kv_blocks: int = 0
    """KV capacity in blocks (0 = unknown: the decode-busy guard reads usage 0)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name", "must be a non-empty string")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError("url", f"must be http(s)://host:port, got {self.url!r}")
        msgspec.structs.force_setattr(self, "url", self.url.rstrip("/"))
        for name in ("kv_events_endpoint", "replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(_EVENT_SCHEMES):
                raise ConfigError(name, f"must be a tcp://, ipc:// or inproc:// endpoint, got {endpoint!r}")
        if self.replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("replay_endpoint", "needs kv_events_endpoint")
        check_range(self, "kv_blocks", at_least=0)


class RouterConfig(TypedConfig, frozen=True):
    error_type = ConfigError

    cost: CostConfig = msgspec.field(default_factory=CostConfig)
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    sessions: SessionConfig = msgspec.field(default_factory=SessionConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    disaggregation: DisaggregationConfig = msgspec.field(default_factory=DisaggregationConfig)
    dynamo: DynamoConfig = msgspec.field(default_factory=DynamoConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    workers: tuple[Worker, ...] = ()

    def __post_init__(self) -> None:
        if self.cost.objective is CostObjective.PREDICTED_TTFT and not self.disaggregation.measured_rates:
            raise ConfigError("cost.objective", "predicted_ttft needs disaggregation.measured_rates: true")


_FLAG_KINDS = (int, float, str, bool)
_NULL = object()
"""A flag's ``none``: the leaf set to null (distinct from a flag not given)."""


def _scalar(annotation: Any) -> tuple[type, bool] | None:
    """(type, nullable) of a scalar leaf's annotation (a bool, number, string or
    enum, maybe ``| None``), or None for anything else."""
    nullable = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (annotation,) = [a for a in args if a is not type(None)]
        nullable = True
    if annotation in _FLAG_KINDS or (isinstance(annotation, type) and issubclass(annotation, enum.Enum)):
        return annotation, nullable
    return None


def _leaves() -> list[tuple[str, str, type, bool]]:
    """(section, field, type, nullable) of every scalar leaf of the mapping sections."""
    out = []
    for section in msgspec.structs.fields(RouterConfig):
        if not (isinstance(section.type, type) and issubclass(section.type, TypedConfig)):
            continue
        for leaf in msgspec.structs.fields(section.type):
            scalar = _scalar(leaf.type)
            if scalar is not None:
                out.append((section.name, leaf.name, *scalar))
    return out


def _flag_parser(kind: type[Any], nullable: bool) -> Any:
    """argparse's ``type=`` for a leaf: ``true``/``false`` for a bool, ``none`` for
    null, the text itself for an enum (its ``choices`` check it)."""

    def parse(text: str) -> Any:
        if nullable and text.lower() in ("none", "null"):
            return _NULL
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return text.lower() == "true"
        return text if issubclass(kind, enum.Enum) else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--<field-name>`` for every scalar leaf (default None = not given); a
    nullable leaf takes ``none``, a boolean ``true`` or ``false``, an enum one of its
    values (argparse's ``choices``)."""
    group = parser.add_argument_group("router config (overrides the YAML file)")
    for section, name, kind, nullable in _leaves():
        choices: list[object] | None = None
        metavar = kind.__name__.upper()
        if issubclass(kind, enum.Enum):
            values = [member.value for member in kind]
            choices, metavar = [*values, *([_NULL] if nullable else [])], "{" + ",".join(values) + "}"
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"{section}__{name}",
            type=_flag_parser(kind, nullable),
            choices=choices,
            default=None,
            metavar=metavar + ("|none" if nullable else ""),
        )


def load_config(path: str | Path | None, args: argparse.Namespace | None = None) -> RouterConfig:
    """Defaults, then the YAML file at ``path`` (if any), then flags set in ``args``,
    converted by :func:`policies.typed_config.convert`. Raises :class:`ConfigError`
    naming the first wrong key."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(ConfigError.ROOT_KEY, f"must be a mapping, got {type(loaded).__name__} ({path})")
        data = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (loaded or {}).items()}
    if args is not None:
        for section, name, _, _ in _leaves():
            value = getattr(args, f"{section}__{name}", None)
            if value is not None:
                target = data.setdefault(section, {})
                if not isinstance(target, dict):
                    raise ConfigError(section, "must be a mapping")
                target[name] = None if value is _NULL else value
    return convert(data, RouterConfig)


FALLBACK_MODEL_PRESET = "llama-8b"
"""The prior's model for a router whose ``server.model_dir`` holds no ``config.json`` and
that names no ``disaggregation.model_preset``."""


def prior_model(config: RouterConfig) -> ModelSpec:
    """The model the roofline prior prices (see ``disaggregation.model_preset``): the named
    preset, else the served model's ``config.json`` in ``server.model_dir``, else (none
    there: a tokenizer-only directory, or no directory) :data:`FALLBACK_MODEL_PRESET`, with
    a warning. Raises :class:`ConfigError` naming the key for an unknown preset or a
    ``config.json`` that is unreadable or lacks a field the roofline needs."""
    cfg = config.disaggregation
    path = Path(config.server.model_dir) / "config.json" if config.server.model_dir else None
    if not cfg.model_preset and path is not None and path.is_file():
        try:
            return model_from_mapping(json.loads(path.read_text()), str(path))
        except (OSError, ValueError, SpecError) as exc:
            raise ConfigError("server.model_dir", f"the prior's model comes from {path}: {exc}") from None
    if not cfg.model_preset:
        log.warning(
            "no model config.json in server.model_dir (%r): the roofline prior prices %s until rates are measured",
            config.server.model_dir,
            FALLBACK_MODEL_PRESET,
        )
    try:
        return model_preset(cfg.model_preset or FALLBACK_MODEL_PRESET)
    except SpecError as exc:
        raise ConfigError("disaggregation.model_preset", str(exc)) from None
