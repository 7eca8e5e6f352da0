"""Keeps this router's sessions and the shared store in step, without ever failing or
holding up a request for the store.

- :meth:`SessionSync.pull`, before a session's step is routed: read its record, at most
  ``sessions.store_read_timeout_s``, and merge it when it is newer than the local view
  (:func:`~routing.decide.session_record.merge`: after a restart, or when another replica
  served the last step). A read that fails or times out is counted and the step is routed
  on the local state.
- :meth:`SessionSync.push`, once a step was served: the session's record is queued and
  returns at once; one writer task sends the queue in order (so a session's writes land
  in the order they were made), each write bounded by ``sessions.store_write_timeout_s``.
  A failed, timed-out or dropped write (queue full) is counted; the next step writes again.

The one race left: a step that reaches another replica before the last step's write
landed is routed on that replica's older view (its own, or none): it may re-prefill or
miss D's offer; its answer is as correct as any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from routing.decide.session_record import (
    RecordError,
    SessionRecord,
    SessionStateStore,
    StoreOp,
    StoreUnavailable,
    merge,
)
from routing.decide.sessions import SessionStore
from routing.ids import SessionId
from routing.metrics.router_metrics import RouterMetrics

log = logging.getLogger(__name__)

WRITE_QUEUE = 4096
"""Writes waiting at most; more are dropped (counted), so a dead store costs bounded memory."""
DRAIN_S = 2.0
"""At shutdown, how long queued writes may take to reach the store."""


class SessionSync:
    """Reads and writes ``sessions``' records in ``store`` (module doc). ``lock`` guards
    ``sessions`` (the router's index lock). :meth:`start` and :meth:`stop` run on the
    event loop that calls :meth:`pull` and :meth:`push`."""

    def __init__(
        self,
        store: SessionStateStore,
        sessions: SessionStore,
        lock: threading.Lock,
        metrics: RouterMetrics,
        *,
        read_timeout_s: float,
        write_timeout_s: float,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.lock = lock
        self.metrics = metrics
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.ttl_s = ttl_s
        self.clock = clock
        self._queue: asyncio.Queue[tuple[SessionId, SessionRecord]] = asyncio.Queue(WRITE_QUEUE)
        self._writer: asyncio.Task[None] | None = None
        self._down = False
        """Whether the last call failed: an outage is logged when it starts and when it ends."""

    async def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop())

    async def stop(self) -> None:
        """Send what is queued (at most :data:`DRAIN_S`), then close the store."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), DRAIN_S)
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
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
        with self.lock:
            taken = merge(self.sessions.get(session), record)
        if taken:
            self.metrics.session_store_restored.inc()
        return taken

    def push(self, session: SessionId) -> None:
        """Queue ``session``'s record as it is now; returns at once (module doc)."""
        with self.lock:
            record = SessionRecord.of(self.sessions.get(session))
        try:
            self._queue.put_nowait((session, record))
        except asyncio.QueueFull:
            self._failed(StoreOp.WRITE, session, "the write queue is full")

    async def _write_loop(self) -> None:
        while True:
            session, record = await self._queue.get()
            try:
                await self._write(session, record)
            finally:
                self._queue.task_done()

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

    def _failed(self, op: StoreOp, session: SessionId, why: object) -> None:
        self.metrics.session_store_errors.labels(op.value).inc()
        if not self._down:
            self._down = True
            log.warning(
                "session store: %s for %r failed (%s); sessions are routed on this router's own state "
                "until it answers (counted in kvpilot_router_session_store_errors_total)",
                op.value,
                session,
                why,
            )

    def _answered(self) -> None:
        if self._down:
            self._down = False
            log.info("session store: answering again")
