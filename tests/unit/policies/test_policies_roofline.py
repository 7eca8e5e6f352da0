"""Roofline mechanics beyond the article's figures: windows, cascade, capacity, edges."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from kvpilot.policies.presets import hardware_preset, kv_format_preset, model_preset
from kvpilot.policies.roofline import (
    _pairs_window,
    attention_flops,
    decode_step,
    kv_budget_bytes,
    kv_bytes,
    kv_replication,
    prefill,
    sessions_per_instance,
)

M = model_preset("llama-70b")
BF16 = kv_format_preset("bf16")
HW = hardware_preset("b200x2")


@pytest.mark.parametrize(
    ("new", "context", "window"),
    [
        (1, 0, 4),
        (10, 0, 4),
        (3, 2, 4),
        (5, 100, 4),
        (7, 1, 8),
        (0, 5, 4),
        (20, 3, 1),
        (16, 0, 16),
    ],
)
def test_sliding_window_pairs_match_brute_force(new: int, context: int, window: int) -> None:
    brute = sum(min(p + 1, window) for p in range(context, context + new))
    assert _pairs_window(new, context, window) == brute


def test_sliding_window_layers_cap_attention_and_kv() -> None:
    hybrid = msgspec.structs.replace(M, sliding_window_layers=40, sliding_window=4096)
    assert attention_flops(hybrid, 1000, 60_000) < attention_flops(M, 1000, 60_000)
    assert kv_bytes(hybrid, BF16, 60_000) == pytest.approx(kv_bytes(M, BF16, 60_000) / 2 + kv_bytes(M, BF16, 4096) / 2)
    assert attention_flops(hybrid, 100, 0) == attention_flops(M, 100, 0)  # all within the window


@pytest.mark.parametrize(
    ("contexts", "shared", "saved_prefixes"),
    [
        ([48_000] * 8, 32_000, 7),
        ([40_000, 33_000], 32_000, 1),
        ([32_000], 32_000, 0),
    ],
)
def test_cascade_reads_the_shared_prefix_once(contexts: list[int], shared: int, saved_prefixes: int) -> None:
    paged = decode_step(M, BF16, HW, contexts)
    cascade = decode_step(M, BF16, HW, contexts, shared, cascade=True)
    assert paged.bytes - cascade.bytes == pytest.approx(saved_prefixes * kv_bytes(M, BF16, shared))
    assert cascade.seconds <= paged.seconds


def test_cascade_needs_every_context_to_cover_the_prefix() -> None:
    with pytest.raises(ValueError, match="shared_prefix"):
        decode_step(M, BF16, HW, [1000], 32_000, cascade=True)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: prefill(M, BF16, HW, 0, 1000), 0.0),
        (lambda: decode_step(M, BF16, HW, []).seconds, 0.0),
        (lambda: kv_bytes(M, BF16, 0), 0.0),
    ],
)
def test_empty_inputs_cost_nothing(call: Callable[[], object], expected: float) -> None:
    result = call()
    assert (result.seconds if hasattr(result, "seconds") else result) == expected


def test_prefill_bound_switches_with_size() -> None:
    assert prefill(M, BF16, HW, 16).bound == "memory"
    assert prefill(M, BF16, HW, 4096).bound == "compute"


@pytest.mark.parametrize(
    ("model", "gpus", "parallel", "replication"),
    [
        ("llama-70b", 2, "tp", 1.0),
        ("llama-70b", 16, "tp", 2.0),
        ("deepseek-v3", 8, "tp", 8.0),
        ("deepseek-v3", 8, "dp", 1.0),
        ("deepseek-v3", 1, "tp", 1.0),
    ],
)
def test_kv_replication(model: str, gpus: int, parallel: str, replication: float) -> None:
    hw = msgspec.structs.replace(hardware_preset("b200"), gpus=gpus, attention_parallel=parallel)
    assert kv_replication(model_preset(model), hw) == replication


def test_weights_that_do_not_fit_are_an_error() -> None:
    with pytest.raises(ValueError, match="leave no KV room"):
        kv_budget_bytes(M, hardware_preset("h100"))


def test_dedup_needs_a_tail_beyond_the_prefix() -> None:
    with pytest.raises(ValueError, match="shared_prefix"):
        sessions_per_instance(M, BF16, HW, 32_000, 32_000, dedup=True)
