"""The roofline cost model: KV bytes, FLOPs, and the time of a pass.

A pass takes ``max(FLOPs / effective FLOP/s, bytes / effective bandwidth)``
(article section 2). FLOPs are ``2 * params_active`` per token for the linear
layers plus attention scores and values over every (query, key) pair the pass
computes; bytes are the weights plus the KV the pass reads and writes. All
functions are pure and take token counts; a "context" is the number of tokens
already cached before the new ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

from kvpilot.policies.specs import HardwareSpec, KVFormat, ModelSpec

Bound = Literal["compute", "memory", "idle"]


class PassCost(NamedTuple):
    """One forward pass: its work, its traffic, its time and what bounds it."""

    flops: float
    attention_flops: float
    bytes: float
    seconds: float
    bound: Bound


def kv_bytes_per_token(model: ModelSpec, fmt: KVFormat) -> float:
    """KV bytes one more token adds, while it is within every sliding window."""
    return model.attention_layers * model.kv_values_per_token_layer * fmt.bytes_per_value


def kv_bytes(model: ModelSpec, fmt: KVFormat, tokens: int) -> float:
    """KV a sequence of ``tokens`` holds: full-attention layers grow with it,
    sliding-window layers stop at the window, state layers are a fixed size.
    A sequence of 0 tokens holds nothing."""
    if tokens <= 0:
        return 0.0
    per_layer = model.kv_values_per_token_layer * fmt.bytes_per_value
    full = model.full_attention_layers * tokens * per_layer
    sliding = model.sliding_window_layers * min(tokens, model.sliding_window) * per_layer
    return full + sliding + model.state_layers * model.state_bytes_per_layer


def _pairs_full(new: int, context: int) -> float:
    """(query, key) pairs when ``new`` tokens attend causally after ``context``."""
    return new * context + new * (new + 1) / 2


def _pairs_window(new: int, context: int, window: int) -> float:
    """Pairs when the token at position p sees ``min(p + 1, window)`` keys."""
    start, end = context, context + new  # positions [start, end)
    grow_end = min(end, max(start, window - 1))  # positions p with p + 1 < window
    growing = sum_range(start + 1, grow_end + 1) if grow_end > start else 0
    return growing + (end - max(start, grow_end)) * window


def sum_range(lo: int, hi: int) -> float:
    """Sum of integers in [lo, hi)."""
    return (lo + hi - 1) * (hi - lo) / 2 if hi > lo else 0.0


def attention_flops(model: ModelSpec, new: int, context: int) -> float:
    """Score and value FLOPs for ``new`` tokens prefilled after ``context``
    (MLA expanded, as prefill runs it)."""
    per_pair = 2 * model.num_attention_heads * (model.prefill_qk_dim + model.prefill_v_dim)
    pairs = model.full_attention_layers * _pairs_full(new, context)
    if model.sliding_window_layers:
        pairs += model.sliding_window_layers * _pairs_window(new, context, model.sliding_window)
    return per_pair * pairs


def linear_flops(model: ModelSpec, tokens: float) -> float:
    return 2.0 * model.params_active * tokens


def prefill_flops(model: ModelSpec, new: int, context: int) -> float:
    return linear_flops(model, new) + attention_flops(model, new, context)


def pass_seconds(hw: HardwareSpec, flops: float, nbytes: float) -> tuple[float, Bound]:
    """Roofline time of one pass; a pass with no work takes 0 s."""
    if flops <= 0 and nbytes <= 0:
        return 0.0, "idle"
    compute = flops / hw.effective_flops
    memory = nbytes / hw.effective_bandwidth
    return (compute, "compute") if compute >= memory else (memory, "memory")


def weight_stream_seconds(model: ModelSpec, hw: HardwareSpec) -> float:
    """The floor of any pass: streaming every weight once."""
    return model.weight_bytes / hw.effective_bandwidth


def prefill(model: ModelSpec, fmt: KVFormat, hw: HardwareSpec, new: int, context: int = 0) -> PassCost:
    """Prefill ``new`` tokens after ``context`` cached ones, in one pass:
    reads the weights and the context's KV, writes the new tokens' KV."""
    if new <= 0:
        return PassCost(0.0, 0.0, 0.0, 0.0, "idle")
    attn = attention_flops(model, new, context)
    flops = linear_flops(model, new) + attn
    nbytes = model.weight_bytes + kv_bytes(model, fmt, context + new)
    seconds, bound = pass_seconds(hw, flops, nbytes)
    return PassCost(flops, attn, nbytes, seconds, bound)


def decode_attention_flops_per_token(model: ModelSpec, context: int) -> float:
    """Attention FLOPs for one decoded token over ``context`` cached tokens.

    GQA: every query head scores and mixes ``head_dim`` values per key. MLA
    decode runs absorbed: every query head works on the latent (``kv_lora_rank
    + qk_rope_head_dim`` for scores, ``kv_lora_rank`` for values).
    """
    if model.attention == "mla":
        per_key = 2 * model.num_attention_heads * (2 * model.kv_lora_rank + model.qk_rope_head_dim)
    else:
        per_key = 2 * model.num_attention_heads * 2 * model.head_dim
    keys = model.full_attention_layers * context
    keys += model.sliding_window_layers * min(context, model.sliding_window)
    return per_key * keys


def decode_step(
    model: ModelSpec,
    fmt: KVFormat,
    hw: HardwareSpec,
    contexts: Sequence[int],
    shared_prefix: int = 0,
    cascade: bool = False,
) -> PassCost:
    """One decode step for a batch with the given context lengths.

    Reads all weights once and, per sequence, its whole KV. With ``cascade``, a
    shared-prefix kernel reads the first ``shared_prefix`` tokens' KV once for the
    batch (every context must then be at least that long). An empty batch is idle.
    """
    if not contexts:
        return PassCost(0.0, 0.0, 0.0, 0.0, "idle")
    if cascade and any(c < shared_prefix for c in contexts):
        raise ValueError("cascade: every context must cover shared_prefix")
    attn = sum(decode_attention_flops_per_token(model, c) for c in contexts)
    flops = linear_flops(model, len(contexts)) + attn
    kv_read = sum(kv_bytes(model, fmt, c) for c in contexts)
    if cascade and shared_prefix:
        prefix = kv_bytes(model, fmt, shared_prefix)
        kv_read -= (len(contexts) - 1) * prefix
    seconds, bound = pass_seconds(hw, flops, model.weight_bytes + kv_read)
    return PassCost(flops, attn, model.weight_bytes + kv_read, seconds, bound)


def kv_replication(model: ModelSpec, hw: HardwareSpec) -> float:
    """How many GPUs of an instance hold a copy of each KV value.

    Under TP, GQA shards by KV head (copies only when GPUs outnumber KV heads)
    and the MLA latent is replicated on every rank; under DP attention every
    sequence lives on one GPU."""
    if hw.attention_parallel == "dp" or hw.gpus == 1:
        return 1.0
    ways = 1 if model.attention == "mla" else model.num_kv_heads
    return hw.gpus / min(hw.gpus, ways)


def kv_budget_bytes(model: ModelSpec, hw: HardwareSpec) -> float:
    """Distinct KV bytes an instance can hold: ``memory_utilization`` of HBM,
    minus the weights, divided by the KV replication factor. Raises ValueError
    when the weights alone do not fit."""
    usable = hw.memory_utilization * hw.hbm_bytes * hw.gpus - model.weight_bytes
    if usable <= 0:
        raise ValueError(
            f"{model.name} weights ({model.weight_bytes / 1e9:.0f} GB) leave no KV room on "
            f"{hw.name} ({hw.memory_utilization:.0%} of {hw.hbm_bytes * hw.gpus / 1e9:.0f} GB)"
        )
    return usable / kv_replication(model, hw)


def sessions_per_instance(
    model: ModelSpec, fmt: KVFormat, hw: HardwareSpec, session_tokens: int, shared_prefix: int = 0, dedup: bool = False
) -> int:
    """Whole sessions of ``session_tokens`` whose KV fits in one instance.

    With ``dedup`` the first ``shared_prefix`` tokens are stored once for all
    sessions (block sharing) and each session adds only its own tail."""
    budget = kv_budget_bytes(model, hw)
    per_session = kv_bytes(model, fmt, session_tokens)
    if dedup and shared_prefix:
        prefix = kv_bytes(model, fmt, min(shared_prefix, session_tokens))
        budget -= prefix
        per_session -= prefix
    if per_session <= 0:
        raise ValueError("session_tokens must exceed the deduplicated shared_prefix")
    return max(0, math.floor(budget / per_session))
