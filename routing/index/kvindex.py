"""What the router needs of a block index (:class:`KVIndex`), the answer it gets
(:class:`Match`), and the event dispatch both backends share (:class:`EventApplier`). Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from kvpilot.routing.ids import DEFAULT_TIER, Tier, WorkerId
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class Match(NamedTuple):
    """Longest cached prefix from block 0, in blocks, per worker and tier (zeros omitted)."""

    blocks: dict[WorkerId, dict[Tier, int]]
    prompt_blocks: int
    named_blocks: int


class KVIndex(Protocol):
    """What the router needs of a block index: :class:`~kvpilot.routing.index.block_index.BlockIndex`
    (kvpilot's) or :class:`~kvpilot.routing.index.dynamo.DynamoIndex` (Dynamo's ``RadixTree``),
    chosen with ``index.backend``. Not thread-safe: one thread owns it and makes every call
    (the router's event loop) but :meth:`prepare`, which any thread may call. Both backends run the same scenarios
    against the same expected matches (tests/unit/routing/test_routing_dynamo_index.py)."""

    block_size: int
    """Tokens per block; events of another block size are skipped."""
    counters: Counter[str]
    """How many events were applied, and how many skipped by reason."""

    def apply(self, worker: WorkerId, event: KVEvent) -> str:
        """Apply one event from ``worker``, in the order the worker published it.
        Returns ``"applied"`` or why it was skipped (counted in :attr:`counters`);
        never raises. An event that cannot be applied (a ``BlockStored`` whose parent
        the index never saw, another block size, token ids that do not fill the
        blocks, a removal for a tier the worker never stored in) is a skip."""
        ...

    def apply_all(self, worker: WorkerId, events: Iterable[KVEvent]) -> None:
        """:meth:`apply` each event in order."""
        ...

    def prepare(self, events: Sequence[KVEvent]) -> Prepared:
        """``events`` with the work their applying needs that reads no index state done
        ahead (a stored block's hashing, but for its position): thread-safe, for the thread
        that reads the events, so that the owner's :meth:`apply_prepared` does the rest."""
        ...

    def apply_prepared(self, worker: WorkerId, prepared: Prepared) -> None:
        """:meth:`apply_all` of :meth:`prepare`'s events, the same outcome."""
        ...

    def clear_worker(self, worker: WorkerId) -> None:
        """Forget every block ``worker`` holds, in every tier (an engine restart, a
        cache reset, a gap in its events before a replay); the worker stays known."""
        ...

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` entirely; a later event from it starts it afresh."""
        ...

    def workers(self) -> list[WorkerId]:
        """Every worker the index has heard of and not removed, in no set order."""
        ...

    def block_count(self, worker: WorkerId, tier: Tier = DEFAULT_TIER) -> int:
        """Blocks ``worker`` holds in ``tier``; 0 for an unknown worker or tier."""
        ...

    def match(self, chain: PromptChain) -> Match:
        """Each worker's longest cached prefix of ``chain`` from block 0, in blocks,
        per tier; workers and tiers with none are omitted. Does not modify the index.
        Only blocks of ``chain``'s namespace (its LoRA and ``cache_salt``) count: a
        prompt never earns credit for another namespace's blocks."""
        ...


Prepared = list[tuple[KVEvent, object]]
"""Events, each with what :meth:`KVIndex.prepare` did ahead for it (``None``: nothing)."""


class EventApplier:
    """Applies KV events to an index: the dispatch and counting both backends share.

    A subclass sets ``kv_group`` and ``counters`` and implements ``clear_worker``,
    ``_stored`` and ``_removed`` (each returns ``"applied"`` or a skip reason).
    """

    kv_group: int
    counters: Counter[str]

    def apply(self, worker: WorkerId, event: KVEvent, ahead: object = None) -> str:
        """Apply one event from ``worker`` (``ahead``: what :meth:`prepare` did for it); returns
        ``"applied"`` or why it was skipped.

        Skips are counted in :attr:`counters`, never raised: ``other_group`` (a
        KV cache group other than ``kv_group``) here, the rest per backend.
        ``AllBlocksCleared`` clears every tier of the worker.
        """
        if isinstance(event, AllBlocksCleared):
            self.clear_worker(worker)
            outcome = "applied"
        elif event.group_idx not in (None, self.kv_group):
            outcome = "other_group"
        elif isinstance(event, BlockStored):
            outcome = self._stored(worker, event, ahead)
        else:
            outcome = self._removed(worker, event)
        self.counters[outcome] += 1
        return outcome

    def apply_all(self, worker: WorkerId, events: Iterable[KVEvent]) -> None:
        """Apply events in order (see :meth:`apply`)."""
        for event in events:
            self.apply(worker, event)

    def prepare(self, events: Sequence[KVEvent]) -> Prepared:
        """``events`` with what :meth:`_ahead` does for each, in any thread."""
        return [(event, self._ahead(event)) for event in events]

    def apply_prepared(self, worker: WorkerId, prepared: Prepared) -> None:
        """Apply :meth:`prepare`'s events in order."""
        for event, ahead in prepared:
            self.apply(worker, event, ahead)

    def _ahead(self, event: KVEvent) -> object:
        """What applying ``event`` needs that reads no index state (``None``: nothing)."""
        return None

    def clear_worker(self, worker: WorkerId) -> None:
        raise NotImplementedError

    def _stored(self, worker: WorkerId, ev: BlockStored, ahead: object = None) -> str:
        raise NotImplementedError

    def _removed(self, worker: WorkerId, ev: BlockRemoved) -> str:
        raise NotImplementedError
