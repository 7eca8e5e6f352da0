"""The router's own load accounting, per worker, as Dynamo's cost reads it. Pure.

Per prefill worker: the active prefill blocks (uncached blocks of requests
still prefilling there). Per decode worker: the *unique* blocks its active
requests hold and the number of those requests. Unique, as in Dynamo's
``ActiveSequences``: requests sharing a prefix share its KV, so a request adds
only the blocks no active request on that worker already holds. That is what
lets a cache-rich worker keep winning a hot prefix (and what the decaying
overlap credit counters, :mod:`routing.decide.cost`).

Lifecycle: :meth:`LoadLedger.dispatch` (when the route is taken),
:meth:`~LoadLedger.first_token` (the prefill is over; or
:meth:`~LoadLedger.move_prefill` when P failed and D prefills), then
:meth:`~LoadLedger.complete` or :meth:`~LoadLedger.fail` (everything still
counted is released). In co-located mode P and D are the same worker.

Example (block size 2)::

    >>> ledger = LoadLedger()
    >>> ledger.dispatch("r1", "w", "w", PromptChain([1, 2, 3, 4, 5, 6], 2), cached_blocks=0)
    >>> ledger.load("w")
    WorkerLoad(active_prefill_blocks=3, active_decode_blocks=3, active_requests=1, shared_decode_blocks=0)
    >>> ledger.load("w", PromptChain([1, 2, 3, 4, 9, 9, 9, 9], 2)).shared_decode_blocks
    2
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import takewhile
from typing import NamedTuple

from routing.ids import WorkerId
from routing.index.chain import BlockKey, Namespace, PromptChain


class WorkerLoad(NamedTuple):
    """What a worker carries, and (for one prompt) how much of the prompt it already holds active."""

    active_prefill_blocks: int = 0
    active_decode_blocks: int = 0
    active_requests: int = 0
    shared_decode_blocks: int = 0
    """The prompt's leading blocks that active requests on the worker already hold."""


@dataclass(slots=True)
class _Active:
    prefill_worker: WorkerId
    decode_worker: WorkerId
    prefill_blocks: int
    namespace: Namespace
    blocks: list[BlockKey]
    prefilling: bool = True


class LoadLedger:
    """Active prefill blocks per P, unique active decode blocks and requests per D.

    The event methods return False (and change nothing) for an unknown or
    already finished request.
    """

    def __init__(self) -> None:
        self._active: dict[str, _Active] = {}
        self._prefill: dict[WorkerId, int] = {}
        self._requests: dict[WorkerId, int] = {}
        self._held: dict[WorkerId, dict[Namespace, Counter[BlockKey]]] = {}
        self._unique: dict[WorkerId, int] = {}

    def dispatch(
        self,
        request_id: str,
        prefill_worker: WorkerId,
        decode_worker: WorkerId,
        chain: PromptChain,
        cached_blocks: int,
    ) -> None:
        """Count a dispatched request (names all of ``chain``'s blocks).

        ``cached_blocks`` is the prefix P holds (not prefilled again). Raises
        ValueError if ``request_id`` is active.
        """
        if request_id in self._active:
            raise ValueError(f"request {request_id!r} is already active")
        blocks = list(chain.keys(chain.num_blocks))
        todo = max(0, chain.num_blocks - cached_blocks)
        self._active[request_id] = _Active(prefill_worker, decode_worker, todo, chain.namespace, blocks)
        self._add(self._prefill, prefill_worker, todo)
        self._add(self._requests, decode_worker, 1)
        held = self._held.setdefault(decode_worker, {}).setdefault(chain.namespace, Counter())
        before = len(held)
        held.update(blocks)
        self._add(self._unique, decode_worker, len(held) - before)

    def first_token(self, request_id: str) -> bool:
        active = self._active.get(request_id)
        if active is None or not active.prefilling:
            return False
        active.prefilling = False
        self._add(self._prefill, active.prefill_worker, -active.prefill_blocks)
        return True

    def move_prefill(self, request_id: str, prefill_worker: WorkerId, cached_blocks: int) -> bool:
        """The prefill restarts on ``prefill_worker`` (P failed: D prefills locally),
        which holds ``cached_blocks`` of the prompt; the decode side is unchanged."""
        active = self._active.get(request_id)
        if active is None:
            return False
        if active.prefilling:
            self._add(self._prefill, active.prefill_worker, -active.prefill_blocks)
        active.prefill_worker, active.prefilling = prefill_worker, True
        active.prefill_blocks = max(0, len(active.blocks) - cached_blocks)
        self._add(self._prefill, prefill_worker, active.prefill_blocks)
        return True

    def complete(self, request_id: str) -> bool:
        active = self._active.pop(request_id, None)
        if active is None:
            return False
        if active.prefilling:
            self._add(self._prefill, active.prefill_worker, -active.prefill_blocks)
        worker = active.decode_worker
        self._add(self._requests, worker, -1)
        by_namespace = self._held[worker]
        # absent when an earlier request of no full block emptied it (its own entry was empty too)
        held = by_namespace.setdefault(active.namespace, Counter())
        before = len(held)
        held.subtract(active.blocks)
        for key in active.blocks:
            if held.get(key, 1) <= 0:
                del held[key]
        self._add(self._unique, worker, len(held) - before)
        if not held:
            del by_namespace[active.namespace]
        return True

    fail = complete  # a failed request frees what it held, like a finished one

    def load(self, worker: WorkerId, chain: PromptChain | None = None) -> WorkerLoad:
        """``worker``'s current load (zeros if it has none); with ``chain``, also
        how many of the prompt's leading blocks its active requests hold."""
        shared = 0
        if chain is not None:
            held = self._held.get(worker, {}).get(chain.namespace)
            if held:
                shared = self._shared_depth(held, chain)
        return WorkerLoad(
            self._prefill.get(worker, 0), self._unique.get(worker, 0), self._requests.get(worker, 0), shared
        )

    @staticmethod
    def _shared_depth(held: Counter[BlockKey], chain: PromptChain) -> int:
        """Leading blocks of ``chain`` in ``held``; names blocks only as far as they match."""
        depth, n, step = 0, chain.num_blocks, 64
        while depth < n:
            end = min(n, depth + step)
            run = sum(1 for _ in takewhile(held.__contains__, chain.keys(end)[depth:end]))
            depth += run
            if depth < end:
                break
            step *= 4
        return depth

    @staticmethod
    def _add(table: dict[WorkerId, int], worker: WorkerId, delta: int) -> None:
        value = table.get(worker, 0) + delta
        if value:
            table[worker] = value
        else:
            table.pop(worker, None)
