"""Start a Dynamo fleet beside the router: the process side of
:mod:`kvpilot.deploy.dynamo_spec`.

``up`` clears ``<run_dir>/discovery``, starts the workers (each in its own process
group, logs in ``<run_dir>/logs``), waits for their system servers, then the frontend, then
the router, and waits until the router's ``/health`` lists every worker (its discovery
has found them). When the frontend routes on its own (``spec.frontend_routing`` not
direct: the fleet benchmark's Dynamo arms) no kvpilot router starts: the frontend waits
for every worker itself and is recorded as the fleet's router. It records everything in ``<run_dir>/fleet.json`` as
:func:`kvpilot.deploy.fleet.up` does, so ``kvpilot fleet status`` and ``kvpilot fleet down``
(:func:`kvpilot.deploy.fleet.down`) work unchanged. On any failure it stops what it started and
raises :class:`~kvpilot.deploy.fleet.FleetStartError`. :func:`restart_router` restarts
the router (the picker) alone.

:func:`up_one_process` is the scale benchmark's fleet: every aggregated worker in one
``dynamo.mocker`` process (:func:`kvpilot.deploy.dynamo_spec.mocker_group_plan`), the frontend
in direct mode, optionally a second frontend running Dynamo's own router on the same
workers, and the router, told each instance's KV-event endpoint by
:func:`map_kv_events` (the workers share one request-plane port, so no port rule can).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from ctypes import c_double
from pathlib import Path
from typing import Any

import yaml
import zmq

from kvpilot.deploy.dynamo_spec import (
    FRONTEND_HEALTH,
    WORKER_HEALTH,
    DynamoFleetSpec,
    FrontendRouting,
    frontend_plan,
    mocker_group_plan,
    plan_dynamo_fleet,
    router_config,
    router_plan,
)
from kvpilot.deploy.envoy_spec import GatewaySpec
from kvpilot.deploy.fleet import (
    Fleet,
    FleetStartError,
    RunningProcess,
    _replace,
    _sigterm_as_interrupt,
    _spawn,
    _wait_healthy,
    port_is_free,
    start_gateway,
    stop_group,
)
from kvpilot.deploy.fleet_spec import HOST, ROUTER_CONFIG, PortCollision, ProcessPlan, envoy_plan
from kvpilot.routing.config import CostObjective, Role, RouterConfig
from kvpilot.routing.config_load import load_config
from kvpilot.routing.index.events import BlockStored, EventDecoder
from kvpilot.routing.native import CostConfig
from kvpilot.routing.serve.request_fields import ACCEPTED, NVEXT
from kvpilot.routing.serve.upstream import Api

Started = tuple[subprocess.Popen[bytes], RunningProcess]


def router_workers(router_url: str) -> list[str]:
    """The workers the router serves now (its ``/health``); empty when unreachable."""
    try:
        with urllib.request.urlopen(f"{router_url}/health", timeout=2) as resp:
            return list(json.loads(resp.read())["workers"])
    except (OSError, ValueError, KeyError):
        return []


def native_picker_config(router_url: str, frontend: str, config: RouterConfig) -> str:
    """The compiled picker's config for the fleet the router serves now (its ``/debug/fleet``,
    from the router's host): :func:`native_picker_lines`."""
    with urllib.request.urlopen(f"{router_url}/debug/fleet", timeout=5) as resp:
        fleet = json.loads(resp.read())
    libzmq = next((Path(zmq.__file__).parent.parent / "pyzmq.libs").glob("libzmq*.so*"), None)
    if libzmq is None:
        raise FleetStartError("the compiled picker needs pyzmq's bundled libzmq (pyzmq.libs/libzmq*.so)")
    return "\n".join(native_picker_lines(fleet, frontend, config, libzmq))


def with_native_picker(spec: DynamoFleetSpec, gateway: GatewaySpec, router_url: str) -> GatewaySpec:
    """``gateway`` with the compiled picker for the fleet the router at ``router_url`` serves,
    priced with the router config written in ``spec.run_dir``, sending to ``spec``'s frontend."""
    config = load_config(spec.run_dir / ROUTER_CONFIG)
    return dataclasses.replace(
        gateway, native_picker=native_picker_config(router_url, f"{HOST}:{spec.frontend_port}", config)
    )


def field_lines() -> list[str]:
    """The compiled picker's ``field`` lines: the top-level fields a completions body it
    decides may carry (:data:`~kvpilot.routing.serve.request_fields.ACCEPTED`, less ``nvext``,
    whose contents the Python picker checks); a body with any other goes on to the Python
    picker, which refuses it by name or reads it."""
    return [f"field {name}" for name in sorted(ACCEPTED[Api.COMPLETIONS] - {NVEXT})]


def native_picker_lines(fleet: Mapping[str, Any], frontend: str, config: RouterConfig, libzmq: Path) -> list[str]:
    """The compiled picker's config lines (``routing/native/README.md``) for ``fleet`` (the
    router's ``/debug/fleet`` answer): each worker by its Dynamo instance id, subscribed to its
    KV events (the mocker binds them), every request sent to ``frontend`` (``host:port``)
    naming its instance, priced with the router's ``cost`` and ``sessions`` settings. Raises
    FleetStartError for a worker it cannot reach, a disaggregated fleet, or settings it does not
    price."""
    cost = config.cost
    if cost.objective is not CostObjective.BLOCKS or cost.router_temperature != 0:
        raise FleetStartError("the compiled picker prices cost.objective 'blocks' at cost.router_temperature 0 only")
    if any(worker["role"] == Role.PREFILL.value for worker in fleet["workers"]):
        raise FleetStartError("the compiled picker places co-located workers only: this fleet has prefill workers")
    lines = [f"block_size {fleet['block_size']}", f"libzmq {libzmq}", f"dynamo_frontend {frontend}", *field_lines()]
    lines.append(f"model {config.server.model_name}")  # another model (a LoRA adapter) is the Python picker's
    priced = [name for name, kind, *_ in CostConfig._fields_ if kind is c_double]
    lines += [f"cost.{name} {float(getattr(cost, name))!r}" for name in priced]
    lines.append(f"cost.session_stays_unless_sooner {int(cost.session_stays_unless_sooner)}")
    lines += [f"max_sessions {config.sessions.max_sessions}", f"session_resident_s {config.sessions.resident_s!r}"]
    for worker in fleet["workers"]:
        if worker["instance_id"] is None or worker["kv_events_endpoint"] is None:
            raise FleetStartError(f"the compiled picker cannot reach worker {worker['name']}: {worker}")
        lines.append(f"worker {worker['instance_id']} connect {worker['kv_events_endpoint']}")
    return lines


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
    for (``--router-min-initial-workers``, :func:`kvpilot.deploy.dynamo_spec.frontend_plan`).
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
    gateway = spec.gateway
    envoy = None if gateway is None else envoy_plan(gateway, spec.run_dir)
    logs = _prepare(spec, [*workers, frontend, router, *([envoy] if envoy is not None else [])])
    (spec.run_dir / ROUTER_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    with _starting("the fleet's router did not find every worker") as started:
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
            if gateway is not None:
                if spec.native_picker:
                    gateway = with_native_picker(spec, gateway, router.url)
                return _record(
                    spec, started, gateway=start_gateway(gateway, spec.run_dir, time.monotonic() + timeout, progress)
                )
        else:
            wait_for_frontend(frontend.url, spec.served_model_name, timeout)
            progress(f"  the frontend routes over its {len(workers)} workers (no kvpilot router)")
            if gateway is not None:  # Envoy in front with a fixed route: the gateway's hop alone
                return _record(
                    spec, started, gateway=start_gateway(gateway, spec.run_dir, time.monotonic() + timeout, progress)
                )
    return _record(spec, started)


def _prepare(spec: DynamoFleetSpec, plans: Sequence[ProcessPlan]) -> Path:
    """Before anything starts: refuse ports already taken, clear the discovery directory
    (no instance of an earlier fleet lingers) and make the logs folder, returned."""
    busy = [port for p in plans for port in (p.port, *p.side_ports) if not port_is_free(port)]
    if busy:
        raise FleetStartError(f"ports already in use on {HOST}: {busy}")
    shutil.rmtree(spec.discovery_dir, ignore_errors=True)
    spec.discovery_dir.mkdir(parents=True)
    logs = spec.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


@contextmanager
def _starting(what: str) -> Iterator[list[Started]]:
    """The list the block appends each started process to; if the block fails, every one
    is stopped and the failure raised as :class:`FleetStartError` (a timeout prefixed by
    ``what``; SIGTERM and Ctrl-C as an interruption)."""
    started: list[Started] = []
    with _sigterm_as_interrupt():
        try:
            yield started
        except TimeoutError as exc:
            _stop_all(started)
            raise FleetStartError(f"{what}: {exc}") from None
        except BaseException as exc:
            _stop_all(started)
            if isinstance(exc, KeyboardInterrupt):
                raise FleetStartError("interrupted while starting; every process started was stopped") from None
            raise


def _record(spec: DynamoFleetSpec, started: list[Started], gateway: Started | None = None) -> Fleet:
    """The started processes as the fleet in ``fleet.json``: the last one is its router,
    ``gateway`` (Envoy, started after it) its gateway."""
    running = [r for _, r in started]
    fleet = Fleet(spec.run_dir, tuple(running[:-1]), running[-1], gateway=gateway[1] if gateway else None)
    fleet.save()
    return fleet


def _stop_all(started: list[Started]) -> None:
    for proc, _ in reversed(started):
        stop_group(proc.pid)


def restart_router(spec: DynamoFleetSpec, timeout: float = 120.0) -> Fleet:
    """Stop the kvpilot router (the picker, when Envoy is in front) of the fleet recorded in
    ``spec.run_dir``, if it still runs, and start it again; returns the updated fleet once it
    serves every worker again (its index replayed from the workers' events, its fleet from
    Dynamo's discovery). Envoy, the frontend and the workers keep running: streams already
    carried by Envoy are not touched. Raises :class:`FleetStartError` if it does not come back."""
    fleet = _recorded(spec.run_dir)
    workers = [e for e in fleet.engines if e.role]
    plan = plan_dynamo_fleet(spec)[2]
    restarted = dataclasses.replace(fleet, router=_replace(fleet.router, plan, spec.run_dir / "logs", timeout))
    restarted.save()
    try:
        wait_for_workers(restarted.router.url, lambda names: len(names) == len(workers), timeout)
    except TimeoutError as exc:
        raise FleetStartError(f"the restarted router did not find every worker: {exc}") from None
    return restarted


def _recorded(run_dir: Path) -> Fleet:
    fleet = Fleet.load(run_dir)
    if fleet is None:
        raise FleetStartError(f"no fleet recorded in {run_dir}")
    return fleet


GENERATE_PREFIX = "dynamo%2Fbackend%2Fgenerate%2F"
"""Dynamo's file discovery names an instance of ``dynamo.backend.generate``
``$DYN_FILE_KV/v1/instances/<this><instance id in hex>`` (Dynamo 1.6.1)."""


def generate_instances(discovery_dir: Path) -> list[int]:
    """The instance ids of ``dynamo.backend.generate`` in a file discovery directory."""
    folder = discovery_dir / "v1" / "instances"
    if not folder.is_dir():
        return []
    return sorted(
        int(json.loads(p.read_text())["instance_id"]) for p in folder.iterdir() if p.name.startswith(GENERATE_PREFIX)
    )


def probe_prompt(k: int) -> list[int]:
    """Probe ``k``'s prompt: one 32-token block no other probe shares (ids in [7, 2048))."""
    return [7 + k % 1000, 1007 + k // 1000, *range(100, 130)]


def map_kv_events(
    frontend_url: str, instances: Sequence[int], endpoints: Sequence[str], timeout: float = 30.0
) -> dict[str, str]:
    """Which of ``endpoints`` (vLLM-format KV-event PUB sockets) each instance publishes
    on: subscribes to all, sends instance ``k`` probe ``k``'s prompt through the frontend
    in direct mode (``x-worker-instance-id``), and maps it to the socket that stores that
    prompt's block. Returns instance id (hex) -> endpoint; raises TimeoutError naming
    the instances not heard from within ``timeout`` seconds."""
    ctx = zmq.Context()
    socks: dict[zmq.Socket[bytes], str] = {}
    poller = zmq.Poller()
    try:
        for endpoint in endpoints:
            sock: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            socks[sock] = endpoint
            poller.register(sock, zmq.POLLIN)
        time.sleep(1.0)  # a SUB misses what is published before it is connected
        by_first_block = {tuple(probe_prompt(k)): f"{iid:x}" for k, iid in enumerate(instances)}
        for k, iid in enumerate(instances):
            body = {"model": "tiny", "prompt": probe_prompt(k), "max_tokens": 1}
            req = urllib.request.Request(
                f"{frontend_url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "x-worker-instance-id": str(iid)},
            )
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                resp.read()
        found: dict[str, str] = {}
        decoder = EventDecoder()
        deadline = time.monotonic() + timeout
        while len(found) < len(instances) and time.monotonic() < deadline:
            for sock, _ in poller.poll(200):
                frames = sock.recv_multipart()
                for event in decoder.decode(frames[-1]).events:
                    if isinstance(event, BlockStored):
                        instance = by_first_block.get(tuple(event.token_ids[:32]))
                        if instance is not None:
                            found[instance] = socks[sock]
        missing = [f"{iid:x}" for iid in instances if f"{iid:x}" not in found]
        if missing:
            raise TimeoutError(f"no KV events within {timeout:.0f} s from instances {missing[:8]} (+{len(missing)})")
        return found
    finally:
        for sock in socks:
            sock.close()
        ctx.term()


def up_one_process(
    spec: DynamoFleetSpec,
    *,
    kv_frontend_port: int | None = None,
    kv_frontend_flags: tuple[str, ...] = (),
    router_overrides: dict[str, dict[str, object]] | None = None,
    timeout: float = 300.0,
    progress: Callable[[str], object] = print,
) -> Fleet:
    """Start the scale benchmark's fleet (see the module doc) in ``spec.run_dir``: one
    mocker process of ``spec.workers`` workers, the direct frontend on
    ``spec.frontend_port``, Dynamo's KV router in a second frontend on
    ``kv_frontend_port`` (with ``kv_frontend_flags``) when given, the router
    (its config's sections updated by ``router_overrides``) and, with ``spec.gateway``,
    Envoy in front of it. Recorded in ``fleet.json``
    (the mocker, then the frontends, as engines): :func:`kvpilot.deploy.fleet.down` stops it.
    Raises :class:`FleetStartError` as :func:`up` does."""
    if Fleet.load(spec.run_dir) is not None:
        raise FleetStartError(f"a fleet is already recorded in {spec.run_dir}; run `kvpilot fleet down` first")
    mocker, frontend, router = mocker_group_plan(spec), frontend_plan(spec), router_plan(spec)
    plans = [mocker, frontend]
    if kv_frontend_port is not None:
        kv_spec = dataclasses.replace(
            spec, frontend_routing=FrontendRouting.KV, frontend_port=kv_frontend_port, frontend_flags=kv_frontend_flags
        )
        plans.append(dataclasses.replace(frontend_plan(kv_spec), name="frontend-kv"))
    logs = _prepare(spec, [*plans, router])
    with _starting("the scale fleet did not come up") as started:
        t0 = time.monotonic()
        started.append(_spawn(mocker, logs, WORKER_HEALTH))
        _wait_healthy(started, t0 + timeout)
        while len(generate_instances(spec.discovery_dir)) < spec.workers:
            if time.monotonic() > t0 + timeout:
                raise TimeoutError(f"{len(generate_instances(spec.discovery_dir))} of {spec.workers} in discovery")
            time.sleep(0.5)
        progress(f"  {spec.workers} mocker workers in one process after {time.monotonic() - t0:.1f} s")
        started += [_spawn(plan, logs, FRONTEND_HEALTH) for plan in plans[1:]]
        _wait_healthy(started[1:], time.monotonic() + timeout)
        if kv_frontend_port is not None:
            wait_for_frontend(f"http://{HOST}:{kv_frontend_port}", spec.served_model_name, timeout)
        wait_for_frontend(spec.frontend_url, spec.served_model_name, timeout)
        instances = generate_instances(spec.discovery_dir)
        endpoints = [f"tcp://{HOST}:{port}" for port in mocker.side_ports[1:]]
        mapping = map_kv_events(spec.frontend_url, instances, endpoints)
        progress(f"  frontends up; each instance's KV-event port found after {time.monotonic() - t0:.1f} s")
        config = router_config(spec)
        dynamo = dict(config["dynamo"])  # type: ignore[call-overload]
        dynamo.pop("kv_events_port_offset")
        dynamo.pop("kv_replay_port_offset")  # one process, one replay port rule: not given
        config["dynamo"] = {**dynamo, "kv_events_endpoints": mapping}
        for section, values in (router_overrides or {}).items():
            config[section] = {**dict(config.get(section) or {}), **values}  # type: ignore[call-overload]
        (spec.run_dir / ROUTER_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
        started.append(_spawn(router, logs))
        _wait_healthy(started[-1:], time.monotonic() + timeout)
        wait_for_workers(router.url, lambda names: len(names) == spec.workers, timeout)
        progress(f"  router on {router.url}, serving {spec.workers} workers, after {time.monotonic() - t0:.1f} s")
        if spec.gateway is not None:
            gateway = spec.gateway if not spec.native_picker else with_native_picker(spec, spec.gateway, router.url)
            envoy = start_gateway(gateway, spec.run_dir, time.monotonic() + timeout, progress)
            return _record(spec, started, gateway=envoy)
    return _record(spec, started)
