"""What a prompt block held in a slower tier is worth to the router, from what restoring it
costs against recomputing it (the reference article's section 5.3: restoring from host
memory beats recomputing by 25x or more on an H100; a slow link can make it worth nothing).
Pure."""

from __future__ import annotations

from kvpilot.policies.roofline import kv_bytes, prefill
from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec


def restore_credit(restore_s_per_block: float, recompute_s_per_block: float) -> float:
    """The share of a block's prefill that restoring it saves: ``1 - restore / recompute``,
    at least 0 (a tier slower than recomputing earns nothing), 1 for a free restore. This is
    the router's credit per block of the tier (``cost.host_cache_hit_weight`` for the host
    tier), where a block held in HBM earns 1.

    >>> restore_credit(0.25e-3, 1e-3)
    0.75
    >>> restore_credit(2e-3, 1e-3)
    0.0
    """
    if recompute_s_per_block <= 0 or restore_s_per_block < 0:
        raise ValueError("a block's recompute time must be positive and its restore time not negative")
    return max(0.0, 1.0 - restore_s_per_block / recompute_s_per_block)


PREFILL_CHUNK_TOKENS = 8192
"""The prefill a recomputed block is priced in: one chunk of vLLM's default
``max_num_batched_tokens`` (compute-bound on every preset; one block alone would be priced
as a whole weight pass)."""


def host_block_credit(model: ModelSpec, fmt: KVFormat, hw: HardwareSpec, link: LinkSpec, block_size: int) -> float:
    """:func:`restore_credit` of one ``block_size``-token block of ``model``'s KV: its wire
    time over ``link`` (a session's run of blocks pays the link's setup once) against its
    share of a :data:`PREFILL_CHUNK_TOKENS`-token prefill on ``hw`` (the roofline)."""
    restore_s = link.wire_seconds(kv_bytes(model, fmt, block_size))
    recompute_s = prefill(model, fmt, hw, PREFILL_CHUNK_TOKENS).seconds * block_size / PREFILL_CHUNK_TOKENS
    return restore_credit(restore_s, recompute_s)
