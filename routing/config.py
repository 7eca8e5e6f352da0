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
    index:
      backend: kvpilot                   # kvpilot | dynamo (Dynamo's RadixTree; needs kvpilot[dynamo])
      block_size: 16
      tiers: {GPU: gpu, CPU: host, STORAGE: disk}
      events_stale_after_s: 0.0          # > 0: a worker silent this long after a prefill is routed on load alone
    sessions:
      max_sessions: 10000
      force_option: ""                   # reprefill | pull | affinity | shared_tier | local; "" = cheapest
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
      compare_costs: false               # true: also the roofline comparison below
      max_stall_s: 0.05
      model_preset: llama-8b             # policies.presets names
      p_hardware: h100
      d_hardware: h100
      link_preset: rdma
      kv_format: bf16
    dynamo:                              # beside NVIDIA Dynamo (docs/dynamo.md); off while frontend_url is ""
      frontend_url: http://127.0.0.1:8090   # Dynamo's frontend in direct mode: every request goes there
      discovery_backend: file            # file ($DYN_FILE_KV) | etcd | kubernetes: Dynamo's own client reads it
      decode_endpoint: dynamo.backend.generate
      prefill_endpoint: dynamo.prefill.generate
      discovery_interval_s: 1.0          # how often joins and departures are picked up
      kv_events_port_offset: 0           # a worker's vLLM KV events: its request-plane port + this, or
      kv_events_port: 0                  #   this same port on every worker's host (one worker per host)
    workers:                             # Worker; routing.fleet checks the fleet (empty beside Dynamo)
      - name: prefill-0
        role: prefill                    # prefill | decode | colocated
        url: http://127.0.0.1:8100
        kv_events_endpoint: tcp://127.0.0.1:5700   # the router binds it; the engine connects
        replay_endpoint: tcp://127.0.0.1:5800      # the engine binds it
        topic: kv
        kv_blocks: 0                     # the engine's KV capacity in blocks (0 = unknown)

Every scalar leaf outside ``workers`` also has a flag (``--overlap-score-credit 0.5``,
``--compare-costs true``, ``--max-local-tokens none``);
flags override YAML, YAML overrides defaults. msgspec converts the merged mapping
into these frozen dataclasses (the same approach as ``kvconnectors/config.py``,
``kvconnectors/transfer_params.py`` and ``policies/presets.py``), running each
section's own range checks; an unknown key is an error naming its path
(``cost.overlap_score_credt``), and so is a value of the wrong type
(``cost.router_seed: Expected `int`, got `float```) or out of range.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import msgspec
import yaml

from policies.disaggregation import LocalPrefillConfig
from policies.session_options import Option
from routing.ids import WorkerId

TIER_CLASSES = ("gpu", "host", "disk", "shared")
INDEX_BACKENDS = ("kvpilot", "dynamo")
SESSION_OPTIONS = tuple(option.value for option in Option)
"""What ``sessions.force_option`` may name."""


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class CostConfig:
    """Dynamo's cost parameters (same names, same defaults) plus session affinity."""

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

    def __post_init__(self) -> None:
        _non_negative(
            self,
            *(f.name for f in dataclasses.fields(self) if f.name != "router_seed"),
        )
        if not self.pair_failure_half_life_s > 0:
            raise ConfigError(f"pair_failure_half_life_s must be > 0, got {self.pair_failure_half_life_s}")


@dataclass(frozen=True)
class IndexConfig:
    """Which block index, and how it reads KV events."""

    backend: str = "kvpilot"
    block_size: int = 16
    kv_group: int = 0
    removal_log_capacity: int = 65536
    events_stale_after_s: float = 0.0
    """A worker that prefilled blocks its entries lacked and then published no KV
    event for this long is routed on load alone (``routing.health.event_watch``); 0 = off
    (the default: right after a router restart the index can lack blocks an engine
    holds, and a prefill of those publishes nothing)."""
    tiers: Mapping[str, str] = field(default_factory=lambda: {"GPU": "gpu", "CPU": "host", "STORAGE": "disk"})

    def __post_init__(self) -> None:
        if self.backend not in INDEX_BACKENDS:
            raise ConfigError(f"backend must be one of {INDEX_BACKENDS}, got {self.backend!r}")
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.kv_group < 0:
            raise ConfigError(f"kv_group must be >= 0, got {self.kv_group}")
        if self.removal_log_capacity <= 0:
            raise ConfigError("removal_log_capacity must be positive")
        if not self.events_stale_after_s >= 0:
            raise ConfigError(f"events_stale_after_s must be >= 0, got {self.events_stale_after_s}")
        for medium, klass in self.tiers.items():
            if klass not in TIER_CLASSES:
                raise ConfigError(f"tiers.{medium} must be one of {TIER_CLASSES}, got {klass!r}")
        object.__setattr__(self, "tiers", MappingProxyType(dict(self.tiers)))


@dataclass(frozen=True)
class SessionConfig:
    max_sessions: int = 10000
    force_option: str = ""
    """A session's later steps take this option of the article's section 9.2 while it
    is available (``reprefill``, ``pull``, ``affinity``, ``shared_tier``, ``local``);
    ``""``: the cheapest by the roofline."""

    def __post_init__(self) -> None:
        if self.max_sessions <= 0:
            raise ConfigError(f"max_sessions must be positive, got {self.max_sessions}")
        if self.force_option and self.force_option not in SESSION_OPTIONS:
            raise ConfigError(f"force_option must be one of {SESSION_OPTIONS} or empty, got {self.force_option!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front: where it listens, the model it serves, upstream timeouts."""

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
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65536), got {self.port}")
        for name in (
            "engine_metrics_interval_s",
            "max_prompt_tokens",
            "max_output_tokens",
            "max_concurrent_requests",
            "max_queued_requests",
            "circuit_failures",
            "max_retries",
        ):
            _non_negative(self, name)
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        for name in ("queue_timeout_s", "circuit_open_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("prefill_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class DisaggregationConfig(LocalPrefillConfig):
    """The policy's own :class:`~policies.disaggregation.LocalPrefillConfig` (one type:
    the router hands this section to the policy as it is) plus the preset names it
    costs with. One default differs from Dynamo's (:data:`~policies.disaggregation.DYNAMO_DEFAULT`):
    the decode-busy guard is on at 90% of D's KV."""

    decode_busy_kv_usage: float | None = 0.9
    model_preset: str = "llama-8b"
    p_hardware: str = "h100"
    d_hardware: str = "h100"
    link_preset: str = "rdma"
    kv_format: str = "bf16"

    def __post_init__(self) -> None:
        _non_negative(self, "max_stall_s")
        for name in ("max_local_tokens", "max_local_fraction", "decode_busy_kv_usage"):
            if getattr(self, name) is not None:
                _non_negative(self, name)


class DiscoveryBackend(str, enum.Enum):
    """Where Dynamo's own discovery client finds the workers (its ``--discovery-backend``)."""

    FILE = "file"  # the directory in $DYN_FILE_KV
    ETCD = "etcd"  # ETCD_ENDPOINTS
    KUBERNETES = "kubernetes"


@dataclass(frozen=True)
class DynamoConfig:
    """Routing a Dynamo deployment through its frontend in direct mode
    (:mod:`routing.ingest.dynamo_discovery`, :mod:`routing.serve.dynamo_upstream`).

    The workers are the instances of ``decode_endpoint`` (decode, or aggregated when
    no prefill instance exists) and ``prefill_endpoint``, read through Dynamo's own
    discovery client every ``discovery_interval_s``. Each worker's vLLM-format KV events
    are read at ``tcp://<its request-plane host>:<port>``, the port being its
    request-plane port plus ``kv_events_port_offset`` (many workers on one host, each
    started with its own ``DYN_TCP_RPC_PORT``) or ``kv_events_port`` (the same port on
    every host); both 0: no KV events (routed on load alone)."""

    frontend_url: str = ""
    discovery_backend: str = DiscoveryBackend.FILE.value
    decode_endpoint: str = "dynamo.backend.generate"
    prefill_endpoint: str = "dynamo.prefill.generate"
    discovery_interval_s: float = 1.0
    kv_events_port_offset: int = 0
    kv_events_port: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.frontend_url)

    def __post_init__(self) -> None:
        if self.frontend_url:
            parts = urlsplit(self.frontend_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"frontend_url must be http(s)://host:port, got {self.frontend_url!r}")
            object.__setattr__(self, "frontend_url", self.frontend_url.rstrip("/"))
        backends = tuple(b.value for b in DiscoveryBackend)
        if self.discovery_backend not in backends:
            raise ConfigError(f"discovery_backend must be one of {backends}, got {self.discovery_backend!r}")
        for name in ("decode_endpoint", "prefill_endpoint"):
            if len(getattr(self, name).split(".")) != 3:
                raise ConfigError(f"{name} must be namespace.component.endpoint, got {getattr(self, name)!r}")
        if not (math.isfinite(self.discovery_interval_s) and self.discovery_interval_s > 0):
            raise ConfigError(f"discovery_interval_s must be a finite number > 0, got {self.discovery_interval_s!r}")
        if self.kv_events_port and self.kv_events_port_offset:
            raise ConfigError("set kv_events_port or kv_events_port_offset, not both")
        if not 0 <= self.kv_events_port < 65536:
            raise ConfigError(f"kv_events_port must be in [0, 65536), got {self.kv_events_port}")
        if abs(self.kv_events_port_offset) >= 65536:
            raise ConfigError(f"kv_events_port_offset must be within (-65536, 65536), got {self.kv_events_port_offset}")


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class Worker:
    """One engine: an OpenAI-compatible server at ``url`` with optional KV events, as
    written in YAML and as the router uses it (:mod:`routing.fleet` checks the fleet)."""

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
            raise ConfigError("name must be a non-empty string")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"url must be http(s)://host:port, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        for name in ("kv_events_endpoint", "replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(_EVENT_SCHEMES):
                raise ConfigError(f"{name} must be a tcp://, ipc:// or inproc:// endpoint")
        if self.replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("replay_endpoint needs kv_events_endpoint")
        if self.kv_blocks < 0:
            raise ConfigError(f"kv_blocks must be >= 0, got {self.kv_blocks}")


@dataclass(frozen=True)
class RouterConfig:
    cost: CostConfig = field(default_factory=CostConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    dynamo: DynamoConfig = field(default_factory=DynamoConfig)
    workers: tuple[Worker, ...] = ()


_MSGSPEC_ERROR = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def _dotted(error: msgspec.ValidationError) -> str:
    """msgspec's ``"<message> - at `$.cost.router_seed`"`` as ``cost.router_seed: <message>``.

    A message from a section's own check starts with its field name in lower case
    (``"block_size must be positive"``) and joins the path with a dot instead."""
    match = _MSGSPEC_ERROR.match(str(error))
    assert match is not None  # the pattern matches every string
    message, path = match["message"], (match["path"] or "").lstrip(".")
    if not path:
        return message
    return f"{path}.{message}" if message[:1].islower() else f"{path}: {message}"


def _check_keys(cls: type, data: object, prefix: str) -> None:
    """Unknown and missing keys, named by path (msgspec ignores unknown dataclass fields)."""
    if not isinstance(data, Mapping):
        return  # msgspec names the wrong type
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(f"unknown config key {prefix + str(key)!r}")
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing config key {prefix + name!r}")
            continue
        kind, value = hints[name], data[name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            _check_keys(kind, value, f"{prefix}{name}.")
        elif typing.get_origin(kind) is tuple and isinstance(value, list):
            (item,) = [a for a in typing.get_args(kind) if a is not Ellipsis]
            if isinstance(item, type) and dataclasses.is_dataclass(item):
                for i, entry in enumerate(value):
                    _check_keys(item, entry, f"{prefix}{name}[{i}].")


def _build(data: Mapping[str, Any]) -> RouterConfig:
    """``data`` as a :class:`RouterConfig`; msgspec converts and runs each section's checks."""
    _check_keys(RouterConfig, data, "")
    try:
        return msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_dotted(exc)) from None


_FLAG_KINDS = (int, float, str, bool)
_NULL = object()
"""A flag's ``none``: the leaf set to null (distinct from a flag not given)."""


def _scalar(annotation: Any) -> tuple[type, bool] | None:
    """(type, nullable) of a scalar leaf's annotation, or None for anything else."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return (inner, True) if inner in _FLAG_KINDS else None
    return (annotation, False) if annotation in _FLAG_KINDS else None


def _leaves() -> list[tuple[str, str, type, bool]]:
    """(section, field, type, nullable) of every scalar leaf of the mapping sections."""
    out = []
    for section, cls in typing.get_type_hints(RouterConfig).items():
        if not dataclasses.is_dataclass(cls):
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            scalar = _scalar(hints[f.name])
            if scalar is not None:
                out.append((section, f.name, *scalar))
    return out


def _flag_parser(kind: type, nullable: bool) -> Any:
    """argparse's ``type=`` for a leaf: ``true``/``false`` for a bool, ``none`` for null."""

    def parse(text: str) -> Any:
        if nullable and text.lower() in ("none", "null"):
            return _NULL
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return text.lower() == "true"
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--<field-name>`` for every scalar leaf (default None = not given); a
    nullable leaf takes ``none``, a boolean ``true`` or ``false``."""
    group = parser.add_argument_group("router config (overrides the YAML file)")
    for section, name, kind, nullable in _leaves():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"{section}__{name}",
            type=_flag_parser(kind, nullable),
            default=None,
            metavar=kind.__name__.upper() + ("|none" if nullable else ""),
        )


def load_config(path: str | Path | None, args: argparse.Namespace | None = None) -> RouterConfig:
    """Defaults, then the YAML file at ``path`` (if any), then flags set in ``args``."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (loaded or {}).items()}
    if args is not None:
        for section, name, _, _ in _leaves():
            value = getattr(args, f"{section}__{name}", None)
            if value is not None:
                target = data.setdefault(section, {})
                if not isinstance(target, dict):
                    raise ConfigError(f"{section} must be a mapping")
                target[name] = None if value is _NULL else value
    return _build(data)
