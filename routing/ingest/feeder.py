"""The thread that feeds the index: :class:`IndexFeeder` owns one
:class:`~routing.ingest.subscriber.EngineSubscriber` per worker with an events
endpoint and polls them in one background thread, applying events to the shared
:class:`~routing.index.kvindex.KVIndex` under a lock the request path shares."""

from __future__ import annotations

import threading

import zmq

from routing.fleet import Fleet
from routing.index.kvindex import KVIndex
from routing.ingest.subscriber import EngineSubscriber


class IndexFeeder:
    """One subscriber per worker with events, polled by one daemon thread.

    The subscribers' sockets are created (and bound) in ``__init__``, so engines
    may connect as soon as it returns. Every change to ``index`` is made while
    holding ``lock``, and only the change: socket waits and replay fetches run
    without it, so a reader holding it (the router's event loop) never waits on
    I/O. Readers of ``index`` must hold it too. :meth:`stop` joins the
    thread and closes the sockets; it is idempotent.
    """

    def __init__(
        self,
        fleet: Fleet,
        index: KVIndex,
        lock: threading.Lock,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        poll_ms: int = 100,
    ) -> None:
        self.index = index
        self.lock = lock
        self.poll_ms = poll_ms
        self.subscribers: list[EngineSubscriber] = []
        try:
            for worker in fleet.workers:
                if worker.kv_events_endpoint is not None:
                    self.subscribers.append(
                        EngineSubscriber(
                            worker.name,
                            worker.kv_events_endpoint,
                            index,
                            replay_endpoint=worker.replay_endpoint,
                            topic=worker.topic,
                            context=context,
                            guard=lock,
                        )
                    )
        except zmq.ZMQError:
            for sub in self.subscribers:
                sub.close()
            raise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self.subscribers:
            self._thread = threading.Thread(target=self._run, name="kvpilot-index-feeder", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for sub in self.subscribers:
            sub.close()
        self.subscribers = []

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket = {}
        for sub in self.subscribers:
            poller.register(sub.socket, zmq.POLLIN)
            by_socket[sub.socket] = sub
        while not self._stop.is_set():
            for sock, _ in poller.poll(self.poll_ms):
                by_socket[sock].poll(0)  # takes the lock around each apply
