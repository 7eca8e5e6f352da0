"""Block names: the router's key for each full block of a token chain. Pure.

Block ``i`` of a chain is named ``key_i = key_{i-1} XOR mix(i, tokens_i)`` with
``key_{-1} = 0``, where ``mix`` is a per-process random multilinear hash of the
block's tokens and position (uint64 arithmetic, vectorized with numpy) put
through a 64-bit finalizer. The same function names the engines' stored blocks
(:mod:`kvpilot.routing.index.block_index`) and the prompts (:class:`PromptChain`); keys live only in
this process's memory and are never sent anywhere, so the random lanes differ
per process. The cost is one ``array('I', ...)`` conversion of the tokens plus
a few numpy passes, with no Python call per block.

Token ids must be integers in ``[0, 2**32)``; anything else raises
:class:`ValueError`.

A chain lives in one *namespace* ``(lora_name?, cache_salt?)`` (block 0's extra
keys as vLLM publishes them). The namespace is not hashed in: the index keeps
one dictionary per namespace, so isolation does not rest on the hash.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Mapping, Sequence
from itertools import count
from typing import Any, NewType, overload

import numpy as np

BlockKey = NewType("BlockKey", int)
Namespace = tuple[Hashable, ...] | None
"""Block 0's untagged extra keys, as vLLM publishes them: ``(lora_name?, cache_salt?)`` or None."""

Tokens = Sequence[int] | np.ndarray
"""Token ids: a sequence of ints, or packed (a uint32 numpy array, read in place)."""

ROOT_KEY = BlockKey(0)
_RNG = np.random.default_rng()
_POSITION_LANE = _RNG.integers(0, 2**64, dtype=np.uint64, endpoint=False) | np.uint64(1)
_FINAL_MULTIPLIER = np.uint64(0xFF51AFD7ED558CCD)
_SHIFT_A, _SHIFT_B = np.uint64(32), np.uint64(29)
KEY_BITS = 60
_KEY_MASK = np.uint64((1 << KEY_BITS) - 1)
_LANES: dict[int, np.ndarray] = {}
_PACK_WHOLE_TOKENS = 4096
"""Naming more tokens than this at once packs the whole prompt (in place from then on)."""


def namespace_for(lora_name: str | None = None, cache_salt: str | None = None) -> Namespace:
    """The namespace vLLM's block 0 of such a request carries (empty parts dropped)."""
    parts = tuple(p for p in (lora_name, cache_salt) if p)
    return parts or None


@overload
def freeze(value: list[Any] | tuple[Any, ...]) -> tuple[Hashable, ...]: ...
@overload
def freeze(value: object) -> Hashable: ...
def freeze(value: object) -> Hashable:
    """An event's extra key made hashable (msgpack gives lists where vLLM had tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def _lanes(block_size: int) -> np.ndarray:
    lanes = _LANES.get(block_size)
    if lanes is None:
        lanes = _RNG.integers(0, 2**64, size=block_size, dtype=np.uint64, endpoint=False) | np.uint64(1)
        _LANES[block_size] = lanes
    return lanes


def pack_tokens(tokens: Sequence[int]) -> array[int]:
    """``tokens`` as ``array('I')`` (returned as is if it already is one).

    Packed tokens take 4 bytes each, compare with numpy whatever the int
    objects, and cost the cyclic GC O(1) per array (a list of ints is re-scanned
    element by element at every full collection). Raises ValueError for a
    token id outside ``[0, 2**32)`` or not an integer.
    """
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens
    packed = array("I")
    try:
        if isinstance(tokens, list):
            packed.fromlist(tokens)  # the list fast path
        else:
            packed.extend(tokens)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    return packed


def block_hashes(
    tokens: Tokens, block_size: int, first_pos: int, start: int = 0, stop: int | None = None
) -> np.ndarray:
    """Unchained 60-bit hashes (uint64) of the full blocks of ``tokens[start:stop]``, the
    first at chain position ``first_pos``.

    ``start`` is a block boundary; a trailing partial block is ignored. Packed
    tokens (``array('I')`` or a uint32 numpy array) are read in place. Raises
    ValueError for a token id outside ``[0, 2**32)`` or not an integer.
    """
    return placed_hashes(lane_sums(tokens, block_size, start, stop), first_pos)


def lane_sums(tokens: Tokens, block_size: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The position-free half of :func:`block_hashes` (uint64, one per full block of
    ``tokens[start:stop]``): the bulk of its work, which needs no block's position, so a
    thread that does not own the index can do it ahead (:func:`placed_hashes` finishes it).
    Raises ValueError as :func:`block_hashes` does."""
    stop = len(tokens) if stop is None else min(stop, len(tokens))
    n = max(0, stop - start) // block_size
    if isinstance(tokens, np.ndarray):
        flat = tokens[start : start + n * block_size]
    elif isinstance(tokens, array) and tokens.typecode == "I":
        flat = np.frombuffer(tokens, dtype=np.uint32, count=n * block_size, offset=4 * start)
    else:
        flat = np.frombuffer(pack_tokens(tokens[start : start + n * block_size]), dtype=np.uint32)
    sums: np.ndarray = flat.reshape(n, block_size) @ _lanes(block_size)
    return sums


def placed_hashes(sums: np.ndarray, first_pos: int) -> np.ndarray:
    """:func:`block_hashes` from its :func:`lane_sums`, the first block at chain position
    ``first_pos``, computed in ``sums``' own storage (consumed: it holds the hashes after)."""
    h = sums
    h += np.arange(first_pos, first_pos + len(sums), dtype=np.uint64) * _POSITION_LANE
    h ^= h >> _SHIFT_A
    h *= _FINAL_MULTIPLIER
    h ^= h >> _SHIFT_B
    h &= _KEY_MASK  # 60-bit keys: two-digit Python ints, cheaper to hash and store
    return h


def first_difference(old: Tokens, new: Tokens) -> int:
    """Index of the first position where ``old`` and ``new`` differ, or the shorter length.

    Compares packed tokens with numpy, not a Python list compare of the ints; raises
    ValueError for a token id outside ``[0, 2**32)``.
    """
    n = min(len(old), len(new))
    differ = np.flatnonzero(_uint32(old)[:n] != _uint32(new)[:n])
    return int(differ[0]) if differ.size else n


def _uint32(tokens: Tokens) -> np.ndarray:
    """``tokens`` as a uint32 numpy array, in place where already packed."""
    if isinstance(tokens, np.ndarray):
        return tokens
    return np.frombuffer(pack_tokens(tokens), dtype=np.uint32)


def chain_from_hashes(hashes: np.ndarray, parent: BlockKey) -> list[BlockKey]:
    """Chain block hashes onto ``parent``: ``key_j = parent XOR hashes[0] XOR ... XOR hashes[j]``."""
    keys = np.bitwise_xor.accumulate(hashes)
    if parent:
        keys ^= np.uint64(parent)
    chained: list[BlockKey] = keys.tolist()
    return chained


def chain_keys(tokens: Tokens, block_size: int, first_pos: int, parent: BlockKey) -> list[BlockKey]:
    """Keys of the full blocks of ``tokens``, the first one at chain position ``first_pos``.

    ``chain_keys(t, bs, 0, ROOT_KEY)[k]`` names the prefix ``t[: (k + 1) * bs]``;
    ``chain_keys(t[j*bs:], bs, j, keys[j-1])`` continues the same chain.
    """
    return chain_from_hashes(block_hashes(tokens, block_size, first_pos), parent)


class PromptChain:
    """A prompt's block keys, named lazily and extendable (the request side).

    ``tokens`` is not copied until the chain is first extended, truncated or
    asked to name more than 4,096 tokens at once (then it is packed into the
    chain's own uint32 storage, and :attr:`tokens` is a numpy view of it); the
    caller must not mutate it meanwhile. An incremental chain packs its own
    copy at once. :meth:`kvpilot.routing.index.block_index.BlockIndex.match` names only
    as many blocks as it needs (it stops at the first block no worker holds);
    an incremental chain (``incremental=True``) also keeps the index's last
    match (``match_state``, owned by the index) so the next match only looks at
    what changed.
    """

    __slots__ = ("_buffer", "_keys", "_pos", "_tokens", "block_size", "match_state", "namespace")

    def __init__(
        self,
        tokens: Tokens,
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
        self.match_state: MatchState | None = MatchState() if incremental else None
        self._tokens: Tokens = tokens  # the caller's, or a view of _buffer once owned
        self._buffer: np.ndarray | None = None  # owned uint32 storage, grown by doubling
        if incremental:  # long-lived: packed, owned
            self._own()
        self._keys: list[BlockKey] = []
        self._pos: dict[BlockKey, int] | None = None

    @property
    def tokens(self) -> Tokens:
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
        """The first ``min(upto, num_blocks)`` keys (the internal list: do not mutate).

        Raises ValueError if a token id in the newly named blocks is not in ``[0, 2**32)``.
        """
        have = len(self._keys)
        upto = min(upto, self.num_blocks)
        if upto > have:
            bs = self.block_size
            parent = self._keys[-1] if have else ROOT_KEY
            if self._buffer is None and (upto - have) * bs > _PACK_WHOLE_TOKENS:
                self._own()  # one conversion of the whole prompt beats one per slice
            new = chain_from_hashes(block_hashes(self._tokens, bs, have, have * bs, upto * bs), parent)
            self._keys.extend(new)
            if self._pos is not None:
                self._pos.update(zip(new, count(have)))
        return self._keys

    def seeded(self, tokens: Tokens, shared_tokens: int) -> PromptChain:
        """A fresh chain (not incremental) naming ``tokens``, which share their first
        ``shared_tokens`` with this chain's tokens, in this chain's namespace: the keys this
        chain already named for the shared full blocks are copied, not hashed again, so
        naming it costs only the blocks past them. This chain is left as it was."""
        fork = PromptChain(tokens, self.block_size)
        fork.namespace = self.namespace
        fork._keys = self._keys[: min(len(self._keys), shared_tokens // self.block_size)]
        return fork

    def positions(self) -> Mapping[BlockKey, int]:
        """Key -> block position, for named blocks (built on first use, then kept)."""
        if self._pos is None:
            self._pos = dict(zip(self._keys, count()))
        return self._pos

    def _own(self) -> np.ndarray:
        """This chain's own packed storage (the tokens copied in once)."""
        if self._buffer is None:
            packed = _uint32(self._tokens)
            self._buffer = np.empty(max(1024, 2 * len(packed)), dtype=np.uint32)
            self._buffer[: len(packed)] = packed
            self._tokens = self._buffer[: len(packed)]
        return self._buffer

    def extend(self, appended: Tokens) -> None:
        """The prompt grows by ``appended``; named blocks stay named.

        Amortized O(len(appended)): the storage doubles when full. Raises
        ValueError (and leaves the chain as it was) for a token id outside
        ``[0, 2**32)``.
        """
        extra = _uint32(appended)
        buffer, have = self._own(), len(self._tokens)
        need = have + len(extra)
        if need > len(buffer):
            grown = np.empty(max(need, 2 * len(buffer)), dtype=np.uint32)
            grown[:have] = buffer[:have]
            self._buffer = buffer = grown
        buffer[have:need] = extra
        self._tokens = buffer[:need]

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens; forget names (and matches) past them."""
        buffer = self._own()
        self._tokens = buffer[: min(num_tokens, len(self._tokens))]
        blocks = num_tokens // self.block_size
        if blocks < len(self._keys):
            if self._pos is not None:
                for key in self._keys[blocks:]:
                    self._pos.pop(key, None)
            del self._keys[blocks:]
        if self.match_state is not None:
            self.match_state.clamp(blocks)


class MatchState:
    """The index's last match of an incremental chain: depth per slot bit, log cursor."""

    __slots__ = ("cursor", "depths")

    def __init__(self) -> None:
        self.depths: dict[int, int] = {}
        self.cursor = -1  # no match yet

    def clamp(self, blocks: int) -> None:
        self.depths = {b: min(d, blocks) for b, d in self.depths.items() if blocks}
