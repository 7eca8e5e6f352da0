"""A :class:`kvpilot.routing.index.block_index.BlockIndex` twin backed by NVIDIA Dynamo's ``RadixTree``.

Chosen with ``index.backend: dynamo`` so the two indexes can be compared on
live traffic; imports ``dynamo`` (``ai-dynamo-runtime``), so import this module
only when that backend is chosen. Same interface, outcomes and counters as
BlockIndex: :meth:`DynamoIndex.apply` never raises, ``match`` gives per worker
and tier the longest cached prefix from block 0.

Mapping: one ``RadixTree`` per tier (an event's ``medium``, None reads
``"GPU"``). A block is named by ``compute_block_hash_for_seq(tokens,
block_size, cache_namespace=repr(namespace))``, on the event side and on the
prompt side; that hash covers the block's own tokens only, the tree gives the
prefix. Engine hashes go to Dynamo as u64 (ints mod 2**64, bytes through an
8-byte BLAKE2b digest); worker names as ints 0, 1, ... in order of first
event, kept for the index's lifetime. ``RadixTree.apply_event`` is a blocking
round trip to the tree's own thread (its errors come back from the call), so a
match sees every event applied before it.

Differences from BlockIndex, all Dynamo's:

* No incremental path: every match hashes the whole prompt (``named_blocks ==
  prompt_blocks``) and queries every tier's tree; ``match_state`` is ignored.
* Namespace (``cache_salt``/LoRA) isolation rests on the 64-bit hash (the
  namespace is hashed into every block), not on separate dictionaries.
* No extra keys beyond the namespace and the LoRA name (multimodal, embeds):
  an event's blocks from the first such block on are dropped (outcome
  ``unsupported_extra_keys``; the blocks before it are applied). BlockIndex
  keeps them under keys no prompt matches: matches agree, ``block_count`` and
  the outcome of their children's events (``unknown_parent`` here) do not.
* A store's parent must be in the same tier's tree: Dynamo refuses one whose
  parent the worker holds only in another tier (outcome ``refused``, nothing
  applied); BlockIndex accepts it.
* Removing a block drops the worker's whole subtree below it in that tier:
  its descendants are not credited again when the block is stored again
  (BlockIndex credits them), stores under them are ``refused``, and a removal
  naming them is ``already_dropped`` (its other blocks are removed).
  ``block_count`` follows the events and does not see these drops.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np
from dynamo.llm import RadixTree, compute_block_hash_for_seq

from kvpilot.routing.ids import DEFAULT_TIER, Tier, WorkerId
from kvpilot.routing.index.chain import Namespace, PromptChain, freeze
from kvpilot.routing.index.events import BlockRemoved, BlockStored
from kvpilot.routing.index.kvindex import EventApplier, Match

_U64 = (1 << 64) - 1
_BAD_TOKENS = (OverflowError, TypeError, ValueError)  # what compute_block_hash_for_seq raises


def _u64s(hashes: Iterable[object]) -> list[int] | None:  # a hand-built event may hold anything
    """Engine block hashes as Dynamo's u64s (ints mod 2**64, bytes via BLAKE2b-64); None if not int/bytes."""
    out = []
    for h in hashes:
        if isinstance(h, bytes):
            out.append(int.from_bytes(hashlib.blake2b(h, digest_size=8).digest(), "big"))
        elif isinstance(h, int):
            out.append(h & _U64)
        else:
            return None
    return out


def _local_hashes(tokens: Sequence[int], block_size: int, ns: Namespace) -> list[int]:
    """Dynamo's per-block hashes of ``tokens`` (full blocks) in namespace ``ns``."""
    return compute_block_hash_for_seq(
        tokens,  # type: ignore[arg-type]  # the stub says list; any sequence of ints works
        block_size,
        cache_namespace=None if ns is None else repr(ns),
    )


class DynamoIndex(EventApplier):
    """Per worker, per tier: which blocks are cached, held in Dynamo's RadixTrees. Not thread-safe.

    Keeps beside the trees, per worker: engine hash -> namespace (any tier,
    to name later blocks) and, per tier, the engine hashes held (for
    ``block_count`` and to send Dynamo only removals it can apply).

    :meth:`apply` skips (counted): BlockIndex's ``other_group``,
    ``block_size``, ``bad_token_ids``, ``unknown_parent``, ``unknown_slot``;
    and ``bad_block_hash`` (a hash neither int nor bytes),
    ``unsupported_extra_keys``, ``refused`` (Dynamo rejected a store: nothing
    applied), ``already_dropped`` (a removal naming blocks Dynamo had dropped:
    the others were removed); see the module docstring.
    """

    def __init__(self, block_size: int, *, kv_group: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.kv_group = kv_group
        self.counters: Counter[str] = Counter()
        self._trees: dict[Tier, RadixTree] = {}
        self._ids: dict[WorkerId, int] = {}
        self._names: list[WorkerId] = []
        self._known: dict[WorkerId, dict[int, Namespace]] = {}
        self._held: dict[WorkerId, dict[Tier, set[int]]] = {}
        self._event_id = 0

    # ---- ingest ---------------------------------------------------------
    def _stored(self, worker: WorkerId, ev: BlockStored, ahead: object = None) -> str:
        if ev.block_size != self.block_size:
            return "block_size"
        hashes = _u64s(ev.block_hashes)
        parents = _u64s([] if ev.parent_block_hash is None else [ev.parent_block_hash])
        if hashes is None or parents is None:
            return "bad_block_hash"
        known = self._known.setdefault(worker, {})
        extras = ev.extra_keys or []
        if not parents:
            ns: Namespace = freeze(extras[0]) if extras and extras[0] else None
        elif parents[0] in known:
            ns = known[parents[0]]
        else:
            return "unknown_parent"
        plain = (ev.lora_name,) if ev.lora_name else None
        first = 0 if parents else 1  # block 0's extra keys are the namespace
        cut = next(
            (j for j, e in enumerate(extras) if j >= first and e is not None and freeze(e) != plain),
            len(hashes),
        )
        bs = self.block_size
        try:
            blocks = list(zip(hashes[:cut], _local_hashes(ev.token_ids[: cut * bs], bs, ns), strict=False))
        except _BAD_TOKENS:
            return "bad_token_ids"
        tier = Tier(ev.medium or DEFAULT_TIER)
        tree = self._trees.get(tier)
        if tree is None:
            tree = self._trees[tier] = RadixTree()
        if blocks:
            stored = {
                "parent_hash": parents[0] if parents else None,
                "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in blocks],
            }
            try:
                tree.apply_event(self._worker_id(worker), self._event({"stored": stored}))
            except (RuntimeError, ValueError):
                return "refused"
        held = self._held.setdefault(worker, {}).setdefault(tier, set())
        for h, _ in blocks:
            held.add(h)
            known[h] = ns
        self.counters["blocks_stored"] += len(blocks)
        return "applied" if cut == len(hashes) else "unsupported_extra_keys"

    def _removed(self, worker: WorkerId, ev: BlockRemoved) -> str:
        tiers = self._held.get(worker, {})
        tier = Tier(ev.medium or DEFAULT_TIER)
        if tier not in tiers:
            return "unknown_slot"
        hashes = _u64s(ev.block_hashes)
        if hashes is None:
            return "bad_block_hash"
        known, held, gone = self._known.get(worker, {}), tiers[tier], []
        for h in hashes:
            if h not in known:
                self.counters["unknown_block"] += 1
            elif h in held:
                held.remove(h)
                gone.append(h)
                if not any(h in other for other in tiers.values()):
                    del known[h]
        self.counters["blocks_removed"] += len(gone)
        if gone:
            removed = self._event({"removed": {"block_hashes": gone}})
            try:
                self._trees[tier].apply_event(self._worker_id(worker), removed)
            except RuntimeError:  # "Failed to find block": dropped with an ancestor
                return "already_dropped"
        return "applied"

    def clear_worker(self, worker: WorkerId) -> None:
        """Forget everything ``worker`` holds, in every tier (restart, cache reset)."""
        for tier, held in self._held.get(worker, {}).items():
            self._trees[tier].clear_all_blocks(self._ids[worker])
            held.clear()
        self._known.pop(worker, None)

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` entirely (its int id is not reused)."""
        for tier in self._held.pop(worker, {}):
            self._trees[tier].remove_worker(self._ids[worker])
        self._known.pop(worker, None)

    def _worker_id(self, worker: WorkerId) -> int:
        wid = self._ids.get(worker)
        if wid is None:
            wid = self._ids[worker] = len(self._names)
            self._names.append(worker)
        return wid

    def _event(self, data: dict[str, Any]) -> bytes:
        """A Dynamo ``KvCacheEvent`` as the JSON ``RadixTree.apply_event`` takes."""
        self._event_id += 1
        return json.dumps({"event_id": self._event_id, "data": data}).encode()

    # ---- queries --------------------------------------------------------
    def workers(self) -> list[WorkerId]:
        """Workers with an applied store since they were last removed."""
        return list(self._held)

    def block_count(self, worker: WorkerId, tier: Tier = DEFAULT_TIER) -> int:
        """Blocks ``worker`` holds in ``tier`` per the applied events (0 for an unknown slot)."""
        return len(self._held.get(worker, {}).get(tier, ()))

    def match(self, chain: PromptChain) -> Match:
        """Each worker's longest cached prefix of ``chain``, from block 0, per tier.

        Does not modify the index; hashes all of ``chain.tokens``. An empty
        prompt, or an empty index, matches nothing (and hashes nothing).
        Raises ValueError if a token id is not in ``[0, 2**32)``.
        """
        n = chain.num_blocks
        if n == 0 or not self._trees:
            return Match({}, n, 0)
        try:
            packed = chain.tokens
            # a session chain's tokens are packed
            tokens: Sequence[int] = packed.tolist() if isinstance(packed, np.ndarray) else packed
            hashes = _local_hashes(tokens, chain.block_size, chain.namespace)
        except _BAD_TOKENS as exc:
            raise ValueError(f"token ids must be in [0, 2**32): {exc}") from exc
        blocks: dict[WorkerId, dict[Tier, int]] = {}
        for tier, tree in self._trees.items():
            # keyed by (worker id, dp rank), not by worker id as the stub says
            scores = cast("dict[tuple[int, int], int]", tree.find_matches(hashes).scores)
            for (wid, _dp_rank), depth in scores.items():
                if depth:
                    blocks.setdefault(self._names[wid], {})[tier] = depth
        return Match(blocks, n, len(hashes))
