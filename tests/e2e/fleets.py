"""Starting and stopping fleets from tests, the one fleet that modules share, and the
changes a test makes to a running fleet (a router replica, Envoy's hot restart, a Dynamo
worker joining or leaving)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.dynamo_spec import WORKER_HEALTH, DynamoFleetSpec, worker_plan
from kvpilot.deploy.envoy_spec import GatewaySpec
from kvpilot.deploy.fleet_spec import HOST, FleetSpec, plan_fleet
from kvpilot.routing.config import Role

START_TIMEOUT_S = 600.0


@contextmanager
def running_fleet(spec: FleetSpec) -> Iterator[fleet_io.Fleet]:
    started = fleet_io.up(spec, timeout=START_TIMEOUT_S)
    try:
        yield started
    finally:
        fleet_io.down(spec.run_dir)


def _where(spec: FleetSpec) -> dict[str, object]:
    """The fields that say where a fleet runs, not what it runs."""
    return {
        "run_dir": spec.run_dir,
        "engine_port": spec.engine_port,
        "side_channel_port": spec.side_channel_port,
        "events_port": spec.events_port,
        "router_port": spec.router_port,
    }


class SharedFleet:
    """At most one fleet at a time, kept up across the modules that ask for the same one.

    :meth:`get` returns the running fleet when it runs what ``spec`` asks for (wherever it
    runs: its run directory and ports are those of the module that started it) and every
    process of it answers its health check, else stops it and starts ``spec``. A module
    that shares must leave the fleet as it found it (a module that stops an engine runs
    last in its group) and use its own prompts; a module that starts its own fleet calls
    :meth:`stop` first (``tests/e2e/conftest.py`` does).
    """

    def __init__(self) -> None:
        self._spec: FleetSpec | None = None
        self._fleet: fleet_io.Fleet | None = None

    def get(self, spec: FleetSpec) -> tuple[FleetSpec, fleet_io.Fleet]:
        """The running fleet and the spec it was started from (for restarts)."""
        current, running = self._spec, self._fleet
        if (
            current is not None
            and running is not None
            and dataclasses.replace(spec, **_where(current)) == current
            and all(fleet_io.is_healthy(p.url, path=p.health) for p in running.processes)
        ):
            return current, running
        self.stop()
        self._fleet = fleet_io.up(spec, timeout=START_TIMEOUT_S)
        self._spec = spec
        return spec, self._fleet

    def stop(self) -> None:
        if self._spec is not None:
            fleet_io.down(self._spec.run_dir)
        self._spec, self._fleet = None, None


def _recorded(run_dir: Path) -> fleet_io.Fleet:
    fleet = fleet_io.Fleet.load(run_dir)
    assert fleet is not None, f"no fleet recorded in {run_dir}"
    return fleet


def start_router(
    spec: FleetSpec, name: str, port: int, flags: Sequence[str] = (), timeout: float = 120.0
) -> fleet_io.RunningProcess:
    """Another router process over the fleet recorded in ``spec.run_dir`` (a replica: the
    fleet's router config on ``port`` with extra ``flags``), returned once healthy and not
    recorded: the caller stops it. Its engines must bind their KV-event endpoints
    (``spec.kv_events_ipc``), or the replica cannot subscribe."""
    assert spec.kv_events_ipc, "a router replica needs engines that bind their KV-event endpoints"
    return fleet_io.start_replica(plan_fleet(spec)[1], spec.run_dir / "logs", name, port, flags, timeout)


def _envoy_epoch(admin_port: int) -> tuple[str, int]:
    """The live Envoy's state and hot-restart epoch, from ``/server_info`` on its admin port."""
    with urllib.request.urlopen(f"http://{HOST}:{admin_port}/server_info", timeout=2) as resp:
        info = json.loads(resp.read())
    return info["state"], int(info["command_line_options"]["restart_epoch"])


def restart_gateway(run_dir: Path, gateway: GatewaySpec, timeout: float = 60.0) -> int:
    """Hot-restart the Envoy of the fleet recorded in ``run_dir`` as an operator does: a
    SIGHUP to its restarter (:mod:`kvpilot.deploy.envoy_restarter`), which starts the next
    epoch; the old Envoy serves the streams it holds for up to ``gateway.drain_s``. Returns
    the new epoch once its Envoy is live and ``/health`` passes through it."""
    fleet = _recorded(run_dir)
    assert fleet.gateway is not None, f"no Envoy recorded in {run_dir}"
    epoch = _envoy_epoch(gateway.admin_port)[1] + 1
    os.kill(fleet.gateway.pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _envoy_epoch(gateway.admin_port) == ("LIVE", epoch):
                break
        except (OSError, ValueError, KeyError):
            pass  # the admin port moves to the new Envoy with the listeners
        time.sleep(0.2)
    else:
        raise AssertionError(f"Envoy of epoch {epoch} was not live within {timeout} s")
    assert fleet_io.is_healthy(fleet.gateway.url), f"Envoy of epoch {epoch} is live but /health does not pass"
    return epoch


def join_worker(spec: DynamoFleetSpec, role: Role, timeout: float = 60.0) -> fleet_io.RunningProcess:
    """Start one more Dynamo worker of ``role`` in the fleet recorded in ``spec.run_dir``,
    with the next index and ordinal (ports) after those the spec planned and those
    recorded; returned once healthy, recorded in ``fleet.json``."""
    fleet = _recorded(spec.run_dir)
    workers = [e for e in fleet.engines if e.role]
    ordinals = [w.side_ports[0] - spec.worker_port for w in workers]  # from its request-plane port
    ordinal = 1 + max([len(spec.roles) - 1, *ordinals])  # never the ports of a worker the spec planned
    indices = [int(w.name.rsplit("-", 1)[1]) for w in workers if w.role == role.value]
    index = 1 + max([spec.roles.count(role) - 1, *indices])
    joined = fleet_io.start(worker_plan(spec, role, index, ordinal), spec.run_dir / "logs", timeout, WORKER_HEALTH)
    dataclasses.replace(fleet, engines=(*fleet.engines, joined)).save()
    return joined


def leave_worker(run_dir: Path, name: str) -> fleet_io.RunningProcess:
    """Stop Dynamo worker ``name`` (SIGTERM: it leaves Dynamo's discovery at once) and drop
    it from ``fleet.json``."""
    fleet = _recorded(run_dir)
    (proc,) = [e for e in fleet.engines if e.name == name]
    fleet_io.stop_group(proc.pid)
    dataclasses.replace(fleet, engines=tuple(e for e in fleet.engines if e.name != name)).save()
    return proc
