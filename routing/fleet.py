"""The fleet as the router sees it, and the thread that feeds the index from it.

:func:`fleet_from_config` checks the ``workers`` section of the router config
(each :class:`~kvpilot.routing.config.Worker` checked itself when it was parsed) and groups
it into a :class:`Fleet` (errors name the worker and the field). A fleet that changes
while the router runs (Dynamo's discovery) is a new :class:`Fleet` each time
(:func:`fleet_of`); :func:`fleet_changes` says who joined and who left.
:func:`kv_events_config` is the ``--kv-events-config`` JSON an engine needs so
that it publishes to the endpoint the router binds. :class:`IndexFeeder` owns
one :class:`~kvpilot.routing.ingest.subscriber.EngineSubscriber` per worker with an events
endpoint and polls them in one background thread, applying events to the
shared :class:`~kvpilot.routing.index.kvindex.KVIndex` under a lock the request path shares.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.routing.config import ConfigError, Role, RouterConfig, Worker
from kvpilot.routing.ids import WorkerId


@dataclass(frozen=True, slots=True)
class Fleet:
    """Workers by role, in config order. From the config (:func:`fleet_from_config`):
    at least one decode or co-located worker, prefill workers only beside decode
    workers; a discovered fleet (:func:`fleet_of`) may lack either for a while."""

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


def fleet_of(workers: Iterable[Worker]) -> Fleet:
    """``workers`` grouped by role, in order, unchecked: a fleet discovered live
    (:mod:`kvpilot.routing.ingest.dynamo_discovery`) may for a while have no decode worker, or
    none at all; the router then answers 503 (no worker can decode)."""
    listed = tuple(workers)
    return Fleet(
        tuple(w for w in listed if w.role is Role.PREFILL),
        tuple(w for w in listed if w.role is Role.DECODE),
        tuple(w for w in listed if w.role is Role.COLOCATED),
    )


def fleet_changes(old: Fleet, new: Fleet) -> tuple[tuple[Worker, ...], tuple[Worker, ...]]:
    """(joined, left): the workers of ``new`` that ``old`` lacks, and those of ``old``
    that ``new`` lacks, by name; a worker whose description changed (its role, url or
    endpoints) has left and joined again."""
    before, after = {w.name: w for w in old.workers}, {w.name: w for w in new.workers}
    joined = tuple(w for name, w in after.items() if before.get(name) != w)
    left = tuple(w for name, w in before.items() if after.get(name) != w)
    return joined, left


def fleet_from_config(cfg: RouterConfig) -> Fleet:
    """Validate ``cfg.workers``; raises :class:`ConfigError` naming the worker and field.

    Beside Dynamo (``dynamo.frontend_url`` set) the workers come from Dynamo's discovery
    instead: ``workers`` must be empty, and the fleet starts empty."""
    if cfg.dynamo.enabled:
        if cfg.workers:
            raise ConfigError(
                "workers", "must be empty when dynamo.frontend_url is set: the workers come from Dynamo's discovery"
            )
        return fleet_of(())
    if cfg.server.workers_file:
        if cfg.workers:
            raise ConfigError("workers", "must be empty when server.workers_file is set: the workers come from it")
        return fleet_of(())
    return checked_fleet(cfg.workers)


def checked_fleet(listed: Iterable[Worker], where: str = "workers") -> Fleet:
    """``listed`` as a fleet, checked: unique names and event endpoints, a decode or co-located
    worker, a decode worker beside any prefill one; raises :class:`ConfigError` naming the
    entry (``<where>[i]``) and field."""
    workers: list[Worker] = []
    seen: set[str] = set()
    endpoints: set[str] = set()
    for i, worker in enumerate(listed):
        entry = f"{where}[{i}]"
        if worker.name in seen:
            raise ConfigError(f"{entry}.name", f"{worker.name!r} is used twice")
        seen.add(worker.name)
        for endpoint in (worker.kv_events_endpoint, worker.replay_endpoint):
            if endpoint is not None:
                if endpoint in endpoints:
                    raise ConfigError(entry, f"endpoint {endpoint} is used twice")
                endpoints.add(endpoint)
        workers.append(worker)
    fleet = fleet_of(workers)
    if fleet.prefill and not fleet.decode:
        raise ConfigError(where, "with role prefill need at least one decode worker")
    if not (fleet.decode or fleet.colocated):
        raise ConfigError(where, "must include at least one decode or colocated worker")
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
