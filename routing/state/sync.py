"""Keeps this router's sessions and the shared store in step, without ever failing a
request for the store.

- :meth:`SessionSync.open`, at the router's start: connect, so that the first step's read
  after a restart is one round trip, not a connection and its handshake (which could
  outlast the read's timeout and route the step as if the session were new).
- :meth:`SessionSync.pull`, before a session's step is routed: read its record, at most
  ``sessions.store_read_timeout_s``, and merge it when it is newer than the local view
  (:func:`~kvpilot.routing.decide.session_record.merge`: after a restart, or when another replica
  served the last step). A read that fails or times out is counted and the step is routed
  on the local state.
- :meth:`SessionSync.push`, once a step was served: write the session's record, at most
  ``sessions.store_write_timeout_s``, before the answer is returned. Not off the
  request's path: the client may send the next step to another replica the moment it has
  the answer, and a write still in flight then is a step routed on that replica's older
  view. One round trip (``benchmarks/bench_session_store.py`` times it). A streamed answer's write follows its
  last event, so a step sent on at once may still race it. A failed or timed-out write is
  counted; the next step writes again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvpilot.routing.decide.session_record import (
    RecordError,
    SessionRecord,
    SessionStateStore,
    StoreOp,
    StoreUnavailable,
    merge,
)
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.ids import SessionId
from kvpilot.routing.metrics.router_metrics import RouterMetrics

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 2.0
"""How long the router's start waits for the store's first connection (Redis's own
connect timeout is 1 s; its handshake follows)."""


class SessionSync:
    """Reads and writes ``sessions``' records in ``store`` (module doc). Not thread-safe:
    it runs on the event loop that owns ``sessions``."""

    def __init__(
        self,
        store: SessionStateStore,
        sessions: SessionStore,
        metrics: RouterMetrics,
        *,
        read_timeout_s: float,
        write_timeout_s: float,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.metrics = metrics
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.ttl_s = ttl_s
        self.clock = clock
        self._down = False
        """Whether the last call failed: an outage is logged when it starts and when it ends."""

    async def open(self) -> None:
        """Connect to the store before the first request (at the router's start), at most
        :data:`OPEN_TIMEOUT_S`; never raises for the store: a store that does not answer is
        counted (``op="connect"``) and logged, and the requests connect again."""
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self.store.open(), OPEN_TIMEOUT_S)
            self._answered()
        except (StoreUnavailable, TimeoutError) as exc:
            self._failed(StoreOp.CONNECT, None, exc)
        finally:
            self.metrics.session_store_seconds.labels(StoreOp.CONNECT.value).observe(time.perf_counter() - started)

    async def close(self) -> None:
        """Close the store's connections."""
        await self.store.close()

    async def pull(self, session: SessionId) -> bool:
        """Merge ``session``'s stored record into the local one; whether it was newer and
        taken. Never raises for the store: a failure, a timeout or an unreadable record is
        counted (and logged) and the local state stands."""
        started = time.perf_counter()
        try:
            value = await asyncio.wait_for(self.store.load(session), self.read_timeout_s)
            record = None if value is None else SessionRecord.from_bytes(value)
        except (StoreUnavailable, RecordError, TimeoutError) as exc:
            self._failed(StoreOp.READ, session, exc)
            return False
        finally:
            self.metrics.session_store_seconds.labels(StoreOp.READ.value).observe(time.perf_counter() - started)
        self._answered()
        if record is None:
            return False
        taken = merge(self.sessions.get(session), record)
        if taken:
            self.metrics.session_store_restored.inc()
        return taken

    async def push(self, session: SessionId) -> None:
        """Write ``session``'s record as it is now (module doc); never raises for the store."""
        record = SessionRecord.of(self.sessions.get(session))
        await self._write(session, record)

    async def _write(self, session: SessionId, record: SessionRecord) -> None:
        ttl_s = record.ttl_s(self.clock(), self.ttl_s)
        if ttl_s <= 0:  # D's lease ended: the offer is worthless, the placement stays for a while
            record = SessionRecord(record.version, record.steps, record.decode, record.prefill)
            ttl_s = self.ttl_s
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self.store.save(session, record.to_bytes(), ttl_s), self.write_timeout_s)
            self._answered()
        except (StoreUnavailable, TimeoutError) as exc:
            self._failed(StoreOp.WRITE, session, exc)
        finally:
            self.metrics.session_store_seconds.labels(StoreOp.WRITE.value).observe(time.perf_counter() - started)

    def _failed(self, op: StoreOp, session: SessionId | None, why: object) -> None:
        self.metrics.session_store_errors.labels(op.value).inc()
        if not self._down:
            self._down = True
            log.warning(
                "session store: %s%s failed (%s); sessions are routed on this router's own state "
                "until it answers (counted in kvpilot_router_session_store_errors_total)",
                op.value,
                "" if session is None else f" for {session!r}",
                why,
            )

    def _answered(self) -> None:
        if self._down:
            self._down = False
            log.info("session store: answering again")
