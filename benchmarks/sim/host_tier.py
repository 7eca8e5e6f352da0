"""One worker's private host pool (:class:`HostTier`), as AISimulate 0.13.0's, with FIFO D2H
and H2D lanes (:mod:`benchmarks.sim.engine`'s **Host tier** gives the model). Pure: the
caller passes the time in."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from benchmarks.sim.request import SimRequest

STORE, LOAD = 0, 1
"""Host transfer kinds (D2H, H2D), in the order same-time completions apply."""
MISS, PENDING, HIT = range(3)
"""What the host tier holds of a block: nothing, a store not completed, the block."""


class HostTier:
    """One worker's private host pool, as AISimulate 0.13.0's ``HostTier`` with FIFO lanes
    (module doc): entries pending a store or resident, an LRU over resident blocks no load
    pins, a D2H and an H2D lane, transfers completed in deadline order (stores first)."""

    def __init__(self, capacity: int, block_bytes: int, d2h_gb_s: float, h2d_gb_s: float) -> None:
        self.capacity = capacity
        self.evicted: list[object] = []
        """Resident blocks evicted since the engine last took them (its host-tier events)."""
        self.pending: dict[object, int] = {}
        """Blocks whose store has not completed: the store's transfer id."""
        self.resident: set[object] = set()
        self.pins: dict[object, int] = {}
        self.lru: OrderedDict[object, None] = OrderedDict()
        """Resident, unpinned blocks, least recent first."""
        self.block_bytes = block_bytes
        self.rate = {STORE: d2h_gb_s * 1e6, LOAD: h2d_gb_s * 1e6}  # bytes per ms
        self.tail = {STORE: 0.0, LOAD: 0.0}
        self.transfers: dict[int, tuple[int, list[object], SimRequest | None, float | None]] = {}
        """Transfer id -> kind, blocks, the loading request, deadline (None until submitted)."""
        self.deadlines: list[tuple[float, int, int]] = []  # (at, kind, id), a heap
        self.prepared: list[int] = []
        self.loading: dict[object, int] = {}
        self.next_id = 0

    def lookup(self, key: object) -> int:
        """``MISS``, ``PENDING`` (its store not completed) or ``HIT``."""
        if key in self.resident:
            return HIT
        return PENDING if key in self.pending else MISS

    def touch(self, key: object) -> None:
        if key in self.resident and not self.pins.get(key):
            self.lru.pop(key, None)
            self.lru[key] = None

    def touch_cohort(self, keys: list[object]) -> None:
        """One recency epoch for ``keys``, the block's name breaking ties (as its hash does)."""
        for key in sorted(keys, key=hash):
            self.lru.pop(key, None)
            self.lru[key] = None

    def prepare_store(self, keys: Sequence[object]) -> int | None:
        """Admit the missing ones of ``keys`` (one cohort), evicting LRU victims outside it:
        the store's id, ``-1`` if none is missing, ``None`` if they do not fit (retried)."""
        protected = set(keys)
        missing = [key for key in dict.fromkeys(keys) if key not in self.resident and key not in self.pending]
        if not missing:
            return -1
        needed = len(missing) - (self.capacity - len(self.resident) - len(self.pending))
        victims = []
        if needed > 0:
            for key in self.lru:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == needed:
                        break
            if len(victims) < needed:
                return None
        for key in victims:
            self.resident.discard(key)
            del self.lru[key]
        self.evicted.extend(victims)
        transfer = self._new(STORE, missing, None)
        for key in missing:
            self.pending[key] = transfer
        self.prepared.append(transfer)
        return transfer

    def _new(self, kind: int, blocks: list[object], request: SimRequest | None) -> int:
        transfer = self.next_id
        self.next_id += 1
        self.transfers[transfer] = (kind, blocks, request, None)
        return transfer

    def _submit(self, transfer: int, not_before_ms: float) -> float:
        kind, blocks, request, _ = self.transfers[transfer]
        rate = self.rate[kind]
        duration = len(blocks) * self.block_bytes / rate if rate > 0 else 0.0
        at = self.tail[kind] = max(self.tail[kind], not_before_ms) + duration
        self.transfers[transfer] = (kind, blocks, request, at)
        heapq.heappush(self.deadlines, (at, kind, transfer))
        return at

    def submit_prepared(self, now_ms: float) -> None:
        for transfer in self.prepared:
            self._submit(transfer, now_ms)
        self.prepared = []

    def deadline(self, transfer: int) -> float | None:
        entry = self.transfers.get(transfer)
        return entry[3] if entry is not None else None

    def schedule_load(self, request: SimRequest, keys: list[object], now_ms: float, not_before_ms: float) -> int:
        for key in keys:
            self.lru.pop(key, None)
            self.pins[key] = self.pins.get(key, 0) + 1
        transfer = self._new(LOAD, keys, request)
        for key in keys:
            self.loading[key] = transfer
        self._submit(transfer, max(now_ms, not_before_ms))
        return transfer

    def due(self, now_ms: float) -> list[tuple[int, int, list[object], SimRequest | None]]:
        """Complete every transfer due by ``now_ms`` (at one time, stores before loads, then
        by id): stored blocks become resident, loads unpin theirs."""
        done = []
        while self.deadlines and self.deadlines[0][0] <= now_ms:
            _, kind, transfer = heapq.heappop(self.deadlines)
            _, blocks, request, _ = self.transfers.pop(transfer)
            if kind == STORE:
                for key in blocks:
                    del self.pending[key]
                    self.resident.add(key)
                self.touch_cohort(blocks)
            else:
                unpinned = []
                for key in blocks:
                    del self.loading[key]
                    self.pins[key] -= 1
                    if not self.pins[key]:
                        del self.pins[key]
                        unpinned.append(key)
                self.touch_cohort(unpinned)
            done.append((kind, transfer, blocks, request))
        return done

    def next_deadline(self) -> float | None:
        return self.deadlines[0][0] if self.deadlines else None
