"""A Dynamo deployment's workers as the router's :class:`~kvpilot.routing.config.Worker` s,
read through Dynamo's own discovery client, with joins and departures picked up live.

Dynamo registers each worker as an *instance* of an endpoint (``namespace.component.endpoint``):
decode (or aggregated) workers of ``dynamo.backend.generate``, prefill workers of
``dynamo.prefill.generate`` by default (``dynamo.mocker``, ``dynamo.vllm``). Its Python
client (``dynamo._core``: ``DistributedRuntime(...).endpoint(path).client()``) watches
them on whichever backend the deployment uses (``file``: the directory in
``$DYN_FILE_KV``, ``etcd``, ``kubernetes``); :meth:`DynamoDiscovery.workers` maps its
current snapshot. Nothing of Dynamo's discovery is re-implemented here. Measured with
Dynamo 1.6.1's file backend: a worker stopped with SIGTERM is gone from the snapshot
within 0.2 s, one killed with SIGKILL within 10 s (its lease), a new one is in it within
0.5 s.

How an instance becomes a worker (:func:`worker_of`, pure):

- name ``<role>-<instance id in hex>`` (``decode-40c4d0cf81efebb0``); role prefill for
  the prefill endpoint, else decode (a fleet without prefill workers serves its
  decode workers as co-located ones);
- url: Dynamo's frontend (every request goes through it, naming the instance:
  :mod:`kvpilot.routing.serve.dynamo_upstream`);
- KV events: vLLM's ZMQ format, which ``dynamo.mocker`` (``--zmq-kv-events-ports``) and
  vLLM workers publish on a PUB socket they bind, so the router connects:
  ``tcp://<host>:<port>`` with the host of the instance's request-plane address
  (``127.0.0.1:36559/40c4d0cf81efebb0/dynamo/backend/generate``) and the port given by
  :class:`~kvpilot.routing.config.DynamoConfig`: that request-plane port plus
  ``kv_events_port_offset`` (``kvpilot fleet up --dynamo`` starts each worker with
  ``DYN_TCP_RPC_PORT`` pinned for this), or ``kv_events_port`` on every host; or, before
  both rules, the endpoint ``kv_events_endpoints`` names for the instance's id (workers
  in one process share its request-plane port: ``dynamo.mocker --num-workers``). With
  ``kv_replay_port_offset`` the port rule also gives each worker's replay socket
  (``dynamo.mocker --zmq-replay-ports``), from which a restarted router reads back what
  the workers hold. An
  address that does not read as ``host:port`` (Dynamo does not promise its format;
  a NATS request plane has none) leaves the worker without events: it is routed on
  load alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvpilot.routing.config import DynamoConfig, Role, Worker
from kvpilot.routing.fleet import Fleet, fleet_of
from kvpilot.routing.ids import WorkerId

log = logging.getLogger(__name__)

EVENTS_TOPIC = ""
"""Every topic: Dynamo's workers publish their vLLM-format events with an empty topic."""


def worker_name(role: Role, instance_id: int) -> WorkerId:
    return WorkerId(f"{role.value}-{instance_id:x}")


def request_plane_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a TCP instance address (``127.0.0.1:36559/<id>/<path>``),
    ``None`` when it does not read so."""
    host, sep, port = address.split("/", 1)[0].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def kv_events_endpoint(cfg: DynamoConfig, address: str) -> str | None:
    """Where the instance at request-plane ``address`` publishes vLLM KV events (see the
    module doc); ``None`` without a port rule or a readable address."""
    where = request_plane_address(address)
    if where is None or not (cfg.kv_events_port or cfg.kv_events_port_offset):
        return None
    host, port = where
    return _tcp_endpoint(host, cfg.kv_events_port or port + cfg.kv_events_port_offset)


def kv_replay_endpoint(cfg: DynamoConfig, address: str) -> str | None:
    """Where the instance at request-plane ``address`` serves its KV-event replay: its
    request-plane port plus ``kv_replay_port_offset``; ``None`` without it."""
    where = request_plane_address(address)
    if where is None or not cfg.kv_replay_port_offset:
        return None
    host, port = where
    return _tcp_endpoint(host, port + cfg.kv_replay_port_offset)


def _tcp_endpoint(host: str, port: int) -> str | None:
    """``tcp://host:port`` (an IPv6 host bracketed); ``None`` for a port out of range."""
    if not 0 < port < 65536:
        return None
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def worker_of(cfg: DynamoConfig, role: Role, instance_id: int, address: str) -> Worker:
    """The router's worker for one Dynamo instance (see the module doc)."""
    named = cfg.kv_events_endpoints.get(f"{instance_id:x}")
    events = named if named is not None else kv_events_endpoint(cfg, address)
    return Worker(
        name=worker_name(role, instance_id),
        role=role,
        url=cfg.frontend_url,
        kv_events_endpoint=events,
        replay_endpoint=kv_replay_endpoint(cfg, address) if named is None and events is not None else None,
        topic=EVENTS_TOPIC,
    )


class DynamoDiscovery:
    """Dynamo's discovery client on ``cfg``'s two endpoints (needs ``ai-dynamo-runtime``;
    an edge). Open it with :meth:`open` inside the router's event loop, read
    :meth:`workers`, :meth:`close` it once."""

    def __init__(self, cfg: DynamoConfig, runtime: Any, clients: dict[Role, Any]) -> None:
        self.cfg = cfg
        self._runtime = runtime
        self._clients = clients
        self._ids: dict[WorkerId, int] = {}

    @classmethod
    async def open(cls, cfg: DynamoConfig) -> DynamoDiscovery:
        """A client for ``cfg.discovery_backend`` (Dynamo reads the backend's own settings
        from its environment: ``DYN_FILE_KV``, ``ETCD_ENDPOINTS``, ...) and the request
        plane ``tcp``. Raises ImportError without ``ai-dynamo-runtime``."""
        from dynamo._core import DistributedRuntime

        runtime = DistributedRuntime(asyncio.get_running_loop(), cfg.discovery_backend.value, "tcp", event_plane="zmq")
        clients = {
            Role.DECODE: await runtime.endpoint(cfg.decode_endpoint).client(),
            Role.PREFILL: await runtime.endpoint(cfg.prefill_endpoint).client(),
        }
        return cls(cfg, runtime, clients)

    def workers(self) -> list[Worker]:
        """The instances registered now, as workers (prefill first); remembers their ids
        for :meth:`instance_id`."""
        found = [
            (role, instance.instance_id, instance.transport.address)
            for role in (Role.PREFILL, Role.DECODE)
            for instance in self._clients[role].instances()
        ]
        workers = [worker_of(self.cfg, role, iid, address) for role, iid, address in found]
        rule = self.cfg.kv_events_port or self.cfg.kv_events_port_offset or self.cfg.kv_events_endpoints
        for worker, (_, _, address) in zip(workers, found, strict=True):
            if rule and worker.kv_events_endpoint is None and worker.name not in self._ids:
                log.warning("worker %s: no KV-events endpoint from %r: routed on load alone", worker.name, address)
        self._ids = {w.name: iid for w, (_, iid, _) in zip(workers, found, strict=True)}
        return workers

    def instance_id(self, worker: WorkerId) -> int | None:
        """``worker``'s Dynamo instance id, ``None`` when it was not in the last snapshot."""
        return self._ids.get(worker)

    async def watch(self, apply: Callable[[Fleet], None]) -> None:
        """Every ``cfg.discovery_interval_s``: the discovered fleet, handed to ``apply``
        when it differs from the last one handed (the first at once). Runs until
        cancelled."""
        last: Fleet | None = None
        while True:
            fleet = fleet_of(self.workers())
            if fleet != last:
                apply(fleet)
                last = fleet
            await asyncio.sleep(self.cfg.discovery_interval_s)

    def close(self) -> None:
        self._runtime.shutdown()
