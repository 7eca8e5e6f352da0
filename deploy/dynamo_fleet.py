"""Start a Dynamo fleet beside the router, and let workers join and leave it: the
process side of :mod:`deploy.dynamo_spec`.

``up`` clears ``<run_dir>/discovery``, starts the workers (each in its own process
group, logs in ``<run_dir>/logs``), waits for their system servers, then the frontend, then
the router, and waits until the router's ``/health`` lists every worker (its discovery
has found them). When the frontend routes on its own (``spec.frontend_routing`` not
direct: the fleet benchmark's Dynamo arms) no kvpilot router starts: the frontend waits
for every worker itself and is recorded as the fleet's router. It records everything in ``<run_dir>/fleet.json`` as
:func:`deploy.fleet.up` does, so ``kvpilot fleet status`` and ``kvpilot fleet down``
(:func:`deploy.fleet.down`) work unchanged. On any failure it stops what it started and
raises :class:`~deploy.fleet.FleetStartError`. :func:`join_worker` and
:func:`leave_worker` start one more worker or stop one, live.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from deploy.dynamo_spec import FRONTEND_HEALTH, WORKER_HEALTH, DynamoFleetSpec, plan_dynamo_fleet, worker_plan
from deploy.fleet import (
    Fleet,
    FleetStartError,
    RunningProcess,
    _sigterm_as_interrupt,
    _spawn,
    _wait_healthy,
    port_is_free,
    stop_group,
)
from deploy.fleet_spec import HOST, ROUTER_CONFIG, PortCollision, ProcessPlan
from routing.config import Role

Started = tuple[subprocess.Popen[bytes], RunningProcess]


def router_workers(router_url: str) -> list[str]:
    """The workers the router serves now (its ``/health``); empty when unreachable."""
    try:
        with urllib.request.urlopen(f"{router_url}/health", timeout=2) as resp:
            return list(json.loads(resp.read())["workers"])
    except (OSError, ValueError, KeyError):
        return []


def wait_for_workers(router_url: str, done: Callable[[list[str]], bool], timeout: float = 30.0) -> list[str]:
    """The router's workers once ``done(workers)``; raises TimeoutError naming them."""
    deadline = time.monotonic() + timeout
    while True:
        workers = router_workers(router_url)
        if done(workers):
            return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router's workers after {timeout:.0f} s: {workers}")
        time.sleep(0.2)


def frontend_models(frontend_url: str) -> list[str]:
    """The models the frontend serves now (its ``/v1/models``); empty when unreachable."""
    try:
        with urllib.request.urlopen(f"{frontend_url}/v1/models", timeout=2) as resp:
            return [str(m["id"]) for m in json.loads(resp.read())["data"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def wait_for_frontend(frontend_url: str, model: str, timeout: float) -> None:
    """Until the frontend serves ``model``: its router is up over the workers it waited
    for (``--router-min-initial-workers``, :func:`deploy.dynamo_spec.frontend_plan`).
    Raises TimeoutError."""
    deadline = time.monotonic() + timeout
    while model not in frontend_models(frontend_url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the frontend did not serve {model!r} within {timeout:.0f} s")
        time.sleep(0.2)


def up(spec: DynamoFleetSpec, timeout: float = 120.0, progress: Callable[[str], object] = print) -> Fleet:
    """Start the fleet (see the module doc) and return it once the router serves every
    worker. Raises :class:`FleetStartError` if a fleet is recorded in ``spec.run_dir``, a
    port is taken, a process dies or is not ready within ``timeout`` seconds."""
    if Fleet.load(spec.run_dir) is not None:
        raise FleetStartError(f"a fleet is already recorded in {spec.run_dir}; run `kvpilot fleet down` first")
    try:
        workers, frontend, router, config = plan_dynamo_fleet(spec)
    except PortCollision as exc:
        raise FleetStartError(str(exc)) from None
    busy = [port for p in (*workers, frontend, router) for port in (p.port, *p.side_ports) if not port_is_free(port)]
    if busy:
        raise FleetStartError(f"ports already in use on {HOST}: {busy}")
    shutil.rmtree(spec.discovery_dir, ignore_errors=True)  # no instance of an earlier fleet lingers
    spec.discovery_dir.mkdir(parents=True)
    logs = spec.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / ROUTER_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    started: list[Started] = []
    with _sigterm_as_interrupt():
        try:
            t0 = time.monotonic()
            started += [_spawn(plan, logs, WORKER_HEALTH) for plan in workers]
            _wait_healthy(started, t0 + timeout)
            progress(f"  {len(workers)} mocker workers healthy after {time.monotonic() - t0:.1f} s")
            started.append(_spawn(frontend, logs, FRONTEND_HEALTH))
            _wait_healthy(started[-1:], time.monotonic() + timeout)
            progress(f"  Dynamo frontend ({spec.frontend_routing.value} mode) on {frontend.url}")
            if spec.kvpilot_routes:
                started.append(_spawn(router, logs))
                _wait_healthy(started[-1:], time.monotonic() + timeout)
                wait_for_workers(router.url, lambda names: len(names) == len(workers), timeout)
                progress(f"  router on {router.url}, serving {len(workers)} workers from Dynamo's discovery")
            else:
                wait_for_frontend(frontend.url, spec.served_model_name, timeout)
                progress(f"  the frontend routes over its {len(workers)} workers (no kvpilot router)")
        except TimeoutError as exc:
            _stop_all(started)
            raise FleetStartError(f"the fleet's router did not find every worker: {exc}") from None
        except BaseException as exc:
            _stop_all(started)
            if isinstance(exc, KeyboardInterrupt):
                raise FleetStartError("interrupted while starting; every process started was stopped") from None
            raise
    running = [r for _, r in started]
    fleet = Fleet(spec.run_dir, tuple(running[:-1]), running[-1])
    fleet.save()
    return fleet


def _stop_all(started: list[Started]) -> None:
    for proc, _ in reversed(started):
        stop_group(proc.pid)


def join_worker(spec: DynamoFleetSpec, role: Role, timeout: float = 60.0) -> RunningProcess:
    """Start one more worker of ``role`` in the fleet recorded in ``spec.run_dir``, with
    the next index and ordinal (ports) after those the spec planned and those recorded;
    returns it once healthy, recorded in ``fleet.json``. Raises :class:`FleetStartError`
    if it does not come up."""
    fleet = _recorded(spec.run_dir)
    workers = [e for e in fleet.engines if e.role]
    ordinals = [w.side_ports[0] - spec.worker_port for w in workers]  # from its request-plane port
    ordinal = 1 + max([len(spec.roles) - 1, *ordinals])  # never the ports of a worker the spec planned
    indices = [int(w.name.rsplit("-", 1)[1]) for w in workers if w.role == role.value]
    index = 1 + max([spec.roles.count(role) - 1, *indices])
    plan: ProcessPlan = worker_plan(spec, role, index, ordinal)
    proc, info = _spawn(plan, spec.run_dir / "logs", WORKER_HEALTH)
    try:
        _wait_healthy([(proc, info)], time.monotonic() + timeout)
    except BaseException:
        stop_group(proc.pid)
        raise
    dataclasses.replace(fleet, engines=(*fleet.engines, info)).save()
    return info


def leave_worker(run_dir: Path, name: str) -> RunningProcess:
    """Stop worker ``name`` (SIGTERM: it leaves Dynamo's discovery at once) and drop it
    from ``fleet.json``. Raises KeyError for an unknown name."""
    fleet = _recorded(run_dir)
    proc = next((e for e in fleet.engines if e.name == name), None)
    if proc is None:
        raise KeyError(f"no worker named {name!r} in {run_dir}")
    stop_group(proc.pid)
    dataclasses.replace(fleet, engines=tuple(e for e in fleet.engines if e.name != name)).save()
    return proc


def _recorded(run_dir: Path) -> Fleet:
    fleet = Fleet.load(run_dir)
    if fleet is None:
        raise FleetStartError(f"no fleet recorded in {run_dir}")
    return fleet
