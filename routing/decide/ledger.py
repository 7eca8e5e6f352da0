"""The router's own load accounting, per worker, as Dynamo's cost reads it. Pure.

Per prefill worker: the active prefill blocks (uncached blocks of requests
still prefilling there). Per decode worker: the *unique* blocks its active
requests hold and the number of those requests. Unique, as in Dynamo's
``ActiveSequences``: requests sharing a prefix share its KV, so a request adds
only the blocks no active request on that worker already holds. That is what
lets a cache-rich worker keep winning a hot prefix (and what the decaying
overlap credit counters, :mod:`kvpilot.routing.decide.cost`).

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

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.chain import BlockKey, Namespace, PromptChain

_PREFILL, _UNIQUE, _REQUESTS = range(3)
"""The columns of the ledger's per-worker counts."""


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


@dataclass(frozen=True, slots=True)
class PromptLoads:
    """Every worker's load for one prompt (:meth:`LoadLedger.prompt_loads`):
    ``loads[worker]`` reads its :class:`WorkerLoad`; ``shared`` holds the nonzero
    ``shared_decode_blocks`` by worker (a fleet's columns are :meth:`LoadLedger.counts`
    and these)."""

    ledger: LoadLedger
    shared: dict[WorkerId, int]

    def __getitem__(self, worker: WorkerId) -> WorkerLoad:
        return self.ledger.load(worker)._replace(shared_decode_blocks=self.shared.get(worker, 0))


class LoadLedger:
    """Active prefill blocks per P, unique active decode blocks and requests per D.

    The event methods return False (and change nothing) for an unknown or
    already finished request.
    """

    def __init__(self) -> None:
        self._active: dict[str, _Active] = {}
        self._rows: dict[WorkerId, int] = {}
        """Each worker's row of ``_counts`` (rows are never reused; row 0 is no worker's)."""
        self._counts = np.zeros((16, 3), dtype=np.int64)
        """Per row: active prefill blocks, unique active decode blocks, active requests."""
        self._rows_cache: tuple[tuple[WorkerId, ...], int, np.ndarray] | None = None
        self._held: dict[WorkerId, dict[Namespace, Counter[BlockKey]]] = {}
        self._by_first_block: dict[tuple[Namespace, BlockKey], Counter[WorkerId]] = {}
        """Per (namespace, first block): the decode workers whose active requests start
        with it, and how many requests each (the only workers that can share a prompt's
        leading blocks: :meth:`loads`)."""

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
        self._add(_PREFILL, prefill_worker, todo)
        self._add(_REQUESTS, decode_worker, 1)
        held = self._held.setdefault(decode_worker, {}).setdefault(chain.namespace, Counter())
        before = len(held)
        held.update(blocks)
        self._add(_UNIQUE, decode_worker, len(held) - before)
        if blocks:
            self._by_first_block.setdefault((chain.namespace, blocks[0]), Counter())[decode_worker] += 1

    def first_token(self, request_id: str) -> bool:
        active = self._active.get(request_id)
        if active is None or not active.prefilling:
            return False
        active.prefilling = False
        self._add(_PREFILL, active.prefill_worker, -active.prefill_blocks)
        return True

    def move_prefill(self, request_id: str, prefill_worker: WorkerId, cached_blocks: int) -> bool:
        """The prefill restarts on ``prefill_worker`` (P failed: D prefills locally),
        which holds ``cached_blocks`` of the prompt; the decode side is unchanged."""
        active = self._active.get(request_id)
        if active is None:
            return False
        if active.prefilling:
            self._add(_PREFILL, active.prefill_worker, -active.prefill_blocks)
        active.prefill_worker, active.prefilling = prefill_worker, True
        active.prefill_blocks = max(0, len(active.blocks) - cached_blocks)
        self._add(_PREFILL, prefill_worker, active.prefill_blocks)
        return True

    def complete(self, request_id: str) -> bool:
        active = self._active.pop(request_id, None)
        if active is None:
            return False
        if active.prefilling:
            self._add(_PREFILL, active.prefill_worker, -active.prefill_blocks)
        worker = active.decode_worker
        self._add(_REQUESTS, worker, -1)
        by_namespace = self._held[worker]
        # absent when an earlier request of no full block emptied it (its own entry was empty too)
        held = by_namespace.setdefault(active.namespace, Counter())
        before = len(held)
        held.subtract(active.blocks)
        for key in active.blocks:
            if held.get(key, 1) <= 0:
                del held[key]
        self._add(_UNIQUE, worker, len(held) - before)
        if not held:
            del by_namespace[active.namespace]
        if active.blocks:
            first = (active.namespace, active.blocks[0])
            holders = self._by_first_block[first]
            holders[worker] -= 1
            if holders[worker] <= 0:
                del holders[worker]
            if not holders:
                del self._by_first_block[first]
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
        row = self._rows.get(worker)
        if row is None:
            return WorkerLoad(shared_decode_blocks=shared)
        prefill, unique, requests = self._counts[row].tolist()
        return WorkerLoad(prefill, unique, requests, shared)

    def prompt_loads(self, chain: PromptChain) -> PromptLoads:
        """Every worker's :meth:`load` for ``chain``, the shared blocks searched only on
        the workers whose active requests start with its first block."""
        first = chain.keys(1)
        holders = self._by_first_block.get((chain.namespace, first[0])) if first else None
        shared = {w: self._shared_depth(self._held[w][chain.namespace], chain) for w in holders} if holders else {}
        return PromptLoads(self, shared)

    def rows(self, workers: tuple[WorkerId, ...]) -> np.ndarray:
        """``workers``' rows for :meth:`counts` (row 0, all zeros, for a worker with no
        load yet). Kept while the same tuple is asked again and no worker is new, so a
        router asking for its fleet each request pays one lookup per worker only when
        the fleet or the ledger's workers change."""
        cached = self._rows_cache
        if cached is not None and cached[0] is workers and cached[1] == len(self._rows):
            return cached[2]
        rows = np.fromiter((self._rows.get(w, 0) for w in workers), dtype=np.intp, count=len(workers))
        self._rows_cache = (workers, len(self._rows), rows)
        return rows

    def counts(self, rows: np.ndarray) -> np.ndarray:
        """Shape ``(len(rows), 3)``: active prefill blocks, unique active decode blocks and
        active requests of each of :meth:`rows`'s workers (a copy)."""
        counts: np.ndarray = self._counts[rows]
        return counts

    @staticmethod
    def _shared_depth(held: Counter[BlockKey], chain: PromptChain) -> int:
        """Leading blocks of ``chain`` in ``held``. A key names its whole prefix (each
        key folds in its parent's, :mod:`kvpilot.routing.index.chain`), so an active request
        holding block ``i`` holds blocks ``0..i``: membership falls once along the
        chain, and a galloping search finds where in ``O(log depth)`` lookups, naming
        blocks only up to twice the depth."""
        keys = chain.keys(1)  # the chain's own list: naming more extends it in place
        if not keys or keys[0] not in held:
            return 0
        n, low, step = chain.num_blocks, 1, 1  # the first ``low`` blocks are held
        while low < n:
            probe = min(n, low + step)
            if probe > len(keys):
                chain.keys(probe)
            if keys[probe - 1] not in held:  # the first block not held lies in [low, probe - 1]
                return bisect_left(keys, True, low, probe - 1, key=lambda key: key not in held)
            low, step = probe, step * 2
        return n

    def _add(self, column: int, worker: WorkerId, delta: int) -> None:
        row = self._rows.get(worker)
        if row is None:
            row = self._rows[worker] = len(self._rows) + 1
            if row >= len(self._counts):
                self._counts = np.concatenate((self._counts, np.zeros_like(self._counts)))
        self._counts[row, column] += delta
