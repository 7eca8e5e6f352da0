"""A real ``redis-server`` for the tests (Debian's package; ``scripts/bootstrap.sh``
installs it): started on 127.0.0.1 with persistence off (``--save '' --appendonly no``),
stopped when the context ends. Tests that need it skip, saying how to install it, when
the binary is missing."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

INSTALL_HINT = "redis-server is not installed: `apt-get install -y redis-server` (scripts/bootstrap.sh does it)"


def redis_binary() -> str:
    """``redis-server`` on PATH, or the test is skipped with :data:`INSTALL_HINT`."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(INSTALL_HINT)
    return binary


@contextmanager
def running_redis(port: int, workdir: Path, timeout_s: float = 10.0) -> Iterator[str]:
    """A ``redis-server`` on ``127.0.0.1:port`` until the context ends; yields its URL."""
    log = open(workdir / f"redis-{port}.log", "wb")  # noqa: SIM115 (closed below, after the process)
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start: see {log.name}") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
