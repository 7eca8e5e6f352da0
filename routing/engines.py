"""The fleet as the router sees it, and the thread that feeds the index from it.

:func:`fleet_from_config` checks the ``workers`` section of the router config
(each :class:`~routing.config.Worker` checked itself when it was parsed) and groups
it into a :class:`Fleet` (errors name the worker and the field).
:func:`kv_events_config` is the ``--kv-events-config`` JSON an engine needs so
that it publishes to the endpoint the router binds. :class:`IndexFeeder` owns
one :class:`~routing.subscriber.EngineSubscriber` per worker with an events
endpoint and polls them in one background thread, applying events to the
shared :class:`~routing.index.KVIndex` under a lock the request path shares.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import zmq

from routing.config import ConfigError, Role, RouterConfig, Worker
from routing.index import KVIndex, WorkerId
from routing.subscriber import EngineSubscriber


@dataclass(frozen=True, slots=True)
class Fleet:
    """Workers by role, in config order. At least one decode or co-located worker;
    prefill workers only beside decode workers."""

    prefill: tuple[Worker, ...]
    decode: tuple[Worker, ...]
    colocated: tuple[Worker, ...]

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.prefill + self.decode + self.colocated

    def by_name(self, name: WorkerId) -> Worker:
        """The worker called ``name``; raises KeyError if there is none."""
        for worker in self.workers:
            if worker.name == name:
                return worker
        raise KeyError(name)


def fleet_from_config(cfg: RouterConfig) -> Fleet:
    """Validate ``cfg.workers``; raises :class:`ConfigError` naming the worker and field."""
    workers: list[Worker] = []
    seen: set[str] = set()
    endpoints: set[str] = set()
    for i, worker in enumerate(cfg.workers):
        where = f"workers[{i}]"
        if worker.name in seen:
            raise ConfigError(f"{where}.name {worker.name!r} is used twice")
        seen.add(worker.name)
        for endpoint in (worker.kv_events_endpoint, worker.replay_endpoint):
            if endpoint is not None:
                if endpoint in endpoints:
                    raise ConfigError(f"{where}: endpoint {endpoint} is used twice")
                endpoints.add(endpoint)
        workers.append(worker)
    fleet = Fleet(
        tuple(w for w in workers if w.role is Role.PREFILL),
        tuple(w for w in workers if w.role is Role.DECODE),
        tuple(w for w in workers if w.role is Role.COLOCATED),
    )
    if fleet.prefill and not fleet.decode:
        raise ConfigError("workers with role prefill need at least one decode worker")
    if not (fleet.decode or fleet.colocated):
        raise ConfigError("workers must include at least one decode or colocated worker")
    return fleet


def kv_events_config(worker: Worker) -> str:
    """The engine's ``--kv-events-config`` JSON for ``worker`` (raises ValueError without
    an events endpoint). A ``tcp://host:port`` endpoint makes the engine connect to the
    router, which binds it; the replay endpoint is bound by the engine."""
    if worker.kv_events_endpoint is None:
        raise ValueError(f"worker {worker.name} has no kv_events_endpoint")
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": worker.kv_events_endpoint,
        "topic": worker.topic,
    }
    if worker.replay_endpoint is not None:
        config["replay_endpoint"] = worker.replay_endpoint
    return json.dumps(config)


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
