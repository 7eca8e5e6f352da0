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
    index:
      block_size: 16
      tiers: {GPU: gpu, CPU: host, STORAGE: disk}
    sessions:
      max_sessions: 10000

Every leaf except mappings also has a flag (``--overlap-score-credit 0.5``);
flags override YAML, YAML overrides defaults. An unknown key is an error naming
its path (``cost.overlap_score_credt``); so is a value of the wrong type or
out of range.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

TIER_CLASSES = ("gpu", "host", "disk", "shared")


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

    def __post_init__(self) -> None:
        _non_negative(
            self,
            *(f.name for f in dataclasses.fields(self) if f.name != "router_seed"),
        )


@dataclass(frozen=True)
class IndexConfig:
    """How the block index reads KV events."""

    block_size: int = 16
    kv_group: int = 0
    removal_log_capacity: int = 65536
    tiers: Mapping[str, str] = field(
        default_factory=lambda: {"GPU": "gpu", "CPU": "host", "STORAGE": "disk"}
    )

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.kv_group < 0:
            raise ConfigError(f"kv_group must be >= 0, got {self.kv_group}")
        if self.removal_log_capacity <= 0:
            raise ConfigError("removal_log_capacity must be positive")
        for medium, klass in self.tiers.items():
            if klass not in TIER_CLASSES:
                raise ConfigError(f"tiers.{medium} must be one of {TIER_CLASSES}, got {klass!r}")
        object.__setattr__(self, "tiers", MappingProxyType(dict(self.tiers)))


@dataclass(frozen=True)
class SessionConfig:
    max_sessions: int = 10000

    def __post_init__(self) -> None:
        if self.max_sessions <= 0:
            raise ConfigError(f"max_sessions must be positive, got {self.max_sessions}")


@dataclass(frozen=True)
class RouterConfig:
    cost: CostConfig = field(default_factory=CostConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)


def _coerce(value: Any, kind: Any, path: str) -> Any:
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or 'config'} must be a mapping, got {type(value).__name__}")
        return _build(kind, value, path + ".")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if typing.get_origin(kind) is Mapping:
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(f"{path} must be a mapping of strings to strings")
        return dict(value)
    raise ConfigError(f"{path}: unsupported type {kind!r}")  # pragma: no cover


def _build(cls: Any, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown config key {prefix + str(key)!r}")
    values = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}" if prefix else str(exc)) from None


def _leaves() -> list[tuple[str, str, Any]]:
    out = []
    for section, cls in typing.get_type_hints(RouterConfig).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                out.append((section, f.name, hints[f.name]))
    return out


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--<field-name>`` for every numeric leaf (default None = not given)."""
    group = parser.add_argument_group("router config (overrides the YAML file)")
    for section, name, kind in _leaves():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"{section}__{name}",
            type=kind,
            default=None,
            metavar=kind.__name__.upper(),
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
        for section, name, _ in _leaves():
            value = getattr(args, f"{section}__{name}", None)
            if value is not None:
                target = data.setdefault(section, {})
                if not isinstance(target, dict):
                    raise ConfigError(f"{section} must be a mapping")
                target[name] = value
    return _build(RouterConfig, data, "")
