"""The global block index: which worker holds which prefix, per tier. Pure.

Block naming (:mod:`kvpilot.routing.index.chain`; the package docstring says why): the
router names block ``i`` of a chain ``key_i = key_{i-1} XOR mix(i, tokens_i)``
inside *one namespace* ``(lora_name?, cache_salt?)``. Engine hashes are mapped
to these keys per worker (llm-d style), so the engines' hash algorithm and seed
do not matter. Keys live only in this process's memory; they are never sent
anywhere.

Namespaces are separate dictionaries, so a prompt is never credited with
another salt's (or LoRA's) blocks, whatever the hashes do.

Worked example (block size 2, one worker ``"w1"``)::

    >>> from kvpilot.routing.index.events import BlockStored, BlockRemoved
    >>> idx = BlockIndex(block_size=2)
    >>> idx.apply("w1", BlockStored([b"e0", b"e1"], None, [1, 2, 3, 4], 2, medium="GPU"))
    'applied'
    >>> idx.apply("w1", BlockStored([b"e2"], b"e1", [5, 6], 2, medium="GPU"))
    'applied'
    >>> idx.match(PromptChain([1, 2, 3, 4, 5, 6, 7], 2)).blocks
    {'w1': {'GPU': 3}}
    >>> idx.apply("w1", BlockRemoved([b"e1"], medium="GPU"))
    'applied'
    >>> idx.match(PromptChain([1, 2, 3, 4, 5, 6, 7], 2)).blocks   # first miss at block 1
    {'w1': {'GPU': 1}}
    >>> idx.match(PromptChain([1, 2, 3, 4], 2, cache_salt="s")).blocks  # another salt
    {}
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Iterable
from itertools import accumulate, compress, count, islice, repeat
from operator import and_, neg, not_, or_, truth
from typing import NamedTuple

import numpy as np

from kvpilot.routing.ids import DEFAULT_TIER, Tier, WorkerId
from kvpilot.routing.index.chain import (
    KEY_BITS,
    ROOT_KEY,
    BlockKey,
    MatchState,
    Namespace,
    PromptChain,
    block_hashes,
    chain_from_hashes,
    chain_keys,
    freeze,
    lane_sums,
    placed_hashes,
)
from kvpilot.routing.index.events import BlockRemoved, BlockStored, KVEvent
from kvpilot.routing.index.kvindex import EventApplier, Match

_NS_BITS = 20
_NS_MASK = (1 << _NS_BITS) - 1


_KEY_MASK = (1 << KEY_BITS) - 1


def _pack(key: BlockKey, position: int, nsid: int) -> int:
    """One int for a worker's name of a block: its key, its position in the chain and
    its namespace's id (``key | (position << 20 | nsid) << KEY_BITS``)."""
    return key | (position << _NS_BITS | nsid) << KEY_BITS


def _unpack(packed: int) -> tuple[BlockKey, int, int]:
    """:func:`_pack`'s key, position and namespace id."""
    meta = packed >> KEY_BITS
    return BlockKey(packed & _KEY_MASK), meta >> _NS_BITS, meta & _NS_MASK


class _Removal(NamedTuple):
    bit: int
    namespace: Namespace
    keys: tuple[BlockKey, ...] | None  # None: the slot lost everything


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class BlockIndex(EventApplier):
    """Per worker, per tier: which named blocks are cached. Pure; not thread-safe.

    Each (worker, tier) is a *slot* with one bit; per namespace, each key maps
    to the OR of the bits of the slots holding it. Removals are logged (up to
    ``log_capacity`` events) so incremental chains can catch up cheaply.

    :meth:`apply` skips (counted): ``other_group``, ``block_size`` (not this
    index's), ``bad_token_ids`` (a token id outside ``[0, 2**32)``),
    ``unknown_parent`` (a store whose parent this worker never announced),
    ``unknown_slot`` (a removal from a tier that stored nothing).
    """

    def __init__(self, block_size: int, *, kv_group: int = 0, log_capacity: int = 65536) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.kv_group = kv_group
        self._masks: dict[Namespace, dict[BlockKey, int]] = {}
        # per worker, engine hash -> one packed int (:func:`_pack`): its key, position and
        # namespace id (a plain int: no GC load; one dict entry per (block, worker))
        self._names: dict[WorkerId, dict[object, int]] = {}
        self._ns_ids: dict[Namespace, int] = {}
        self._ns_list: list[Namespace] = []
        self._slot_bit: dict[tuple[WorkerId, Tier], int] = {}
        self._bit_slot: dict[int, tuple[WorkerId, Tier]] = {}
        self._shared_names: dict[Namespace, dict[BlockKey, int]] = {}
        """Per namespace, for a block two slots or more hold: the packed name (:func:`_pack`)
        every worker's name map shares (one int per block, not per (block, worker); only
        blocks stored where another slot held them are here, so distinct blocks cost nothing)."""
        self._slot_blocks: dict[int, int] = {}
        """Per slot bit, the keys it holds (a count: a worker's keys are its names' keys)."""
        self._worker_mask: dict[WorkerId, int] = {}
        self._free_bits: list[int] = []
        self._log: deque[_Removal] = deque(maxlen=log_capacity)
        self._log_end = 0
        self.counters: Counter[str] = Counter()

    # ---- ingest ---------------------------------------------------------
    def _ahead(self, event: KVEvent) -> object:
        """A stored block's :func:`~kvpilot.routing.index.chain.lane_sums` (its hashing but for its
        position), where it carries no extra keys; ``None`` otherwise (its apply hashes it)."""
        if not isinstance(event, BlockStored) or event.block_size != self.block_size:
            return None
        if event.extra_keys and any(e is not None for e in event.extra_keys):
            return None
        try:
            return lane_sums(event.token_ids, self.block_size)
        except ValueError:
            return None  # its apply refuses the token ids

    def _stored(self, worker: WorkerId, ev: BlockStored, ahead: object = None) -> str:
        if ev.block_size != self.block_size:
            return "block_size"
        names = self._names.get(worker) or self._names.setdefault(worker, {})
        extras = ev.extra_keys
        if ev.parent_block_hash is None:
            ns: Namespace = freeze(extras[0]) if extras and extras[0] else None
            parent, pos0 = ROOT_KEY, 0
            nsid = self._ns_id(ns)
        else:
            known = names.get(ev.parent_block_hash)
            if known is None:
                return "unknown_parent"
            parent, position, nsid = _unpack(known)
            pos0, ns = position + 1, self._ns_list[nsid]
        plain = (ev.lora_name,) if ev.lora_name else None
        try:
            if extras and any(e is not None and freeze(e) != plain for e in extras[1 if pos0 == 0 else 0 :]):
                keys = self._keys_with_extras(ev, pos0, parent, plain)
            elif isinstance(ahead, np.ndarray):  # hashed ahead by the thread that read it
                keys = chain_from_hashes(placed_hashes(ahead, pos0), parent)
            else:
                keys = chain_keys(ev.token_ids, self.block_size, pos0, parent)
        except ValueError:
            return "bad_token_ids"
        bitno = self._bit_for(worker, Tier(ev.medium or DEFAULT_TIER))
        bit = 1 << bitno
        masks = self._masks.setdefault(ns, {})
        before = list(map(masks.get, keys, repeat(0)))
        self._slot_blocks[bitno] += len(keys) - sum(map(truth, map(and_, before, repeat(bit))))
        masks.update(zip(keys, map(or_, before, repeat(bit)), strict=False))
        # a key no slot held gets ``bit`` itself: one int object for all of them (a distinct
        # block's entry costs no int of its own)
        masks.update(zip(compress(keys, map(not_, before)), repeat(bit)))
        packed = list(map(or_, keys, count(_pack(ROOT_KEY, pos0, nsid), 1 << (KEY_BITS + _NS_BITS))))
        if any(before):  # blocks other slots hold: their workers' names share one int each
            shared = self._shared_names.setdefault(ns, {})
            for i, mask in enumerate(before):
                if mask:
                    first = shared.setdefault(keys[i], packed[i])
                    if first == packed[i]:
                        packed[i] = first
        names.update(zip(ev.block_hashes, packed, strict=False))
        self.counters["blocks_stored"] += len(keys)
        return "applied"

    def _keys_with_extras(self, ev: BlockStored, pos0: int, parent: BlockKey, plain: Namespace) -> list[BlockKey]:
        """Blocks with extra keys beyond LoRA (multimodal, embeds) get them hashed in."""
        hashes = block_hashes(ev.token_ids, self.block_size, pos0)
        for j, extra in enumerate((ev.extra_keys or ())[: len(hashes)]):
            frozen = freeze(extra) if extra is not None else None
            if pos0 + j and frozen is not None and frozen != plain:
                hashes[j] ^= np.uint64(hash(frozen) & ((1 << KEY_BITS) - 1))
        return chain_from_hashes(hashes, parent)

    def _removed(self, worker: WorkerId, ev: BlockRemoved) -> str:
        slot = (worker, Tier(ev.medium or DEFAULT_TIER))
        bitno = self._slot_bit.get(slot)
        if bitno is None:
            return "unknown_slot"
        bit = 1 << bitno
        names = self._names.get(worker) or {}
        others = self._worker_mask[worker] & ~bit
        gone: dict[Namespace, list[BlockKey]] = {}
        for ehash in ev.block_hashes:
            packed = names.get(ehash)
            if packed is None:
                self.counters["unknown_block"] += 1
                continue
            key, _, nsid = _unpack(packed)
            ns = self._ns_list[nsid]
            masks = self._masks[ns]
            mask = masks.get(key, 0)
            if not mask & bit:
                continue
            mask &= ~bit
            if mask:
                masks[key] = mask
            else:
                del masks[key]
                self._forget_shared_name(ns, key)
            self._slot_blocks[bitno] -= 1
            if not mask & others:
                del names[ehash]
            gone.setdefault(ns, []).append(key)
        for ns, keys in gone.items():
            self._log_removal(_Removal(bitno, ns, tuple(keys)))
            self.counters["blocks_removed"] += len(keys)
        return "applied"

    def clear_worker(self, worker: WorkerId) -> None:
        """Forget everything ``worker`` holds, in every tier (restart, cache reset)."""
        slots = self._worker_mask.get(worker, 0)
        keep = ~slots
        for packed in (self._names.pop(worker, None) or {}).values():
            key, _, nsid = _unpack(packed)
            ns_of = self._ns_list[nsid]
            masks = self._masks[ns_of]
            mask = masks.get(key, 0) & keep
            if mask:
                masks[key] = mask
            else:
                masks.pop(key, None)
                self._forget_shared_name(ns_of, key)
        for bitno in _bits(slots):
            self._slot_blocks[bitno] = 0
            self._log_removal(_Removal(bitno, None, None))

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` entirely; its slot bits are reused later."""
        self.clear_worker(worker)
        for bitno in _bits(self._worker_mask.pop(worker, 0)):
            del self._slot_bit[self._bit_slot.pop(bitno)]
            del self._slot_blocks[bitno]
            self._free_bits.append(bitno)

    def _forget_shared_name(self, ns: Namespace, key: BlockKey) -> None:
        """No slot holds ``key`` any more: its shared name goes too."""
        shared = self._shared_names.get(ns)
        if shared is not None:
            shared.pop(key, None)

    def _ns_id(self, ns: Namespace) -> int:
        nsid = self._ns_ids.get(ns)
        if nsid is None:
            if len(self._ns_list) > _NS_MASK:
                raise OverflowError(f"more than {_NS_MASK} namespaces (salts x LoRAs)")
            nsid = self._ns_ids[ns] = len(self._ns_list)
            self._ns_list.append(ns)
        return nsid

    def _bit_for(self, worker: WorkerId, tier: Tier) -> int:
        bitno = self._slot_bit.get((worker, tier))
        if bitno is None:
            bitno = min(self._free_bits) if self._free_bits else len(self._bit_slot)
            if self._free_bits:
                self._free_bits.remove(bitno)
            self._slot_bit[(worker, tier)] = bitno
            self._bit_slot[bitno] = (worker, tier)
            self._slot_blocks[bitno] = 0
            self._worker_mask[worker] = self._worker_mask.get(worker, 0) | (1 << bitno)
        return bitno

    def _log_removal(self, entry: _Removal) -> None:
        self._log.append(entry)
        self._log_end += 1

    # ---- queries --------------------------------------------------------
    def workers(self) -> list[WorkerId]:
        return list(self._worker_mask)

    def block_count(self, worker: WorkerId, tier: Tier = DEFAULT_TIER) -> int:
        """Blocks ``worker`` holds in ``tier`` (0 for an unknown slot)."""
        bitno = self._slot_bit.get((worker, tier))
        if bitno is None:
            return 0
        return self._slot_blocks[bitno]

    def match(self, chain: PromptChain) -> Match:
        """Each worker's longest cached prefix of ``chain``, from block 0, per tier.

        Does not modify the index. Names at most one chunk past the deepest
        match. For an incremental chain, reuses the previous match and looks
        only at removals logged since (or recomputes if the log overflowed).
        An empty prompt, or a namespace no worker has, matches nothing.
        """
        state = chain.match_state
        masks = self._masks.get(chain.namespace)
        if not masks or chain.num_blocks == 0:
            depths: dict[int, int] = {}
        elif state is not None and state.cursor >= self._log_end - len(self._log):
            depths = self._catch_up(chain, state, masks)
        else:
            depths = self._full(chain, masks)
        if state is not None:
            state.depths, state.cursor = depths, self._log_end
        blocks: dict[WorkerId, dict[Tier, int]] = {}
        for bitno, depth in depths.items():
            worker, tier = self._bit_slot[bitno]
            blocks.setdefault(worker, {})[tier] = depth
        return Match(blocks, chain.num_blocks, chain.named_blocks)

    def _full(self, chain: PromptChain, masks: dict[BlockKey, int]) -> dict[int, int]:
        get, n = masks.get, chain.num_blocks
        alive_seq: list[int] = []
        alive, done, step = -1, 0, 64
        while done < n and alive:
            end = min(n, done + step)
            keys = chain.keys(end)
            alive_seq.extend(islice(accumulate(map(get, keys[done:end], repeat(0)), and_, initial=alive), 1, None))
            alive, done, step = alive_seq[-1], end, step * 4
        depths: dict[int, int] = {}
        i, size = 0, len(alive_seq)
        cur = alive_seq[0] if size else 0
        while cur:  # alive_seq is non-increasing: each value a submask of the last
            j = bisect_right(alive_seq, -cur, i, size, key=neg)
            nxt = alive_seq[j] if j < size else 0
            for bitno in _bits(cur & ~nxt):
                depths[bitno] = j
            i, cur = j, nxt
        return depths

    def _catch_up(self, chain: PromptChain, state: MatchState, masks: dict[BlockKey, int]) -> dict[int, int]:
        depths = dict(state.depths)
        start = state.cursor - (self._log_end - len(self._log))
        for entry in islice(self._log, start, None):
            depth = depths.get(entry.bit)
            if not depth:
                continue
            if entry.keys is None:
                del depths[entry.bit]
            elif entry.namespace == chain.namespace:
                pos = chain.positions()
                hit = min((p for p in map(pos.get, entry.keys) if p is not None), default=depth)
                if hit < depth:
                    depths[entry.bit] = hit
        n, get = chain.num_blocks, masks.get
        keys = chain.keys(max(depths.values(), default=0) + 1)
        starts: dict[int, int] = {}  # depth -> the slots' bits resuming there
        resumed = 0
        for bitno, depth in depths.items():
            if depth:
                starts[depth] = starts.get(depth, 0) | (1 << bitno)
                resumed |= 1 << bitno
        fresh = get(keys[0], 0) & ~resumed  # slots that now hold the first block
        if fresh:
            starts[0] = fresh
        # Forward from each slot's depth, the slots at one depth as one mask: O(depths
        # walked), not O(slots) (a fleet's every worker holds the shared prefix).
        found: dict[int, int] = {}
        order = sorted(starts)
        alive, depth, k = 0, 0, 0
        while k < len(order) or alive:
            if not alive:
                depth = order[k]
            while k < len(order) and order[k] == depth:
                alive |= starts[order[k]]
                k += 1
            if depth >= n:
                break
            if depth >= len(keys):
                keys = chain.keys(2 * depth + 64)
            held = alive & get(keys[depth], 0)
            if depth:
                for bitno in _bits(alive & ~held):
                    found[bitno] = depth
            alive, depth = held, depth + 1
        for rest in order[k:]:  # slots already at least ``n`` deep
            alive |= starts[rest]
        for bitno in _bits(alive):
            found[bitno] = n
        return found
