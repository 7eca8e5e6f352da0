"""deploy/envoy_restarter.py with a stand-in for Envoy (a Python child that records its
argv and waits): each SIGHUP starts the next epoch beside the running ones, SIGTERM stops
them all, and the newest one's exit ends the restarter with its code."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

CHILD = """
import sys, time
open(sys.argv[1] + "." + sys.argv[-1], "w").write(" ".join(sys.argv[2:]))
time.sleep(float(sys.argv[2]))
sys.exit(int(sys.argv[3]))
"""


def _restarter(tmp_path: Path, lifetime_s: float, code: int = 0) -> subprocess.Popen[bytes]:
    script = tmp_path / "fake_envoy.py"
    script.write_text(CHILD)
    argv = [
        sys.executable,
        "-m",
        "kvpilot.deploy.envoy_restarter",
        sys.executable,
        str(script),
        str(tmp_path / "epoch"),
    ]
    return subprocess.Popen([*argv, str(lifetime_s), str(code)])


def _wait_for(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def test_each_hangup_starts_the_next_epoch_and_sigterm_stops_them_all(tmp_path: Path) -> None:
    restarter = _restarter(tmp_path, 60)
    try:
        assert _wait_for(tmp_path / "epoch.0").endswith("--restart-epoch 0")
        restarter.send_signal(signal.SIGHUP)
        assert _wait_for(tmp_path / "epoch.1").endswith("--restart-epoch 1")
        children = psutil.Process(restarter.pid).children()
        assert len(children) == 2  # the old epoch keeps running beside the new
        restarter.send_signal(signal.SIGTERM)
        assert restarter.wait(20) == 0
        assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)
    finally:
        restarter.kill()


def test_the_newest_envoy_s_exit_ends_the_restarter_with_its_code(tmp_path: Path) -> None:
    restarter = _restarter(tmp_path, 0.5, code=3)
    assert restarter.wait(20) == 3
