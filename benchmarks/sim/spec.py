"""A simulated engine's spec (:class:`EngineSpec`, Dynamo 1.6.1 mocker's defaults for the vLLM
backend) and its timing model: the polynomial prefill and decode times
(:mod:`benchmarks.sim.engine` gives the formulas), a block's restore and recompute. Pure."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_MS = (4.209989e-07, 1.518344e-02, 1.650142e01)
"""The polynomial prefill model's coefficients (T^2, T, 1), milliseconds."""
DECODE_MS = (-25.74, 54.01, 5.74)
"""The polynomial decode model's coefficients (p^2, p, 1), milliseconds, floored at 1 ms."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Dynamo 1.6.1 mocker defaults for the vLLM backend."""

    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    speedup_ratio: float = 1.0
    cache_generated_blocks: bool = False
    """Keep a finished request's full generated blocks cached, as the mocker does (they
    compete for eviction with prompt blocks); off: they are freed at once, as before. Only a
    cache that evicts tells the two apart (module doc)."""
    num_host_blocks: int = 0
    """The mocker's ``native_host_offload.num_host_blocks`` (0: no host tier, as by default)."""
    kv_bytes_per_token: int = 0
    """The mocker's ``kv_cache_bytes_per_token``: a host block moves ``block_size`` times this."""
    h2d_gb_s: float = 32.0
    """``native_host_offload.h2d_bandwidth_gbps`` (the mocker's default), decimal GB/s."""
    d2h_gb_s: float = 32.0
    """``native_host_offload.d2h_bandwidth_gbps`` (the mocker's default), decimal GB/s."""

    def __post_init__(self) -> None:
        if self.num_host_blocks and self.kv_bytes_per_token <= 0:
            raise ValueError("a host tier needs kv_bytes_per_token (the bytes a block moves)")
        if self.h2d_gb_s < 0 or self.d2h_gb_s < 0:
            raise ValueError("host bandwidths must not be negative")

    def host_engine_args(self) -> dict[str, object]:
        """The mocker's engine arguments for this host tier (none without one)."""
        if not self.num_host_blocks:
            return {}
        return {
            "kv_cache_bytes_per_token": self.kv_bytes_per_token,
            "native_host_offload": {
                "num_host_blocks": self.num_host_blocks,
                "h2d_bandwidth_gbps": self.h2d_gb_s,
                "d2h_bandwidth_gbps": self.d2h_gb_s,
            },
        }


def restore_ms_per_block(spec: EngineSpec) -> float:
    """The H2D time of one block of ``spec``'s host tier (its first-byte latency 0, as the mocker's)."""
    return spec.block_size * spec.kv_bytes_per_token / (spec.h2d_gb_s * 1e6) if spec.h2d_gb_s else 0.0


def recompute_ms_per_block(spec: EngineSpec) -> float:
    """One more block's share of a prefill: the polynomial's linear term (its fixed cost is
    paid by any prefill, its quadratic term is small at a block)."""
    return PREFILL_MS[1] * spec.block_size / spec.speedup_ratio


def prefill_ms(tokens: int) -> float:
    if tokens <= 0:
        return 0.0
    a, b, c = PREFILL_MS
    return max(0.0, a * tokens * tokens + b * tokens + c)


def decode_ms(utilization: float) -> float:
    a, b, c = DECODE_MS
    p = min(1.0, utilization)
    return max(1.0, a * p * p + b * p + c)
