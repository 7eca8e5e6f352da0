"""Specs, presets and parsers: derived shapes, and errors that name the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.policies.presets import (
    HF_CONFIGS,
    hardware_from_mapping,
    hardware_preset,
    kv_format_preset,
    link_from_mapping,
    link_preset,
    model_from_hf_config,
    model_from_mapping,
    model_preset,
    parse_document,
)
from kvpilot.policies.roofline import kv_bytes, kv_bytes_per_token
from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec, SpecError
from kvpilot.policies.typed_config import convert

LLAMA_70B = HF_CONFIGS["llama-70b"]


@pytest.mark.parametrize(
    ("name", "total", "active", "attention"),
    [
        ("llama-70b", 70.6e9, 70.6e9, "gqa"),
        ("llama-8b", 8.03e9, 8.03e9, "gqa"),
        ("deepseek-v3", 671e9, 37e9, "mla"),
    ],
)
def test_model_presets_derive_params_from_dims(name: str, total: float, active: float, attention: str) -> None:
    model = model_preset(name)
    assert model.params_total == pytest.approx(total, rel=0.01)
    assert model.params_active == pytest.approx(active, rel=0.02)
    assert model.attention == attention


def test_deepseek_preset_has_fp8_weights_and_mla_latent() -> None:
    model = model_preset("deepseek-v3")
    assert model.weight_bytes_per_param == 1.0
    assert model.kv_values_per_token_layer == 512 + 64


@pytest.mark.parametrize(
    ("name", "gpus", "flops"), [("b200x2", 2, 2.25e15), ("h100", 1, 989e12), ("h200x8", 8, 989e12)]
)
def test_hardware_presets(name: str, gpus: int, flops: float) -> None:
    hw = hardware_preset(name)
    assert (hw.gpus, hw.peak_flops) == (gpus, flops)


@pytest.mark.parametrize(("fmt", "bytes_per_value"), [("bf16", 2.0), ("fp8", 1.0), ("nvfp4", 4.5 / 8)])
def test_kv_formats(fmt: str, bytes_per_value: float) -> None:
    assert kv_format_preset(fmt).bytes_per_value == bytes_per_value


def test_hf_config_hybrid_layer_types() -> None:
    cfg = {
        **LLAMA_70B,
        "num_hidden_layers": 4,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }
    model = model_from_hf_config(cfg, "hybrid")
    assert (model.sliding_window_layers, model.full_attention_layers, model.sliding_window) == (2, 2, 1024)
    bf16 = kv_format_preset("bf16")
    per_layer = kv_bytes_per_token(model, bf16) / 4
    assert kv_bytes(model, bf16, 4096) == pytest.approx(per_layer * (2 * 4096 + 2 * 1024))


def test_hf_config_linear_attention_state() -> None:
    cfg = {
        **LLAMA_70B,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    }
    model = model_from_hf_config(cfg, "linear")
    assert (model.state_layers, model.state_bytes_per_layer) == (3, 32 * 128 * 128 * 2)
    bf16 = kv_format_preset("bf16")
    assert kv_bytes(model, bf16, 10) == pytest.approx(10 * kv_bytes_per_token(model, bf16) + 3 * 32 * 128 * 128 * 2)


def test_hf_config_mixtral_moe() -> None:
    cfg = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    model = model_from_mapping(cfg, "mixtral/config.json")
    assert model.params_total == pytest.approx(46.7e9, rel=0.01)
    assert model.params_active == pytest.approx(12.9e9, rel=0.01)


def _drop(key: str) -> dict[str, Any]:
    return {k: v for k, v in LLAMA_70B.items() if k != key}


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (_drop("num_hidden_layers"), "num_hidden_layers"),
        (_drop("hidden_size"), "hidden_size"),
        (_drop("vocab_size"), "vocab_size"),
        (_drop("intermediate_size"), "intermediate_size"),
        ({**LLAMA_70B, "num_key_value_heads": 7}, "num_kv_heads"),
        ({**LLAMA_70B, "kv_lora_rank": 512}, "qk_rope_head_dim"),
        ({**LLAMA_70B, "layer_types": ["full_attention"]}, "layer_types"),
        ({**LLAMA_70B, "layer_types": ["linear_attention"] * 80}, "state_bytes_per_layer"),
        ({**LLAMA_70B, "num_local_experts": 8}, "num_experts_per_tok"),
    ],
)
def test_bad_hf_configs_name_the_field(cfg: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        model_from_mapping(cfg, "config.json")
    assert err.value.key == field
    assert field in str(err.value)


GOOD_MODEL = {
    "name": "m",
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "params_total": 1e6,
}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"params_active": 2e6}, "params_active"),
        ({"attention": "mha"}, "attention"),
        ({"attention": "mla"}, "kv_lora_rank"),
        ({"sliding_window_layers": 1}, "sliding_window"),
        ({"state_layers": 1}, "state_bytes_per_layer"),
        (
            {"sliding_window_layers": 2, "sliding_window": 8, "state_layers": 1, "state_bytes_per_layer": 8},
            "num_layers",
        ),
        ({"colour": "blue"}, "colour"),
        ({"num_layers": "32"}, "num_layers"),
        ({"num_layers": 32.5}, "num_layers"),
    ],
)
def test_bad_model_documents_name_the_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        model_from_mapping({**GOOD_MODEL, **override}, "model.yaml")
    assert err.value.key == field


def test_missing_required_model_field() -> None:
    doc = {k: v for k, v in GOOD_MODEL.items() if k != "head_dim"}
    with pytest.raises(SpecError, match=r"head_dim: missing required key in model\.yaml"):
        model_from_mapping(doc, "model.yaml")


def test_model_document_yaml_and_json_agree() -> None:
    yaml_text = "\n".join(f"{k}: {v}" for k, v in GOOD_MODEL.items())
    from_yaml = model_from_mapping(parse_document(yaml_text, "m.yaml"), "m.yaml")
    from_json = model_from_mapping(parse_document(json.dumps(GOOD_MODEL), "m.json"), "m.json")
    assert from_yaml == from_json
    assert from_yaml.params_active == from_yaml.params_total


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"preset": "b200x2", "compute_efficiency": 1.5}, "compute_efficiency"),
        ({"preset": "b200x2", "flops": 1}, "flops"),
        ({"preset": "a100"}, "hardware"),
        ({"name": "x", "peak_flops": 1e15, "hbm_bandwidth": 1e12}, "hbm_bytes"),
        ({"name": "x", "peak_flops": 1e15, "hbm_bandwidth": 1e12, "hbm_bytes": 8e10, "gpus": 0}, "gpus"),
        (
            {"name": "x", "peak_flops": 1e15, "hbm_bandwidth": 1e12, "hbm_bytes": 8e10, "attention_parallel": "ep"},
            "attention_parallel",
        ),
    ],
)
def test_bad_hardware_documents_name_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        hardware_from_mapping(doc, "hw.yaml")
    assert err.value.key == field


def test_hardware_override_keeps_the_rest() -> None:
    hw = hardware_from_mapping({"preset": "b200x2", "compute_efficiency": 0.5}, "hw.yaml")
    assert hw == HardwareSpec("b200x2", 2.25e15, 8e12, 192e9, gpus=2, compute_efficiency=0.5)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"preset": "rdma", "efficiency": 0}, "efficiency"),
        ({"name": "l", "kind": "carrier-pigeon", "lanes": 1, "lane_gbps": 1}, "kind"),
        ({"name": "l", "kind": "tcp", "lanes": 1}, "lane_gbps"),
        ({"preset": "infiniband"}, "link"),
    ],
)
def test_bad_link_documents_name_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        link_from_mapping(doc, "link.yaml")
    assert err.value.key == field


FULL_MODEL = {**GOOD_MODEL, "params_active": GOOD_MODEL["params_total"]}


@pytest.mark.parametrize(
    ("cls", "doc", "key", "problem"),
    [
        (ModelSpec, {**FULL_MODEL, "colour": "blue"}, "colour", "unknown key (known: name, num_layers, hidden_size,"),
        (ModelSpec, {**FULL_MODEL, "num_layers": "32"}, "num_layers", "Expected `int`, got `str`"),
        (ModelSpec, {**FULL_MODEL, "attention": "mha"}, "attention", "must be one of 'gqa', 'mla', got 'mha'"),
        (ModelSpec, {**FULL_MODEL, "head_dim": 0}, "head_dim", "must be a finite number > 0, got 0"),
        (
            LinkSpec,
            {"name": "l", "kind": "carrier-pigeon", "lanes": 1, "lane_gbps": 1},
            "kind",
            "must be one of 'rdma', 'tcp', 'nvlink', 'mnnvl', 'pcie', 'c2c', 'nvme', got 'carrier-pigeon'",
        ),
        (
            HardwareSpec,
            {"name": "x", "peak_flops": 1e15, "hbm_bandwidth": 1e12, "hbm_bytes": 8e10, "attention_parallel": "ep"},
            "attention_parallel",
            "must be one of 'tp', 'dp', got 'ep'",
        ),
        (KVFormat, {"name": "k", "value_bits": 4, "scale_block": "16"}, "scale_block", "Expected `int`, got `str`"),
    ],
)
def test_convert_names_the_key_of_a_spec_document(cls: type, doc: dict[str, Any], key: str, problem: str) -> None:
    """kvpilot.policies.typed_config.convert on the spec documents (flat structs: their keys are
    the dotted keys), each error a SpecError."""
    with pytest.raises(SpecError) as err:
        convert(doc, cls)
    assert err.value.key == key
    assert problem in err.value.problem


@pytest.mark.parametrize(("text", "source"), [("[1, 2]", "x.yaml"), ("{not json", "x.json"), ("a: [", "x.yaml")])
def test_unparseable_documents(text: str, source: str) -> None:
    with pytest.raises(SpecError, match=source):
        parse_document(text, source)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: KVFormat("x", 4, scale_bits=8), "scale_block"),
        (lambda: KVFormat("", 4), "name"),
        (lambda: LinkSpec("l", "rdma", 2, 400, setup_s=-1), "setup_s"),
        (lambda: ModelSpec("m", 2, 64, 4, 2, 16, float("nan"), 1.0), "params_total"),
        (lambda: kv_format_preset("int3"), "kv_format"),
        (lambda: link_preset("smoke-signal"), "link"),
    ],
)
def test_direct_construction_errors(make: Callable[[], object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        make()
    assert err.value.key == field
