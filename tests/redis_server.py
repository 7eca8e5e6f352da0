"""The real ``redis-server`` for the tests (:mod:`kvpilot.deploy.redis_server`), skipping the test
with the install command when the binary is missing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpilot.deploy import redis_server
from kvpilot.deploy.redis_server import RedisMissing


def redis_binary() -> str:
    """``redis-server`` on PATH, or the test is skipped saying how to install it."""
    try:
        return redis_server.redis_binary()
    except RedisMissing as exc:
        pytest.skip(str(exc))


@contextmanager
def running_redis(port: int, workdir: Path) -> Iterator[str]:
    """:func:`kvpilot.deploy.redis_server.running_redis`, skipped when the binary is missing."""
    redis_binary()
    with redis_server.running_redis(port, workdir) as url:
        yield url
