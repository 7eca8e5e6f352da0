"""Frozen, validated specs: a model, a KV format, an instance's hardware, a link.

Every spec is a :class:`~kvpilot.policies.typed_config.TypedConfig`: it validates itself
in ``__post_init__`` and raises :class:`SpecError` naming the offending field.
Units are SI throughout: bytes, seconds, FLOP/s, bytes/s; link rates are given
the way vendors quote them (Gbit/s per lane). Parsing from presets and files
lives in :mod:`kvpilot.policies.presets`.
"""

from __future__ import annotations

import typing
from typing import Literal

from kvpilot.policies.typed_config import TypedConfig, TypedConfigError, check_range

AttentionKind = Literal["gqa", "mla"]
AttentionParallel = Literal["tp", "dp"]
LinkKind = Literal["rdma", "tcp", "nvlink", "mnnvl", "pcie", "c2c", "nvme"]


class SpecError(TypedConfigError):
    """A spec field is missing, unknown or out of range; ``key`` names it."""

    ROOT_KEY = "<document>"


class _Spec(TypedConfig, frozen=True):
    error_type = SpecError


def _require_one_of(spec: _Spec, name: str, allowed: object) -> None:
    """``spec.<name>`` must be one of the ``Literal`` type ``allowed``'s values (msgspec
    checks this when it converts; this is for direct construction)."""
    values = typing.get_args(allowed)
    if getattr(spec, name) not in values:
        raise SpecError(name, f"must be one of {', '.join(map(repr, values))}, got {getattr(spec, name)!r}")


class ModelSpec(_Spec, frozen=True):
    """A transformer's shape, as far as KV size, FLOPs and weight traffic need it.

    ``params_active`` drives FLOPs (2 per parameter per token); ``params_total``
    drives weight memory and the weight bytes a decode step streams. For MLA
    (``attention="mla"``) the KV cache holds one latent of ``kv_lora_rank +
    qk_rope_head_dim`` values per token and layer, replicated on every TP rank;
    prefill runs attention expanded (``qk_nope_head_dim + qk_rope_head_dim`` for
    queries/keys, ``v_head_dim`` for values); decode runs absorbed, on the latent.
    Hybrid models: ``sliding_window_layers`` keep at most ``sliding_window`` tokens
    of KV; ``state_layers`` (linear attention / state space) keep a fixed
    ``state_bytes_per_layer`` per sequence and no per-token KV.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    params_total: float
    params_active: float
    weight_bytes_per_param: float = 2.0
    attention: AttentionKind = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window_layers: int = 0
    sliding_window: int = 0
    state_layers: int = 0
    state_bytes_per_layer: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("name", "must be a non-empty string")
        check_range(
            self,
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "params_total",
            "params_active",
            "weight_bytes_per_param",
            above=0,
        )
        check_range(
            self,
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "sliding_window_layers",
            "sliding_window",
            "state_layers",
            "state_bytes_per_layer",
            at_least=0,
        )
        _require_one_of(self, "attention", AttentionKind)
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError("num_kv_heads", "must divide num_attention_heads")
        if self.params_active > self.params_total:
            raise SpecError("params_active", "must not exceed params_total")
        if self.attention == "mla":
            check_range(self, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", above=0)
        if self.sliding_window_layers and not self.sliding_window:
            raise SpecError("sliding_window", "must be > 0 when sliding_window_layers > 0")
        if self.state_layers and not self.state_bytes_per_layer:
            raise SpecError("state_bytes_per_layer", "must be > 0 when state_layers > 0")
        if self.sliding_window_layers + self.state_layers > self.num_layers:
            raise SpecError("num_layers", "is smaller than sliding_window_layers + state_layers")

    @property
    def full_attention_layers(self) -> int:
        return self.num_layers - self.sliding_window_layers - self.state_layers

    @property
    def attention_layers(self) -> int:
        """Layers that keep per-token KV (full or sliding-window attention)."""
        return self.num_layers - self.state_layers

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def kv_values_per_token_layer(self) -> int:
        """Cached values per token per attention layer (keys and values, or the MLA latent)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def prefill_qk_dim(self) -> int:
        """Per-head query/key width of prefill attention (MLA runs expanded)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def prefill_v_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.weight_bytes_per_param


class KVFormat(_Spec, frozen=True):
    """How KV values are stored: ``value_bits`` each, plus one ``scale_bits`` scale
    per ``scale_block`` values (0 for none). Bytes per value include the scales."""

    name: str
    value_bits: float
    scale_bits: float = 0.0
    scale_block: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("name", "must be a non-empty string")
        check_range(self, "value_bits", above=0)
        check_range(self, "scale_bits", "scale_block", at_least=0)
        if self.scale_bits and not self.scale_block:
            raise SpecError("scale_block", "must be > 0 when scale_bits > 0")

    @property
    def bytes_per_value(self) -> float:
        scale = self.scale_bits / self.scale_block if self.scale_block else 0.0
        return (self.value_bits + scale) / 8.0


class HardwareSpec(_Spec, frozen=True):
    """One serving instance: ``gpus`` identical GPUs (per-GPU figures below).

    ``compute_efficiency`` scales peak dense FLOP/s (the article uses 60% for
    prefill); ``bandwidth_efficiency`` scales HBM bandwidth (the article's decode
    figures use the full rate); ``memory_utilization`` is the share of HBM the
    engine may use for weights plus KV (vLLM's ``gpu_memory_utilization``).
    ``attention_parallel`` is "tp" (KV sharded by KV head, MLA latents
    replicated on every rank) or "dp" (each GPU attends only to its own sequences).
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    gpus: int = 1
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 1.0
    memory_utilization: float = 0.9
    attention_parallel: AttentionParallel = "tp"

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("name", "must be a non-empty string")
        check_range(self, "peak_flops", "hbm_bandwidth", "hbm_bytes", "gpus", above=0)
        check_range(self, "compute_efficiency", "bandwidth_efficiency", "memory_utilization", above=0, at_most=1)
        _require_one_of(self, "attention_parallel", AttentionParallel)

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.gpus * self.compute_efficiency

    @property
    def effective_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.gpus * self.bandwidth_efficiency


class LinkSpec(_Spec, frozen=True):
    """A path KV can take: ``lanes`` x ``lane_gbps`` Gbit/s at ``efficiency``, plus
    ``setup_s`` fixed cost per transfer (posting, descriptor setup, handshake)."""

    name: str
    kind: LinkKind
    lanes: int
    lane_gbps: float
    efficiency: float = 1.0
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("name", "must be a non-empty string")
        _require_one_of(self, "kind", LinkKind)
        check_range(self, "lanes", "lane_gbps", above=0)
        check_range(self, "efficiency", above=0, at_most=1)
        check_range(self, "setup_s", at_least=0)

    @property
    def effective_bytes_per_s(self) -> float:
        return self.lanes * self.lane_gbps * 1e9 / 8.0 * self.efficiency

    def wire_seconds(self, nbytes: float) -> float:
        """Time on the wire for ``nbytes``, without the fixed per-transfer cost."""
        return nbytes / self.effective_bytes_per_s

    def transfer_seconds(self, nbytes: float) -> float:
        """``setup_s`` plus wire time; 0 for an empty transfer."""
        return self.setup_s + self.wire_seconds(nbytes) if nbytes > 0 else 0.0
