"""The thread that feeds the index: :class:`IndexFeeder` owns one
:class:`~kvpilot.routing.ingest.subscriber.EngineSubscriber` per worker with an events
endpoint and polls them in one background thread, which reads and decodes the events and
hands each change to the :class:`~kvpilot.routing.index.kvindex.KVIndex` to the thread that
owns it (the router's event loop), so the request path never waits on this thread.
Workers may join (:meth:`IndexFeeder.add`) and leave (:meth:`IndexFeeder.remove`)
while it runs. Each new subscriber is first caught up from its engine's replay buffer
(:meth:`~kvpilot.routing.ingest.subscriber.EngineSubscriber.catch_up`), so a restarted router
starts from what the engines hold, not from an empty index."""

from __future__ import annotations

import ctypes
import functools
import select
import threading
import time
from collections.abc import Callable

import zmq

from kvpilot.routing.config import Worker
from kvpilot.routing.fleet import Fleet
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.kvindex import KVIndex
from kvpilot.routing.ingest.subscriber import Deliver, EngineSubscriber

THREAD_NAME = "kvpilot-feeder"
"""The feeder thread's name, the operating system's too (``top -H``, ``/proc/PID/task/*/comm``)."""


def _name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` in the operating system too (Linux's ``prctl``, 15
    characters), where Python names only its own view of it; elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


SWEEP_S = 1.0
"""How often the feeder drains every subscriber, whether its socket woke it or not."""
MATCHED_RECENTLY_S = 1.0
"""How long after the index's last match the feeder still reads each batch as it arrives."""

PR_SET_NAME = 15
"""Linux's ``prctl`` option that names the calling thread."""


class IndexFeeder:
    """One subscriber per worker with events, polled by one daemon thread.

    The subscribers' sockets are created (and bound) in ``__init__``, so engines
    may connect as soon as it returns. Every change to ``index`` is handed to
    ``deliver``, which runs the changes in the order handed in the thread that owns the
    index (:meth:`~kvpilot.routing.index.queued.QueuedIndex.defer` or
    ``loop.call_soon_threadsafe``; ``None``: made at once in this thread, for an index no
    other thread reads); socket waits, replay fetches and decoding stay in this thread.
    :attr:`subscribers` is a snapshot any thread may read. :meth:`stop` joins the thread and
    closes the sockets; it is idempotent.

    ``bind``: whether each subscriber binds its endpoint (``None``: vLLM's rule,
    :func:`~kvpilot.routing.ingest.subscriber.subscriber_binds`; ``False`` for publishers that
    bind, as Dynamo's workers do).

    ``matches`` counts the index's matches so far; while it has not moved for
    :data:`MATCHED_RECENTLY_S`, the thread reads the sockets every ``idle_read_s`` instead of
    as each batch arrives (``None`` or 0: always as each arrives). Otherwise, after each pass
    that handed changes on, it calls ``read_now`` (the owner's prompt to apply them while it
    is idle, rather than inside its next decision; once a pass, not once a batch).
    """

    def __init__(
        self,
        fleet: Fleet,
        index: KVIndex,
        *,
        deliver: Deliver | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        poll_ms: int = 100,
        bind: bool | None = None,
        matches: Callable[[], int] | None = None,
        idle_read_s: float = 0.0,
        read_now: Callable[[], object] | None = None,
    ) -> None:
        self.index = index
        self._deliver = deliver
        self.poll_ms = poll_ms
        self._matches = matches
        self.idle_read_s = idle_read_s
        self._read_now = read_now
        self._context = context
        self._bind = bind
        self.subscribers: tuple[EngineSubscriber, ...] = ()
        """The subscribers polled now, replaced whole by the thread's turn (never changed in place)."""
        try:
            for worker in fleet.workers:
                if worker.kv_events_endpoint is not None:
                    self.subscribers += (self._subscriber(worker),)
        except zmq.ZMQError:
            for sub in self.subscribers:
                sub.close()
            raise
        self._lock = threading.Lock()
        """Guards :attr:`_pending`, the one thing callers and the thread share."""
        self._pending: list[EngineSubscriber | WorkerId] = []
        """Joins (a new subscriber) and departures (a name), in call order, for the
        thread's next turn."""
        self._changed = threading.Event()
        self.caught_up = threading.Event()
        """Set once the thread has caught every subscriber of the starting fleet up from its
        engine's replay buffer (:meth:`~kvpilot.routing.ingest.subscriber.EngineSubscriber.catch_up`)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _subscriber(self, worker: Worker) -> EngineSubscriber:
        assert worker.kv_events_endpoint is not None
        return EngineSubscriber(
            worker.name,
            worker.kv_events_endpoint,
            self.index,
            replay_endpoint=worker.replay_endpoint,
            topic=worker.topic,
            bind=self._bind,
            context=self._context,
            deliver=self._deliver,
        )

    def add(self, worker: Worker) -> None:
        """Read ``worker``'s KV events from the thread's next turn on (nothing without an
        events endpoint; a worker of that name still subscribed then keeps its
        subscriber). Raises ``zmq.ZMQError`` when its endpoint cannot be bound or
        connected."""
        if worker.kv_events_endpoint is not None:
            self._queue(self._subscriber(worker))

    def remove(self, worker: WorkerId) -> None:
        """Stop reading ``worker``'s events and forget its blocks in the index, at the
        thread's next turn, so no batch of the worker is applied after its entries are
        gone. Unknown workers: nothing to do."""
        self._queue(worker)

    def _queue(self, change: EngineSubscriber | WorkerId) -> None:
        with self._lock:
            self._pending.append(change)
        self._changed.set()
        if self._thread is None:  # nobody polls yet: apply it now
            self._apply_pending()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for sub in self.subscribers:
            sub.close()
        self.subscribers = ()

    def _apply_pending(self) -> None:
        """Apply the queued joins and departures in order (the thread's, between polls)."""
        closing: list[EngineSubscriber] = []
        with self._lock:
            pending, self._pending = self._pending, []
        subscribers = list(self.subscribers)
        for change in pending:
            if isinstance(change, EngineSubscriber):
                if any(s.worker == change.worker for s in subscribers):
                    closing.append(change)
                else:
                    subscribers.append(change)
            else:
                closing += [s for s in subscribers if s.worker == change]
                subscribers = [s for s in subscribers if s.worker != change]
                remove = functools.partial(self.index.remove_worker, change)
                if self._deliver is None:
                    remove()
                else:
                    self._deliver(remove)
        self.subscribers = tuple(subscribers)
        for sub in closing:
            sub.close()

    def _run(self) -> None:
        """Wait on every subscriber's :attr:`~EngineSubscriber.signal_fd` in one ``epoll`` and
        drain only the subscribers it names (libzmq's ``zmq_poll`` checks every socket on each
        of its many wakeups a batch); every :data:`SWEEP_S`, drain them all, so no batch waits
        on a missed edge longer than that. While the index's matches stand still, one
        pass every ``idle_read_s``."""
        _name_this_thread(THREAD_NAME)
        by_fd: dict[int, EngineSubscriber] = {}
        waiter = select.epoll()
        next_sweep = read_eagerly_until = 0.0
        last_matched = -1
        self._changed.set()
        try:
            while not self._stop.is_set():
                if self._changed.is_set():
                    self._changed.clear()
                    self._apply_pending()
                    current = self.subscribers
                    known = set(by_fd.values())
                    for sub in current:
                        if sub not in known:  # new: rebuild its entries from the replay buffer first
                            sub.catch_up()
                    self.caught_up.set()
                    waiter.close()
                    waiter, by_fd = select.epoll(), {sub.signal_fd: sub for sub in current}
                    for fd in by_fd:
                        waiter.register(fd, select.EPOLLIN)
                    for sub in current:  # batches queued before the waiter watched
                        sub.drain()
                if not by_fd:  # nothing to wait on: wait for a join (or the stop) instead
                    self._changed.wait(self.poll_ms / 1000)
                    continue
                ready = waiter.poll(self.poll_ms / 1000)
                now = time.monotonic()
                if now >= next_sweep:  # every subscriber, woken or not: no missed edge strands a batch
                    ready, next_sweep = [(fd, 0) for fd in by_fd], now + SWEEP_S
                read = sum(by_fd[fd].drain() for fd, _ in ready)  # each change handed to deliver
                eager = True
                if self._matches is not None and self.idle_read_s:
                    matched = self._matches()
                    if matched != last_matched:
                        last_matched, read_eagerly_until = matched, now + MATCHED_RECENTLY_S
                    eager = now < read_eagerly_until
                if read and eager and self._read_now is not None:
                    self._read_now()  # the owner applies them before its next decision needs them
                if not eager:  # nobody reads the index: one pass a period
                    self._stop.wait(self.idle_read_s)
        finally:
            waiter.close()
