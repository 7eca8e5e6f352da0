"""A local ``redis-server`` (Debian's package; ``scripts/bootstrap.sh`` installs it) for the
router's shared session store: on 127.0.0.1 only, persistence off (``--save ''
--appendonly no``), stopped when the context ends. Used by the tests and the store's
benchmark; a production Redis is deployed and run by its own means."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from kvpilot.deploy.fleet_spec import HOST

INSTALL_HINT = "redis-server is not installed: `apt-get install -y redis-server` (scripts/bootstrap.sh does it)"


class RedisMissing(RuntimeError):
    """No ``redis-server`` on PATH; the message says how to get one."""


def redis_binary() -> str:
    """``redis-server`` on PATH; raises :class:`RedisMissing` with :data:`INSTALL_HINT`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisMissing(INSTALL_HINT)
    return binary


@contextmanager
def running_redis(port: int, workdir: Path, timeout_s: float = 10.0) -> Iterator[str]:
    """A ``redis-server`` on ``127.0.0.1:port`` (its log in ``workdir``) until the context
    ends; yields its URL. Raises :class:`RedisMissing`, or ``RuntimeError`` when it does not
    answer within ``timeout_s``."""
    binary = redis_binary()
    with open(workdir / f"redis-{port}.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"redis://{HOST}:{port}/0"
        try:
            _wait_answering(url, proc, timeout_s, log.name)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_answering(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: str) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server at {url} did not start: see {log}") from None
                time.sleep(0.05)
    finally:
        client.close()
