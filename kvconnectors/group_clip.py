"""Which of a peer's blocks each KV cache group attaches for a verified prefix. Pure.

A hybrid model (Gemma 2/3, gpt-oss, Mistral-style interleaving) has one KV cache
group per attention kind, and the peer's ``remote_block_ids`` hold one list per
group, in the order of ``KVCacheConfig.transfer_groups``. vLLM 0.32's NIXL
connector fills and pairs those lists differently per kind:

- **full attention**: the peer sends every block, position 0 first
  (``NixlBaseConnectorScheduler.get_exchange_clipped_blocks`` leaves the list whole).
- **sliding window** (window ``W`` tokens, block size ``B``): the peer sends only
  the tail, its last ``cdiv(W, B) + 1`` positions, because vLLM's
  ``SlidingWindowManager.remove_skipped_blocks`` frees the blocks that fell out of
  the window (they become the null block). The receiver allocates real blocks
  only from ``max(local hit, skipped(T))`` to its attach end ``T`` (the blocks
  before are null padding, ``add_local_computed_blocks``), keeps the last
  ``cdiv(W, B) + 1`` of them, and its worker pairs them with the *end* of the
  peer's list (``NixlBaseConnectorWorker._apply_prefix_caching``), position
  unchecked.

So attaching a verified prefix of ``k`` blocks that stops short of the peer's end
(the other blocks mismatched, or the pull policy stopped there) needs, per group,
the peer's list cut at position ``k``: the first ``k`` entries of a full-attention
list, and for a sliding-window list the entries whose positions (counted back
from the peer's end, which a full-attention list's length gives) lie before
``k``. That is only possible where the peer still holds every position the
receiver will pull: those at or past the start of the peer's list, and at or past
the peer's own window start (earlier ones may be null blocks). A verified prefix
that ends well before the peer's end has usually lost its window on the peer: it
cannot be attached, and the request recomputes it (:func:`cut_to_prefix` says why).

Kinds whose lists are not one block per position from the start (Mamba state,
chunked local attention, R-SWA's middle gap, sink tokens, anything unknown) are
never cut short: a request whose peer offer verified only in part recomputes.
An offer that verified whole is not cut at all: the inner connector's own plan,
which clips every group itself, stands.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class GroupKind(enum.Enum):
    FULL = "full"
    """Every position kept, from 0: the peer's list is positional."""
    SLIDING = "sliding"
    """Only the in-window tail is real; the peer sends its last ``cdiv(W, B) + 1``."""
    OTHER = "other"
    """Not positional from 0 (state, chunks, gaps, unknown): no partial attach."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLayout:
    """One transfer group as the clip sees it."""

    index: int
    """Its index in ``KVCacheConfig.transfer_groups`` (and in ``remote_block_ids``)."""
    spec_name: str
    """vLLM's spec type, for messages (``SlidingWindowSpec``)."""
    kind: GroupKind
    sliding_window: int = 0
    """Tokens in the window, for :attr:`GroupKind.SLIDING`."""
    extra_retained_tokens: int = 0
    """Tokens kept below the window (multi-module MTP), for :attr:`GroupKind.SLIDING`."""

    def __post_init__(self) -> None:
        if (self.kind is GroupKind.SLIDING) != (self.sliding_window > 0):
            raise ValueError(f"{self.describe()}: a window is given for, and only for, a sliding-window group")

    def describe(self) -> str:
        window = f", window {self.sliding_window}" if self.kind is GroupKind.SLIDING else ""
        return f"KV cache group {self.index} ({self.spec_name}{window})"

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """Leading blocks out of the window once ``num_tokens`` are computed: vLLM's
        ``SlidingWindowManager.get_num_skipped_tokens`` in whole blocks."""
        skipped = num_tokens - self.sliding_window + 1 - self.extra_retained_tokens
        return max(0, skipped) // block_size

    def blocks_per_window(self, block_size: int) -> int:
        """Blocks of this group that vLLM's NIXL scheduler exchanges (its ``blocks_per_sw``)."""
        return -(-self.sliding_window // block_size) + 1


ONE_FULL_GROUP = (GroupLayout(index=0, spec_name="FullAttentionSpec", kind=GroupKind.FULL),)
"""A model with one full-attention group (the common, non-hybrid case)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a verified prefix cannot be attached group by group."""

    why: str


def cut_to_prefix(
    groups: Sequence[GroupLayout],
    remote_block_ids: Sequence[Sequence[int]],
    *,
    attach_blocks: int,
    local_hit: int,
    peer_tokens: int,
    block_size: int,
) -> tuple[tuple[int, ...], ...] | Refused:
    """The peer's block lists cut so that vLLM's pull attaches exactly positions
    ``[local_hit, attach_blocks)`` of every group (of a sliding-window group, the
    in-window part of them), or why that is not possible.

    ``peer_tokens``: the tokens whose KV the peer computed (its offer's length).
    With nothing to pull (``attach_blocks <= local_hit``) the lists are cut the same
    way but nothing is checked: the inner connector only tells the peer to free its
    blocks. Empty input gives empty output. Raises nothing.
    """
    pulls = attach_blocks > local_hit
    if len(groups) != len(remote_block_ids):
        if pulls:
            return Refused(f"the peer sent {len(remote_block_ids)} block lists for {len(groups)} KV cache groups")
        return tuple(() for _ in remote_block_ids)
    peer_end = _peer_end(groups, remote_block_ids)
    cut: list[tuple[int, ...]] = []
    for group, ids in zip(groups, remote_block_ids, strict=True):
        if group.kind is GroupKind.FULL:
            if pulls and len(ids) < attach_blocks:
                return Refused(f"{group.describe()}: the peer sent {len(ids)} blocks, {attach_blocks} are needed")
            cut.append(tuple(ids[:attach_blocks]))
        elif group.kind is GroupKind.SLIDING and peer_end is not None:
            first = peer_end - len(ids)  # the position of ids[0]
            if pulls:
                why = _window_gone(group, first, attach_blocks, local_hit, peer_tokens, block_size)
                if why is not None:
                    return Refused(why)
            cut.append(tuple(ids[: max(0, attach_blocks - first)]))
        elif pulls:
            why = (
                "its blocks are not one per position"
                if group.kind is GroupKind.OTHER
                else "no full-attention group places its blocks"
            )
            return Refused(f"{group.describe()}: a verified prefix shorter than the offer cannot be attached ({why})")
        else:
            cut.append(())
    return tuple(cut)


def _peer_end(groups: Sequence[GroupLayout], remote_block_ids: Sequence[Sequence[int]]) -> int | None:
    """The peer's block count, one past its last position: the length of its
    full-attention lists (all equal, as every group allocates the same positions), or
    ``None`` without one."""
    ends = {len(ids) for g, ids in zip(groups, remote_block_ids, strict=True) if g.kind is GroupKind.FULL}
    return ends.pop() if len(ends) == 1 else None


def _window_gone(
    group: GroupLayout, first: int, attach_blocks: int, local_hit: int, peer_tokens: int, block_size: int
) -> str | None:
    """Why the peer no longer holds a position this group pulls for a prefix of
    ``attach_blocks`` blocks, or ``None`` if it holds them all."""
    pulled_from = max(
        local_hit,
        group.skipped_blocks(attach_blocks * block_size, block_size),
        attach_blocks - group.blocks_per_window(block_size),
    )
    held_from = max(first, group.skipped_blocks(peer_tokens, block_size))
    if pulled_from >= held_from:
        return None
    return (
        f"{group.describe()}: a prefix of {attach_blocks} blocks needs the peer's blocks "
        f"{pulled_from}..{attach_blocks - 1}, and it holds only {held_from} on (the rest fell out of its window)"
    )
