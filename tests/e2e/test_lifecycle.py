"""Registration through the entry point, bad configs failing fast, clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import HTTPStatusError, complete
from kvpilot.deploy.env import child_env
from kvpilot.deploy.fleet_spec import ENGINE_API_KEY_ENV, FleetSpec, plan_fleet
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()


FLAG_OF_PORT = {"router_port": "--server-port"}
"""The fleet flag of each port that the CLI names after the router's setting (``server.port``)."""


def _port_flags() -> list[str]:
    return [f"{FLAG_OF_PORT.get(name, '--' + name.replace('_', '-'))}={port}" for name, port in PORTS.items()]


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


def test_fresh_process_gets_connector_from_entry_point_alone() -> None:
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F\n"
        "load_general_plugins(); load_general_plugins()\n"  # vLLM may load plugins twice
        "cls = F.get_connector_class_by_name('KVPilotConnector')\n"
        "print(cls.__module__ + '.' + cls.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "kvpilot.kvconnectors.connector.KVPilotConnector"


@pytest.mark.parametrize(
    ("extra_config", "named_key"),
    [({"inner_extra_confg": {}}, "kv_connector_extra_config.inner_extra_confg")],
)
def test_bad_config_stops_engine_at_start_naming_the_key(
    model_dir: Path, tmp_path: Path, extra_config: dict, named_key: str
) -> None:
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path,
        prefill=0,
        decode=0,
        colocated=1,
        connector_extra_config=extra_config,
        **PORTS,
    )
    started = time.monotonic()
    with pytest.raises(fleet_io.FleetStartError) as failure:
        fleet_io.up(spec, timeout=300)
    assert time.monotonic() - started < 120, "a bad config must fail at start, not at the first request"
    message = str(failure.value)
    assert "colocated-0 exited" in message
    assert named_key in message
    # the failed launch left nothing behind
    engines, router, _ = plan_fleet(spec)
    assert all(fleet_io.port_is_free(p) for e in [*engines, router] for p in (e.port, *e.side_ports))
    assert not _processes_mentioning(f"--port {PORTS['engine_port']}")
    assert fleet_io.Fleet.load(tmp_path) is None


def test_fleet_down_leaves_no_process_and_frees_ports(model_dir: Path, tmp_path: Path) -> None:
    """Also: with ``KVPILOT_ENGINE_API_KEY`` set, the engine refuses requests without
    the key and the router, which sends it, serves."""
    cli = [sys.executable, "-m", "kvpilot.deploy.cli", "fleet"]
    key = f"key-{os.getpid()}"
    common = [
        "--run-dir",
        str(tmp_path),
        "--model-dir",
        str(model_dir),
        "--prefill",
        "0",
        "--decode",
        "0",
        "--colocated",
        "1",
        *_port_flags(),
    ]
    up = subprocess.run(
        [*cli, "up", *common], capture_output=True, text=True, timeout=600, env={**os.environ, ENGINE_API_KEY_ENV: key}
    )
    assert up.returncode == 0, up.stderr[-3000:]
    state = json.loads((tmp_path / fleet_io.STATE_FILE).read_text())
    engine, router = f"http://127.0.0.1:{state['engines'][0]['port']}", f"http://127.0.0.1:{state['router']['port']}"
    with pytest.raises(HTTPStatusError) as refused:
        complete(engine, "no key", max_tokens=1)
    assert refused.value.status == 401
    assert complete(router, "the router sends the key", max_tokens=2).tokens
    pids = [e["pid"] for e in state["engines"]] + [state["router"]["pid"]]
    assert all(_alive(pid) for pid in pids)
    status = subprocess.run([*cli, "status", "--run-dir", str(tmp_path)], capture_output=True, text=True)
    assert status.returncode == 0 and "healthy=True" in status.stdout

    down = subprocess.run([*cli, "down", "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not any(_alive(pid) for pid in pids)
    assert fleet_io.port_is_free(PORTS["engine_port"]) and fleet_io.port_is_free(PORTS["router_port"])
    assert not _processes_mentioning(f"--port {PORTS['engine_port']}")


def test_ctrl_c_during_up_stops_everything(model_dir: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvpilot.deploy.cli",
        "fleet",
        "up",
        "--run-dir",
        str(tmp_path),
        "--model-dir",
        str(model_dir),
        *_port_flags(),
    ]
    # A shell without job control starts background jobs with SIGINT ignored (POSIX), and
    # Python then keeps ignoring it: give the CLI the default, as a terminal would.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until both engines have been spawned
        if "started decode-0" in line:
            break
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "interrupted" in err
    assert not _processes_mentioning(f"--port {PORTS['engine_port']}")
    assert not _processes_mentioning(f"--port {PORTS['engine_port'] + 1}")
    assert fleet_io.port_is_free(PORTS["engine_port"]) and fleet_io.port_is_free(PORTS["side_channel_port"])
