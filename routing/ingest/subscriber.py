"""The ZMQ edge: one engine's KV events into the index, with gap and restart handling.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) sends each
batch as three frames ``(topic, seq as 8-byte big-endian, msgpack payload)``
from a PUB socket. It *binds* endpoints with ``*``/``::`` and ``ipc://`` /
``inproc://`` ones, and *connects* to any other ``tcp://host:port``, in which
case this subscriber must bind (:func:`subscriber_binds`). Its replay socket is
a ROUTER that always binds: a client sends ``(b"", start_seq as 8 bytes)`` and
receives ``(b"", topic, seq, payload)`` for each buffered batch with
``seq >= start_seq``, then the end marker ``(b"", b"", seq=-1, b"")``.

Sequencing, per engine:

- :meth:`EngineSubscriber.catch_up` (the feeder calls it once per subscriber, before
  polling it) fetches every batch the engine still buffers, from seq 0, and applies
  it: a router (re)started beside running engines rebuilds each worker's entries
  before any new event arrives, so a session's next step is priced from what D
  already holds. Live copies of those batches that were queued meanwhile are
  recognised (same seq, same payload) and skipped;
- the first batch, or one after a restart, is expected at seq 0 (a subscriber that
  did not catch up recovers the batches before it from the replay buffer);
- a jump ahead is a *gap*: the missing batches are fetched from the replay
  socket and applied in order before the batch that revealed the gap; if the
  buffer no longer has them (or replay times out) the gap is *unrecoverable*
  and the worker's entries are cleared (the index would otherwise keep blocks
  the engine evicted), then whatever was recovered is applied;
- a seq at or below the last one is an engine *restart*: the worker's entries
  are cleared before the new batch is applied.

Not thread-safe: call :meth:`EngineSubscriber.poll` from one thread; its changes to the
index reach the index's owner through ``deliver``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.events import BlockStored, EventDecoder
from kvpilot.routing.index.kvindex import KVIndex

END_SEQ = (-1).to_bytes(8, "big", signed=True)

Deliver = Callable[[Callable[[], object]], object]
"""Hands a change to the index to the thread that owns it, which runs the changes in the order
handed (``loop.call_soon_threadsafe``)."""


def _at_once(change: Callable[[], object]) -> None:
    change()


def subscriber_binds(engine_endpoint: str) -> bool:
    """True when vLLM's publisher will connect to ``engine_endpoint`` (so we bind)."""
    engine_binds = (
        "*" in engine_endpoint or "::" in engine_endpoint or engine_endpoint.startswith(("ipc://", "inproc://"))
    )
    return not engine_binds


@dataclass
class SubscriberStats:
    batches: int = 0
    replayed: int = 0
    replayed_blocks: int = 0
    """Blocks stored by the replayed batches (what a restarted router learned from replay)."""
    gaps: int = 0
    unrecoverable_gaps: int = 0
    restarts: int = 0
    bad_frames: int = 0


MAX_SEQ_JUMP = 1 << 20
"""A sequence number further ahead than this is a bad frame, not a gap."""


class EngineSubscriber:
    """Subscribes to one engine's KV events and applies them to ``index`` as ``worker``."""

    def __init__(
        self,
        worker: WorkerId,
        endpoint: str,
        index: KVIndex,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool | None = None,
        decoder: EventDecoder | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        replay_timeout_s: float = 1.0,
        deliver: Deliver | None = None,
    ) -> None:
        """``deliver`` is handed each change to ``index`` (a batch's apply, a worker's
        clearing) and runs the changes in the order handed, in the thread that owns the
        index (the router's event loop: ``loop.call_soon_threadsafe``); ``None`` makes
        each change at once in the calling thread. Socket waits, replay fetches and
        decoding stay in the calling thread."""
        self.worker = worker
        self._deliver: Deliver = deliver if deliver is not None else _at_once
        self.index = index
        self.decoder = decoder if decoder is not None else EventDecoder()
        self.stats = SubscriberStats()
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.LINGER, 0)
        if subscriber_binds(endpoint) if bind is None else bind:
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._last_seq: int | None = None
        self._caught_up: dict[int, bytes] = {}
        """The batches :meth:`catch_up` applied, by seq, until a live batch beyond them arrives."""

    @property
    def signal_fd(self) -> int:
        """libzmq's ``ZMQ_FD`` of the SUB socket: readable when the socket's state may have
        changed (an edge, not a level: after it turns readable, :meth:`drain` until it says
        nothing is left). For an ``epoll`` that waits on many subscribers at once."""
        return int(self._sub.getsockopt(zmq.FD))

    def poll(self, timeout_ms: int = 0) -> int:
        """Wait up to ``timeout_ms`` for events, then apply all that are queued; returns how many."""
        if not self._sub.poll(timeout_ms):
            return 0
        return self.drain()

    def drain(self) -> int:
        """Apply every batch queued now, without waiting, until the socket reports none
        (``ZMQ_EVENTS``, which also rearms :attr:`signal_fd`); returns how many."""
        handled, rechecked = 0, False
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if rechecked or not int(self._sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return handled
                rechecked = True  # once a message: a socket that says POLLIN and reads nothing is left
                continue
            handled, rechecked = handled + 1, False
            self._on_frames(frames)

    def close(self) -> None:
        self._sub.close(linger=0)

    def catch_up(self) -> int:
        """Fetch and apply every batch the engine's replay buffer still holds (from seq 0);
        returns how many. Only before the first batch (else, and without a replay
        endpoint, 0). A buffer that no longer starts at seq 0 (it rolled over) is counted as
        an unrecoverable gap: the entries of blocks stored before it stay unknown until
        they are stored again (under-credited, never wrongly credited). Replay I/O runs
        in the calling thread, as in :meth:`poll`."""
        if self.replay_endpoint is None or self._last_seq is not None:
            return 0
        recovered = self._replay(0, MAX_SEQ_JUMP)
        if recovered and recovered[0][0] != 0:
            self.stats.unrecoverable_gaps += 1
        for seq, payload in recovered:
            self._apply_replayed(seq, payload)
        self._caught_up = dict(recovered)
        return len(recovered)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.bad_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if seq - (0 if self._last_seq is None else self._last_seq) > MAX_SEQ_JUMP:
            self.stats.bad_frames += 1  # no engine skips a million batches: a corrupt or forged frame
            return
        if self._caught_up:
            if self._caught_up.get(seq) == frames[2]:
                return  # a live copy of a batch catch_up applied
            self._caught_up = {}
        last = self._last_seq
        if last is not None and seq <= last:
            self.stats.restarts += 1
            self._deliver(functools.partial(self.index.clear_worker, self.worker))
            last = self._last_seq = None
        expected = 0 if last is None else last + 1
        if seq > expected:
            self.stats.gaps += 1
            recovered = self._replay(expected, seq)  # I/O, in this thread
            if [s for s, _ in recovered] != list(range(expected, seq)):  # bounded by MAX_SEQ_JUMP
                self.stats.unrecoverable_gaps += 1
                if last is not None:
                    self._deliver(functools.partial(self.index.clear_worker, self.worker))
            for rseq, payload in recovered:
                self._apply_replayed(rseq, payload)
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> int:
        """Apply one batch; returns the blocks it stored."""
        batch = self.decoder.decode(payload)
        prepared = self.index.prepare(batch.events)  # the hashing that needs no index state, in this thread
        self._deliver(functools.partial(self.index.apply_prepared, self.worker, prepared))
        self.stats.batches += 1
        self._last_seq = seq
        return sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))

    def _apply_replayed(self, seq: int, payload: bytes) -> None:
        self.stats.replayed_blocks += self._apply(seq, payload)
        self.stats.replayed += 1

    def _replay(self, start: int, stop: int) -> list[tuple[int, bytes]]:
        """Batches ``start <= seq < stop`` the engine still buffers, in order (maybe none)."""
        if self.replay_endpoint is None:
            return []
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: dict[int, bytes] = {}
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not dealer.poll(left_ms):
                    break
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.stats.bad_frames += 1
                    continue
                if frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big")
                if start <= seq < stop:
                    out[seq] = frames[3]
        finally:
            dealer.close(linger=0)
        return sorted(out.items())
