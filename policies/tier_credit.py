"""What a prompt block held in a slower tier is worth to the router, from what restoring it
costs against recomputing it (the reference article's section 5.3: restoring from host
memory beats recomputing by 25x or more on an H100; a slow link can make it worth nothing).
Pure."""

from __future__ import annotations


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
