"""A process that cannot start: ``fleet up`` says why, with the process's own error
lines last (a real router process whose KV-event port this test holds)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import yaml

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.fleet_spec import ROUTER_CONFIG, FleetSpec, ProcessPlan, plan_fleet
from tests.fakes.ports import free_ports


def test_a_router_that_cannot_bind_its_event_port_is_stopped_and_its_own_error_printed_last(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    router_port, engine_port, side, events = free_ports(4)
    spec = FleetSpec(
        model_dir=tiny_model_dir,
        run_dir=tmp_path,
        prefill=0,
        decode=1,
        engine_port=engine_port,
        side_channel_port=side,
        events_port=events,
        router_port=router_port,
    )
    _, router, config = plan_fleet(spec)
    (tmp_path / ROUTER_CONFIG).write_text(yaml.safe_dump(config))
    (tmp_path / "logs").mkdir()
    with socket.socket() as held:  # the port the router must bind for decode-0's KV events
        held.bind(("127.0.0.1", events))
        held.listen()
        with pytest.raises(fleet_io.FleetStartError) as failed:
            fleet_io.start(router, tmp_path / "logs", timeout=60)
    message = str(failed.value).splitlines()
    assert message[0].startswith("router exited with code ")
    in_use = f"Address already in use (addr='tcp://127.0.0.1:{events}')"
    assert in_use in message[0], message[0]
    assert message[-2] == "router's errors, root cause first:", message[-4:]
    assert in_use in message[-1] and "resource_tracker" not in "\n".join(message)
    assert fleet_io.port_is_free(router_port)  # it was stopped


def test_error_lines_take_exception_lines_from_every_prefix_and_skip_the_rest() -> None:
    log = "\n".join(
        [
            "(APIServer pid=1) WARNING ... like `OSError: [Errno 24] Too many open files`. Consider ulimit",
            "(EngineCore pid=2) ERROR 12-01 16:14:39 [core.py:1510] zmq.error.ZMQError: Address already in use",
            "(EngineCore pid=2) ValueError: raw, from a child's stderr",
            "RuntimeError: Engine core initialization failed. See root cause above.",
            "RuntimeError: Engine core initialization failed. See root cause above.",
            "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: leaked",
        ]
    )
    assert fleet_io.error_lines(log) == [
        "zmq.error.ZMQError: Address already in use",
        "ValueError: raw, from a child's stderr",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert fleet_io.error_lines("INFO all good\n") == []


def test_a_process_that_hangs_while_starting_is_reported_by_this_start_and_its_stacks(tmp_path: Path) -> None:
    """A restarted engine's log holds its earlier run: its shutdown errors are not this
    start's cause. A hang is shown where it is (py-spy's stacks of the group)."""
    (port,) = free_ports(1)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "stuck.log").write_text("vllm.v1.engine.exceptions.EngineDeadError: the earlier run's shutdown\n")
    hang = "\n".join(
        (
            "import time",
            "def waiting_for_something():",
            "    time.sleep(600)",
            "print('started', flush=True)",
            "waiting_for_something()",
        )
    )
    plan = ProcessPlan("stuck", None, (sys.executable, "-c", hang), {}, port)
    with pytest.raises(fleet_io.FleetStartError) as failed:
        fleet_io.start(plan, logs, timeout=3)
    message = str(failed.value)
    assert message.splitlines()[0] == "stuck not healthy in time"
    assert "EngineDeadError" not in message and "started" in message
    assert "where stuck's processes were:" in message
    assert "waiting_for_something" in message, message  # py-spy (a dev dependency) read its stack
    assert fleet_io.START_MARKER in (logs / "stuck.log").read_text()  # the earlier run's lines are kept
    assert fleet_io.port_is_free(port)


def test_a_restart_starts_ahead_of_the_running_engines_and_is_back_to_equal_once_healthy(tmp_path: Path) -> None:
    """``ahead``: every process and thread the restarted process starts runs at
    ``RESTART_NICE`` until it is healthy, then at 0 (needs root; else equal throughout)."""
    (port,) = free_ports(1)
    logs = tmp_path / "logs"
    logs.mkdir()
    seen = tmp_path / "nice-while-starting"
    serve = "\n".join(
        (
            "import http.server, os, pathlib, subprocess, sys, threading, time",
            "time.sleep(0.5)",  # the parent sets the group's priority after spawning it
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])",
            f"pathlib.Path({str(seen)!r}).write_text(" + "f'{os.getpriority(os.PRIO_PROCESS, 0)} {child.pid}')",
            "class H(http.server.BaseHTTPRequestHandler):",
            "    def do_GET(self):",
            "        self.send_response(200); self.end_headers()",
            f"server = http.server.HTTPServer(('127.0.0.1', {port}), H)",
            "threading.Thread(target=server.serve_forever, daemon=True).start()",
            "child.wait()",
        )
    )
    plan = ProcessPlan("restarted", None, (sys.executable, "-c", serve), {}, port)
    started = fleet_io.start(plan, logs, timeout=30, ahead=True)
    try:
        expected = fleet_io.RESTART_NICE if os.geteuid() == 0 else 0
        nice, child = map(int, seen.read_text().split())
        assert nice == expected
        threads = [int(t) for p in (started.pid, child) for t in os.listdir(f"/proc/{p}/task")]
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {0}
    finally:
        fleet_io.stop_group(started.pid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell a pinned process apart")
def test_a_process_planned_on_one_core_runs_there_with_its_children(tmp_path: Path) -> None:
    """``ProcessPlan.cores``: torch's MKL, imported by each process of an engine, pins the
    importing thread to each allowed CPU in turn; a process kept to its own core cannot
    be pinned to another engine's."""
    (port,) = free_ports(1)
    logs = tmp_path / "logs"
    logs.mkdir()
    seen = tmp_path / "cores"
    core = max(os.sched_getaffinity(0))
    serve = "\n".join(
        (
            "import http.server, os, pathlib, subprocess, sys, threading",
            "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],",
            "                       capture_output=True, text=True).stdout.strip()",
            f"pathlib.Path({str(seen)!r}).write_text(" + "f'{sorted(os.sched_getaffinity(0))} {child}')",
            "class H(http.server.BaseHTTPRequestHandler):",
            "    def do_GET(self):",
            "        self.send_response(200); self.end_headers()",
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()",
        )
    )
    plan = ProcessPlan("pinned", None, (sys.executable, "-c", serve), {}, port, cores=(core,))
    started = fleet_io.start(plan, logs, timeout=30)
    try:
        assert seen.read_text() == f"[{core}] [{core}]"
    finally:
        fleet_io.stop_group(started.pid)
