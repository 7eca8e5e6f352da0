"""Named presets and parsers that turn a Hugging Face ``config.json`` or a small
YAML/JSON document into validated specs.

Pure: the parsers take text or mappings; reading files is the CLI's job. Model
presets are written as the models' own ``config.json`` fields and go through the
same parser as a file would, so the parameter count is derived from the model's
dimensions, never typed in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
import yaml

from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec, SpecError
from kvpilot.policies.typed_config import TypedConfig, convert

# --- models, as their config.json ---------------------------------------------------

HF_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama-3-70B: the article's running example (80 layers, 64 query / 8 KV heads).
    "llama-70b": {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-8b": {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # DeepSeek-V3: MLA + MoE (256 routed experts, 8 active, 1 shared; FP8 weights).
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8"},
    },
}

KV_FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat("bf16", 16),
    "fp8": KVFormat("fp8", 8),
    # 4-bit values plus one FP8 (E4M3) scale per 16 values; the per-tensor FP32
    # scale is a few bytes per layer and is left out.
    "nvfp4": KVFormat("nvfp4", 4, scale_bits=8, scale_block=16),
}

# Per-device figures: dense BF16 FLOP/s, memory bytes/s, memory bytes. GPUs from
# their datasheets; "cpu" is one x86 core (nominal: AVX-512 FMA at ~2.5 GHz, a
# share of a server's DRAM bandwidth), for the CPU test bed: "cpux2" is two cores.
GPUS: dict[str, tuple[float, float, float]] = {
    "b200": (2.25e15, 8.0e12, 192e9),
    "h100": (989e12, 3.35e12, 80e9),
    "h200": (989e12, 4.8e12, 141e9),
    "cpu": (1.0e11, 1.0e10, 12e9),
}

# Links for the article's two-GPU instance (lanes = NICs or GPUs). NIXL paths
# carry vLLM's documented ~0.7 ms average posting time as their fixed cost.
NIXL_POST_S = 0.7e-3
LINKS: dict[str, LinkSpec] = {
    "rdma": LinkSpec("rdma", "rdma", lanes=2, lane_gbps=400, efficiency=0.9, setup_s=NIXL_POST_S),
    "tcp": LinkSpec("tcp", "tcp", lanes=2, lane_gbps=100, efficiency=0.4, setup_s=NIXL_POST_S),
    "nvlink": LinkSpec("nvlink", "nvlink", lanes=2, lane_gbps=7200, setup_s=NIXL_POST_S),
    "mnnvl": LinkSpec("mnnvl", "mnnvl", lanes=2, lane_gbps=7200, setup_s=NIXL_POST_S),
    "pcie": LinkSpec("pcie", "pcie", lanes=2, lane_gbps=512, efficiency=0.8),
    "c2c": LinkSpec("c2c", "c2c", lanes=1, lane_gbps=3600),
    "nvme": LinkSpec("nvme", "nvme", lanes=2, lane_gbps=112, efficiency=0.8),
    # NIXL over UCX between two processes of one CPU box (TCP / shared memory on lo):
    # 4-17 GB/s measured for DRAM descriptors; a prior until an engine measures its own.
    "loopback": LinkSpec("loopback", "tcp", lanes=1, lane_gbps=32, setup_s=NIXL_POST_S),
}

_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "float8_e4m3fn": 1.0}
_SLIDING = {"sliding_attention", "sliding_window", "local_attention"}
_STATEFUL = {"linear_attention", "mamba", "ssm", "recurrent"}


def _req(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    value = cfg.get(key)
    if value is None:
        raise SpecError(key, f"missing from {source}")
    return value


def _estimate_params(
    cfg: Mapping[str, Any], source: str, hidden: int, heads: int, kv_heads: int, head_dim: int, mla: bool
) -> tuple[float, float]:
    """(total, active) parameters from a config's dimensions (gated MLPs assumed)."""
    layers = int(_req(cfg, "num_hidden_layers", source))
    vocab = int(_req(cfg, "vocab_size", source))
    if mla:
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        q_rank = cfg.get("q_lora_rank")
        q = hidden * q_rank + q_rank * heads * qk if q_rank else hidden * heads * qk
        kv = hidden * (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]))
        kv += int(cfg["kv_lora_rank"]) * heads * (int(cfg["qk_nope_head_dim"]) + int(cfg["v_head_dim"]))
        attn = q + kv + heads * int(cfg["v_head_dim"]) * hidden
    else:
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    dense_mlp = 3 * hidden * int(_req(cfg, "intermediate_size", source))
    if experts:
        top_k = int(_req(cfg, "num_experts_per_tok", source))
        expert = 3 * hidden * int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        shared = int(cfg.get("n_shared_experts") or 0) * expert
        shared += 3 * hidden * int(cfg.get("shared_expert_intermediate_size") or 0)
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        moe_layers = layers - dense_layers
        router = hidden * experts
        total_mlp = dense_layers * dense_mlp + moe_layers * (experts * expert + shared + router)
        active_mlp = dense_layers * dense_mlp + moe_layers * (top_k * expert + shared + router)
    else:
        total_mlp = active_mlp = layers * dense_mlp
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    common = layers * (attn + 2 * hidden) + hidden + embeddings
    return float(common + total_mlp), float(common + active_mlp)


def model_from_hf_config(cfg: Mapping[str, Any], name: str, source: str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a Hugging Face ``config.json`` mapping.

    Supports Llama-style GQA, DeepSeek-style MLA, Mixtral/Qwen/DeepSeek MoE fields
    and hybrid ``layer_types`` (sliding-window and linear-attention layers).
    Raises :class:`SpecError` naming the first missing or invalid key.
    """
    hidden = int(_req(cfg, "hidden_size", source))
    heads = int(_req(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    mla = cfg.get("kv_lora_rank") is not None
    if mla:
        for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _req(cfg, key, source)
    total, active = _estimate_params(cfg, source, hidden, heads, kv_heads, head_dim, mla)
    layers = int(_req(cfg, "num_hidden_layers", source))
    kinds = list(cfg.get("layer_types") or [])
    if kinds and len(kinds) != layers:
        raise SpecError("layer_types", f"has {len(kinds)} entries for {layers} layers in {source}")
    window = int(cfg.get("sliding_window") or 0)
    if kinds:
        sliding = sum(kind in _SLIDING for kind in kinds)
        stateful = sum(kind in _STATEFUL for kind in kinds)
    else:
        sliding = layers if window and cfg.get("use_sliding_window", True) else 0
        stateful = 0
    state_bytes = 0
    if stateful:
        value_heads, key_dim, value_dim = (
            cfg.get(k) for k in ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        )
        if not (value_heads and key_dim and value_dim):
            raise SpecError(
                "state_bytes_per_layer",
                f"{source} gives no recurrent-state size for its linear layers; use a YAML model spec",
            )
        state_bytes = int(value_heads) * int(key_dim) * int(value_dim) * 2
    quant = cfg.get("quantization_config") or {}
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    weight_bytes = 1.0 if quant.get("quant_method") == "fp8" else _DTYPE_BYTES.get(dtype, 2.0)
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        params_total=total,
        params_active=active,
        weight_bytes_per_param=weight_bytes,
        attention="mla" if mla else "gqa",
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0) if mla else 0,
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0) if mla else 0,
        v_head_dim=int(cfg.get("v_head_dim") or 0) if mla else 0,
        sliding_window_layers=sliding,
        sliding_window=window if sliding else 0,
        state_layers=stateful,
        state_bytes_per_layer=state_bytes,
    )


_T = TypeVar("_T", bound=TypedConfig)


def _from_fields(cls: type[_T], data: Mapping[str, Any], source: str) -> _T:
    """Convert a mapping to a spec (:func:`kvpilot.policies.typed_config.convert`: types,
    unknown and missing keys, then the spec's own checks); the error names the key
    and ``source``."""
    try:
        return convert(data, cls)
    except SpecError as exc:
        raise SpecError(exc.key, f"{exc.problem} in {source}") from None


def parse_document(text: str, source: str) -> dict[str, Any]:
    """Parse JSON or YAML text into a mapping; errors name the source."""
    try:
        data = json.loads(text) if source.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError("<document>", f"cannot parse {source}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError("<document>", f"{source} must hold a mapping, got {type(data).__name__}")
    return data


def model_from_mapping(data: Mapping[str, Any], source: str) -> ModelSpec:
    """A model from a parsed document: an HF ``config.json`` (recognised by
    ``num_hidden_layers``, ``model_type`` or ``architectures``) or kvpilot's own
    schema (the :class:`ModelSpec` fields; ``params_active`` defaults to
    ``params_total``)."""
    if {"num_hidden_layers", "model_type", "architectures"} & data.keys():
        name = str(data.get("_name_or_path") or data.get("model_type") or source)
        return model_from_hf_config(data, name, source)
    fields = dict(data)
    fields.setdefault("name", source)
    if "params_total" in fields:
        fields.setdefault("params_active", fields["params_total"])
    return _from_fields(ModelSpec, fields, source)


def hardware_from_mapping(data: Mapping[str, Any], source: str) -> HardwareSpec:
    """A hardware spec from a parsed document: the :class:`HardwareSpec` fields,
    or ``preset: <name>`` plus fields that override the preset's."""
    fields = dict(data)
    base = fields.pop("preset", None)
    if base is not None:
        return _override(hardware_preset(str(base)), fields, source)
    fields.setdefault("name", source)
    return _from_fields(HardwareSpec, fields, source)


def link_from_mapping(data: Mapping[str, Any], source: str) -> LinkSpec:
    """A link from a parsed document: the :class:`LinkSpec` fields, or
    ``preset: <name>`` plus overrides."""
    fields = dict(data)
    base = fields.pop("preset", None)
    if base is not None:
        return _override(link_preset(str(base)), fields, source)
    fields.setdefault("name", source)
    return _from_fields(LinkSpec, fields, source)


def _override(spec: _T, fields: Mapping[str, Any], source: str) -> _T:
    """``spec`` with ``fields`` replaced, converted and checked as :func:`_from_fields` does."""
    return _from_fields(type(spec), {**msgspec.structs.asdict(spec), **fields}, source)


def model_preset(name: str) -> ModelSpec:
    """A preset model by name; ``SpecError('model', ...)`` lists the known names."""
    if name not in HF_CONFIGS:
        raise SpecError("model", f"unknown preset {name!r} (known: {', '.join(sorted(HF_CONFIGS))})")
    return model_from_hf_config(HF_CONFIGS[name], name, f"preset {name}")


_HW_NAME = re.compile(r"^(?P<gpu>[a-z0-9]+?)(?:x(?P<count>\d+))?$")


def hardware_preset(name: str) -> HardwareSpec:
    """``<gpu>`` or ``<gpu>x<count>``, e.g. ``b200x2`` (the article's instance);
    ``cpux<cores>`` for a CPU engine."""
    match = _HW_NAME.match(name)
    if not match or match["gpu"] not in GPUS:
        raise SpecError(
            "hardware", f"unknown preset {name!r} (known GPUs: {', '.join(sorted(GPUS))}; add x<count>, e.g. b200x2)"
        )
    flops, bandwidth, hbm = GPUS[match["gpu"]]
    return HardwareSpec(name, flops, bandwidth, hbm, gpus=int(match["count"] or 1))


def kv_format_preset(name: str) -> KVFormat:
    if name not in KV_FORMATS:
        raise SpecError("kv_format", f"unknown format {name!r} (known: {', '.join(KV_FORMATS)})")
    return KV_FORMATS[name]


def link_preset(name: str) -> LinkSpec:
    if name not in LINKS:
        raise SpecError("link", f"unknown preset {name!r} (known: {', '.join(LINKS)})")
    return LINKS[name]
