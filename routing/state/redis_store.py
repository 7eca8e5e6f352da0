"""Session records in Redis: one string key per session, ``SET key value PX ttl``, ``GET key``.

Redis (Debian's ``redis-server``, the ``redis`` client: ``kvpilot[redis]``), not etcd or
NATS KV, because a session record is a small, short-lived cache entry and Redis is built
for exactly that: each key carries its own expiry to the millisecond (``PX``), which is
D's lease on the session's blocks; a read or write is one round trip; llm-d keeps its KV
index there for the same reasons. etcd is a consensus log for configuration (every write
is a replicated Raft entry; a TTL is a lease that keys are attached to), and NATS KV
needs JetStream and, before NATS server 2.11, had only one TTL per bucket; Dynamo uses
them for discovery and its event plane, not for per-request state.

No retries and no reconnection backoff here: a command that fails raises
:class:`~kvpilot.routing.decide.session_record.StoreUnavailable` at once, and the next request
tries again (:mod:`kvpilot.routing.state.sync` bounds and counts every call).
"""

from __future__ import annotations

import math
from typing import cast

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvpilot.routing.decide.session_record import StoreUnavailable
from kvpilot.routing.ids import SessionId

CONNECT_TIMEOUT_S = 1.0


class RedisSessionStore:
    """:class:`~kvpilot.routing.decide.session_record.SessionStateStore` over a Redis server at ``url``
    (``redis://host:port/db``), authenticated with ``password`` when given (read from
    ``sessions.redis_password_env``, never from the URL); every key starts with
    ``key_prefix`` and ``session:``. No error it raises carries the password."""

    def __init__(self, url: str, key_prefix: str, *, password: str | None = None) -> None:
        self._redis = redis.Redis.from_url(
            url,
            password=password,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._prefix = f"{key_prefix}session:"

    def key(self, session: SessionId) -> str:
        """The Redis key of ``session``'s record."""
        return self._prefix + session

    async def open(self) -> None:
        try:
            await self._redis.ping()  # a pooled connection, its handshake (CLIENT SETINFO) done
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis PING: {exc!r}") from None

    async def load(self, key: SessionId) -> bytes | None:
        try:
            value = cast("bytes | None", await self._redis.get(self.key(key)))  # decode_responses is off
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis GET: {exc!r}") from None
        return value

    async def save(self, key: SessionId, value: bytes, ttl_s: float) -> None:
        try:
            await self._redis.set(self.key(key), value, px=max(1, math.ceil(ttl_s * 1000)))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis SET: {exc!r}") from None

    async def close(self) -> None:
        await self._redis.aclose()
