"""The global block index: which worker holds which prefix, per tier. Pure.

Block naming (see the package docstring for why): the router names block ``i``
of a chain ``key_i = key_{i-1} XOR hash((i, *tokens_of_block_i))`` with
``key_{-1} = 0``, computed in one pass of C-level iterators, inside *one
namespace* ``(lora_name?, cache_salt?)``. Engine hashes are mapped to these
keys per worker (llm-d style), so the engines' hash algorithm and seed do not
matter. Keys live only in this process's memory; they are never sent anywhere.

Namespaces are separate dictionaries, so a prompt is never credited with
another salt's (or LoRA's) blocks, whatever the hashes do.

Worked example (block size 2, one worker ``"w1"``)::

    >>> from routing.events import BlockStored, BlockRemoved
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
from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import accumulate, count, islice, repeat
from operator import and_, neg, or_, xor
from typing import NamedTuple, NewType, Optional

from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

WorkerId = NewType("WorkerId", str)
Tier = NewType("Tier", str)
"""A KV event's ``medium`` (``"GPU"``, ``"CPU"``, ``"STORAGE"``...); ``None`` reads as ``"GPU"``."""
BlockKey = NewType("BlockKey", int)
Namespace = Optional[tuple[Hashable, ...]]
"""Block 0's untagged extra keys, as vLLM publishes them: ``(lora_name?, cache_salt?)`` or None."""

DEFAULT_TIER = Tier("GPU")
_NS_BITS = 20
_NS_MASK = (1 << _NS_BITS) - 1
ROOT_KEY = BlockKey(0)


def namespace_for(lora_name: str | None = None, cache_salt: str | None = None) -> Namespace:
    """The namespace vLLM's block 0 of such a request carries (empty parts dropped)."""
    parts = tuple(p for p in (lora_name, cache_salt) if p)
    return parts or None


def chain_keys(
    tokens: Sequence[int], block_size: int, first_pos: int, parent: BlockKey
) -> list[BlockKey]:
    """Keys of the full blocks of ``tokens``, the first one at chain position ``first_pos``.

    ``tokens`` starts at a block boundary; a trailing partial block is ignored.
    ``chain_keys(t, bs, 0, ROOT_KEY)[k]`` names the prefix ``t[: (k + 1) * bs]``;
    ``chain_keys(t[j*bs:], bs, j, keys[j-1])`` continues the same chain.
    """
    blocks = zip(count(first_pos), *[iter(tokens)] * block_size)
    out = list(accumulate(map(hash, blocks), xor, initial=parent))
    del out[0]
    return out  # type: ignore[return-value]


def _frozen(value: object) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value  # type: ignore[return-value]


class PromptChain:
    """A prompt's block keys, named lazily and extendable (the request side).

    ``tokens`` is not copied until the chain is first extended; the caller must
    not mutate it meanwhile. :class:`BlockIndex.match` names only as many blocks
    as it needs (it stops at the first block no worker holds); an incremental
    chain (``incremental=True``) also keeps the last match so the next
    :meth:`BlockIndex.match` only looks at what changed.
    """

    __slots__ = ("block_size", "namespace", "_tokens", "_owned", "_keys", "_pos", "_state")

    def __init__(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        incremental: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.namespace = namespace_for(lora_name, cache_salt)
        self._tokens = tokens
        self._owned = False
        self._keys: list[BlockKey] = []
        self._pos: dict[BlockKey, int] | None = None
        self._state: _MatchState | None = _MatchState() if incremental else None

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    @property
    def num_blocks(self) -> int:
        """Full blocks in the prompt (the partial tail is never named)."""
        return len(self._tokens) // self.block_size

    @property
    def named_blocks(self) -> int:
        """Blocks named so far (hashing work done)."""
        return len(self._keys)

    def keys(self, upto: int) -> list[BlockKey]:
        """The first ``min(upto, num_blocks)`` keys (the internal list: do not mutate)."""
        have = len(self._keys)
        upto = min(upto, self.num_blocks)
        if upto > have:
            bs = self.block_size
            parent = self._keys[-1] if have else ROOT_KEY
            new = chain_keys(self._tokens[have * bs : upto * bs], bs, have, parent)
            self._keys.extend(new)
            if self._pos is not None:
                self._pos.update(zip(new, count(have)))
        return self._keys

    def positions(self) -> Mapping[BlockKey, int]:
        """Key -> block position, for named blocks (built on first use, then kept)."""
        if self._pos is None:
            self._pos = dict(zip(self._keys, count()))
        return self._pos

    def extend(self, appended: Iterable[int]) -> None:
        """The prompt grows by ``appended``; named blocks stay named."""
        if not self._owned:
            self._tokens = list(self._tokens)
            self._owned = True
        self._tokens.extend(appended)  # type: ignore[attr-defined]

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens; forget names (and matches) past them."""
        if not self._owned:
            self._tokens = list(self._tokens[:num_tokens])
            self._owned = True
        else:
            del self._tokens[num_tokens:]  # type: ignore[attr-defined]
        blocks = num_tokens // self.block_size
        if blocks < len(self._keys):
            if self._pos is not None:
                for key in self._keys[blocks:]:
                    self._pos.pop(key, None)
            del self._keys[blocks:]
        if self._state is not None:
            self._state.clamp(blocks)


class _MatchState:
    """Last match of an incremental chain: depth per slot bit, log cursor."""

    __slots__ = ("depths", "cursor")

    def __init__(self) -> None:
        self.depths: dict[int, int] = {}
        self.cursor = -1  # no match yet

    def clamp(self, blocks: int) -> None:
        self.depths = {b: min(d, blocks) for b, d in self.depths.items() if blocks}


class Match(NamedTuple):
    """Longest cached prefix from block 0, in blocks, per worker and tier (zeros omitted)."""

    blocks: dict[WorkerId, dict[Tier, int]]
    prompt_blocks: int
    named_blocks: int


class _Removal(NamedTuple):
    bit: int
    namespace: Namespace
    keys: tuple[BlockKey, ...] | None  # None: the slot lost everything


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class BlockIndex:
    """Per worker, per tier: which named blocks are cached. Pure; not thread-safe.

    Each (worker, tier) is a *slot* with one bit; per namespace, each key maps
    to the OR of the bits of the slots holding it. Removals are logged (up to
    ``log_capacity`` events) so incremental chains can catch up cheaply.
    """

    def __init__(self, block_size: int, *, kv_group: int = 0, log_capacity: int = 65536) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.kv_group = kv_group
        self._masks: dict[Namespace, dict[BlockKey, int]] = {}
        # engine hash -> key, and -> (position << 20 | namespace id): plain ints, no GC load
        self._names: dict[WorkerId, tuple[dict[object, BlockKey], dict[object, int]]] = {}
        self._ns_ids: dict[Namespace, int] = {}
        self._ns_list: list[Namespace] = []
        self._slot_bit: dict[tuple[WorkerId, Tier], int] = {}
        self._bit_slot: dict[int, tuple[WorkerId, Tier]] = {}
        self._slot_keys: dict[int, dict[Namespace, set[BlockKey]]] = {}
        self._worker_mask: dict[WorkerId, int] = {}
        self._free_bits: list[int] = []
        self._log: deque[_Removal] = deque(maxlen=log_capacity)
        self._log_end = 0
        self.counters: Counter[str] = Counter()

    # ---- ingest ---------------------------------------------------------
    def apply(self, worker: WorkerId, event: KVEvent) -> str:
        """Apply one event from ``worker``; returns ``"applied"`` or why it was skipped.

        Skips (counted in :attr:`counters`, never raised): ``other_group`` (a KV
        cache group other than ``kv_group``), ``block_size`` (not this index's),
        ``unknown_parent`` (a store whose parent this worker never announced),
        ``unknown_slot`` (a removal from a tier that stored nothing).
        ``AllBlocksCleared`` clears every tier of the worker.
        """
        if isinstance(event, AllBlocksCleared):
            self.clear_worker(worker)
            outcome = "applied"
        elif event.group_idx not in (None, self.kv_group):
            outcome = "other_group"
        elif isinstance(event, BlockStored):
            outcome = self._stored(worker, event)
        else:
            outcome = self._removed(worker, event)
        self.counters[outcome] += 1
        return outcome

    def apply_all(self, worker: WorkerId, events: Iterable[KVEvent]) -> None:
        """Apply events in order (see :meth:`apply`)."""
        for event in events:
            self.apply(worker, event)

    def _stored(self, worker: WorkerId, ev: BlockStored) -> str:
        if ev.block_size != self.block_size:
            return "block_size"
        names, metas = self._names.get(worker) or self._names.setdefault(worker, ({}, {}))
        extras = ev.extra_keys
        if ev.parent_block_hash is None:
            ns: Namespace = _frozen(extras[0]) if extras and extras[0] else None  # type: ignore[assignment]
            parent, pos0 = ROOT_KEY, 0
            nsid = self._ns_id(ns)
        else:
            parent = names.get(ev.parent_block_hash)  # type: ignore[assignment]
            if parent is None:
                return "unknown_parent"
            meta = metas[ev.parent_block_hash]
            nsid, pos0 = meta & _NS_MASK, (meta >> _NS_BITS) + 1
            ns = self._ns_list[nsid]
        plain = (ev.lora_name,) if ev.lora_name else None
        if extras and any(
            e is not None and _frozen(e) != plain for e in extras[1 if pos0 == 0 else 0 :]
        ):
            keys = self._keys_with_extras(ev, pos0, parent, plain)
        else:
            keys = chain_keys(ev.token_ids, self.block_size, pos0, parent)
        bit = 1 << self._bit_for(worker, Tier(ev.medium or DEFAULT_TIER))
        masks = self._masks.setdefault(ns, {})
        masks.update(zip(keys, map(or_, map(masks.get, keys, repeat(0)), repeat(bit))))
        self._slot_keys[bit.bit_length() - 1].setdefault(ns, set()).update(keys)
        names.update(zip(ev.block_hashes, keys))
        metas.update(zip(ev.block_hashes, count(pos0 << _NS_BITS | nsid, 1 << _NS_BITS)))
        self.counters["blocks_stored"] += len(keys)
        return "applied"

    def _keys_with_extras(
        self, ev: BlockStored, pos0: int, parent: BlockKey, plain: Namespace
    ) -> list[BlockKey]:
        """Blocks with extra keys beyond LoRA (multimodal, embeds) get them hashed in."""
        bs, keys, key = self.block_size, [], parent
        for j, extra in enumerate(ev.extra_keys or ()):
            toks = ev.token_ids[j * bs : (j + 1) * bs]
            frozen = _frozen(extra) if extra is not None else None
            if pos0 + j == 0 or frozen == plain:
                key = BlockKey(key ^ hash((pos0 + j, *toks)))
            else:
                key = BlockKey(key ^ hash((pos0 + j, *toks, frozen)))
            keys.append(key)
        return keys

    def _removed(self, worker: WorkerId, ev: BlockRemoved) -> str:
        slot = (worker, Tier(ev.medium or DEFAULT_TIER))
        bitno = self._slot_bit.get(slot)
        if bitno is None:
            return "unknown_slot"
        bit = 1 << bitno
        names, metas = self._names.get(worker) or ({}, {})
        others = self._worker_mask[worker] & ~bit
        gone: dict[Namespace, list[BlockKey]] = {}
        for ehash in ev.block_hashes:
            key = names.get(ehash)
            if key is None:
                self.counters["unknown_block"] += 1
                continue
            ns = self._ns_list[metas[ehash] & _NS_MASK]
            masks = self._masks[ns]
            mask = masks.get(key, 0)
            if not mask & bit:
                continue
            mask &= ~bit
            if mask:
                masks[key] = mask
            else:
                del masks[key]
            self._slot_keys[bitno][ns].discard(key)
            if not mask & others:
                del names[ehash], metas[ehash]
            gone.setdefault(ns, []).append(key)
        for ns, keys in gone.items():
            self._log_removal(_Removal(bitno, ns, tuple(keys)))
            self.counters["blocks_removed"] += len(keys)
        return "applied"

    def clear_worker(self, worker: WorkerId) -> None:
        """Forget everything ``worker`` holds, in every tier (restart, cache reset)."""
        for bitno in _bits(self._worker_mask.get(worker, 0)):
            self._clear_slot(bitno)
        self._names.pop(worker, None)

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` entirely; its slot bits are reused later."""
        self.clear_worker(worker)
        for bitno in _bits(self._worker_mask.pop(worker, 0)):
            del self._slot_bit[self._bit_slot.pop(bitno)]
            del self._slot_keys[bitno]
            self._free_bits.append(bitno)

    def _clear_slot(self, bitno: int) -> None:
        keep = ~(1 << bitno)
        for ns, keys in self._slot_keys[bitno].items():
            masks = self._masks[ns]
            for key in keys:
                mask = masks[key] & keep
                if mask:
                    masks[key] = mask
                else:
                    del masks[key]
        self._slot_keys[bitno] = {}
        self._log_removal(_Removal(bitno, None, None))

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
            self._slot_keys[bitno] = {}
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
        return sum(len(keys) for keys in self._slot_keys[bitno].values())

    def match(self, chain: PromptChain) -> Match:
        """Each worker's longest cached prefix of ``chain``, from block 0, per tier.

        Does not modify the index. Names at most one chunk past the deepest
        match. For an incremental chain, reuses the previous match and looks
        only at removals logged since (or recomputes if the log overflowed).
        An empty prompt, or a namespace no worker has, matches nothing.
        """
        state = chain._state
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
            alive_seq.extend(
                islice(accumulate(map(get, keys[done:end], repeat(0)), and_, initial=alive), 1, None)
            )
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

    def _catch_up(
        self, chain: PromptChain, state: _MatchState, masks: dict[BlockKey, int]
    ) -> dict[int, int]:
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
        walk = get(keys[0], 0)
        for bitno, depth in depths.items():
            if depth:
                walk |= 1 << bitno
        for bitno in _bits(walk):  # forward from each slot's depth: O(blocks gained)
            bit, depth = 1 << bitno, depths.get(bitno, 0)
            while depth < n:
                if depth == len(keys):
                    keys = chain.keys(2 * depth + 64)
                if not get(keys[depth], 0) & bit:
                    break
                depth += 1
            depths[bitno] = depth
        return {bitno: depth for bitno, depth in depths.items() if depth}
