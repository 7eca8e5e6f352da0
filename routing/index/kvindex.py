"""What the router needs of a block index (:class:`KVIndex`), the answer it gets
(:class:`Match`), and the event dispatch both backends share (:class:`EventApplier`). Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from routing.ids import DEFAULT_TIER, Tier, WorkerId
from routing.index.chain import PromptChain
from routing.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class Match(NamedTuple):
    """Longest cached prefix from block 0, in blocks, per worker and tier (zeros omitted)."""

    blocks: dict[WorkerId, dict[Tier, int]]
    prompt_blocks: int
    named_blocks: int


class KVIndex(Protocol):
    """What the router needs of a block index: :class:`BlockIndex` (kvpilot's) or
    :class:`routing.index.dynamo.DynamoIndex` (Dynamo's ``RadixTree``), chosen
    with ``index.backend``. ``apply`` never raises; skips are counted."""

    block_size: int
    counters: Counter[str]

    def apply(self, worker: WorkerId, event: KVEvent) -> str: ...
    def apply_all(self, worker: WorkerId, events: Iterable[KVEvent]) -> None: ...
    def clear_worker(self, worker: WorkerId) -> None: ...
    def remove_worker(self, worker: WorkerId) -> None: ...
    def workers(self) -> list[WorkerId]: ...
    def block_count(self, worker: WorkerId, tier: Tier = DEFAULT_TIER) -> int: ...
    def match(self, chain: PromptChain) -> Match: ...


class EventApplier:
    """Applies KV events to an index: the dispatch and counting both backends share.

    A subclass sets ``kv_group`` and ``counters`` and implements ``clear_worker``,
    ``_stored`` and ``_removed`` (each returns ``"applied"`` or a skip reason).
    """

    kv_group: int
    counters: Counter[str]

    def apply(self, worker: WorkerId, event: KVEvent) -> str:
        """Apply one event from ``worker``; returns ``"applied"`` or why it was skipped.

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
            outcome = self._stored(worker, event)
        else:
            outcome = self._removed(worker, event)
        self.counters[outcome] += 1
        return outcome

    def apply_all(self, worker: WorkerId, events: Iterable[KVEvent]) -> None:
        """Apply events in order (see :meth:`apply`)."""
        for event in events:
            self.apply(worker, event)

    def clear_worker(self, worker: WorkerId) -> None:
        raise NotImplementedError

    def _stored(self, worker: WorkerId, ev: BlockStored) -> str:
        raise NotImplementedError

    def _removed(self, worker: WorkerId, ev: BlockRemoved) -> str:
        raise NotImplementedError
