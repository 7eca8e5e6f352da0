"""The article's derived figures that no policy decides on, computed from the cost model's
specs and pass costs so that its figures can be checked against the presets.

The cost model itself (:mod:`kvpilot.policies.roofline`) holds only what a decision uses.
"""

from __future__ import annotations

from kvpilot.policies.roofline import PassCost, decode_attention_flops_per_token, kv_bytes
from kvpilot.policies.specs import HardwareSpec, KVFormat, ModelSpec


def ridge_flops_per_byte(hw: HardwareSpec) -> float:
    """The roofline's ridge point: peak FLOP/s over HBM bandwidth (article section 2.1)."""
    return hw.peak_flops / hw.hbm_bandwidth


def attention_share(cost: PassCost) -> float:
    """The share of a pass's FLOPs spent in attention; 0 for a pass of no FLOPs."""
    return cost.attention_flops / cost.flops if cost.flops else 0.0


def decode_attention_intensity(model: ModelSpec, fmt: KVFormat, context: int = 4096) -> float:
    """FLOPs per byte of KV read by decode attention (the GQA group size in BF16; about
    the head count for absorbed MLA)."""
    kv = kv_bytes(model, fmt, context) - model.state_layers * model.state_bytes_per_layer
    return decode_attention_flops_per_token(model, context) / kv


def handoff_share_of_ttft(prefill_s: float, transfer_s: float) -> float:
    """The share of TTFT an unoverlapped handoff takes: transfer / (prefill + transfer);
    0 when both are 0."""
    total = prefill_s + transfer_s
    return transfer_s / total if total else 0.0
