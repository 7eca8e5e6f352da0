"""Prompt blocks the workers computed, from their own vLLM-format KV events: what gives
prefix reuse where a worker's usage block cannot (a disaggregated fleet: the client's
usage block is D's, while P did the prefill).

A worker publishes one ``BlockStored`` per block it computes and caches (a block it
served from its cache is not stored again; one it evicted and computed again is).
:class:`StoredPromptBlocks` (pure) keeps those that are blocks of the benchmark's
prompts (by :func:`fleet_trace.block_digest`), apart from the blocks of generated
tokens. :class:`EventTap` reads every worker's PUB socket on a thread while an arm runs.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import zmq

from benchmarks.fleet.trace import block_digest
from kvpilot.routing.index.events import BlockStored, EventDecoder


class StoredPromptBlocks:
    """Counts, per worker, the stored blocks that are prompt blocks."""

    def __init__(self, prompt_digests: set[int], block_size: int) -> None:
        self._digests = prompt_digests
        self._size = block_size
        self.prompt_blocks: Counter[str] = Counter()
        self.other_blocks: Counter[str] = Counter()

    def stored(self, worker: str, token_ids: Sequence[int]) -> None:
        """One ``BlockStored``'s tokens (``block_size`` per block) on ``worker``."""
        for i in range(0, len(token_ids) - self._size + 1, self._size):
            if block_digest(token_ids[i : i + self._size]) in self._digests:
                self.prompt_blocks[worker] += 1
            else:
                self.other_blocks[worker] += 1

    @property
    def total(self) -> int:
        return sum(self.prompt_blocks.values())


class EventTap:
    """Subscribes to ``endpoints`` (worker name -> ``tcp://host:port``) and feeds every
    ``BlockStored`` into ``counts`` until :meth:`stop`. Start it before the traffic:
    a SUB that connects misses what was published before."""

    def __init__(self, endpoints: dict[str, str], counts: StoredPromptBlocks) -> None:
        self.counts = counts
        self._ctx = zmq.Context()
        self._socks: dict[zmq.Socket[bytes], str] = {}
        for name, endpoint in endpoints.items():
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[sock] = name
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-tap", daemon=True)
        self.rejected = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        decoder = EventDecoder()
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(100))
            if not ready and self._stopping.is_set():
                break
            for sock in ready:
                self._drain(sock, decoder)
        self.rejected = sum(decoder.rejections.values())

    def _drain(self, sock: zmq.Socket[bytes], decoder: EventDecoder) -> None:
        worker = self._socks[sock]
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for event in decoder.decode(frames[-1]).events:
                if isinstance(event, BlockStored):
                    self.counts.stored(worker, event.token_ids)

    def stop(self) -> None:
        """Reads what is still queued, then closes every socket."""
        self._stopping.set()
        self._thread.join()
        for sock in self._socks:
            sock.close()
        self._ctx.term()
