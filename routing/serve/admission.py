"""Admission control: at most ``max_concurrent`` requests in flight, at most
``max_queued`` waiting, none waiting longer than ``queue_timeout_s``; and none whose
predicted TTFT is over the SLO (:func:`check_ttft_slo`).

Under overload the router answers early instead of letting every request slow
down (Mooncake's early rejection; Dynamo answers 529 past its queue threshold):
a full queue is refused at once (429), a request that waited its whole timeout is
refused then (503); both carry ``Retry-After``. :class:`Admission` runs on the event
loop only; :func:`check_ttft_slo` is pure.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvpilot.routing.decide.rates import TTFTPrediction
from kvpilot.routing.refusals import RejectReason


class Rejected(Exception):
    """Not admitted: ``status`` (429 or 503) and ``retry_after_s`` for the client."""

    def __init__(self, reason: RejectReason, status: int, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.reason, self.status, self.retry_after_s = reason, status, retry_after_s


class Admission:
    """``max_concurrent == 0`` admits everything at once (no limit)."""

    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float) -> None:
        if max_concurrent < 0 or max_queued < 0 or queue_timeout_s <= 0:
            raise ValueError("max_concurrent and max_queued must be >= 0, queue_timeout_s > 0")
        self.max_concurrent, self.max_queued, self.queue_timeout_s = max_concurrent, max_queued, queue_timeout_s
        self._slots = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self.queued = 0

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one slot for the body of the ``async with``; raises :class:`Rejected`."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Take one slot, waiting in the queue if none is free; raises :class:`Rejected`.
        Each successful call is matched by one :meth:`release` (a front whose request ends
        outside one coroutine, as Envoy's picker's does, calls both itself)."""
        slots = self._slots
        if slots is not None and not slots.locked():
            await slots.acquire()  # a free slot: taken without suspending
        elif slots is not None:
            await self._wait_for_slot(slots)

    def release(self) -> None:
        """Give back a slot :meth:`acquire` took."""
        if self._slots is not None:
            self._slots.release()

    async def _wait_for_slot(self, slots: asyncio.Semaphore) -> None:
        retry_after = max(1, math.ceil(self.queue_timeout_s))
        if self.queued >= self.max_queued:
            raise Rejected(
                RejectReason.QUEUE_FULL,
                429,
                retry_after,
                f"the router is at capacity ({self.max_concurrent} in flight, {self.queued} queued)",
            )
        self.queued += 1
        try:
            await asyncio.wait_for(slots.acquire(), self.queue_timeout_s)
        except asyncio.TimeoutError:
            raise Rejected(
                RejectReason.QUEUE_TIMEOUT,
                503,
                retry_after,
                f"no capacity within server.queue_timeout_s ({self.queue_timeout_s:g} s)",
            ) from None
        finally:
            self.queued -= 1


def check_ttft_slo(prediction: TTFTPrediction, slo_s: float) -> None:
    """Refuse a routed request whose predicted TTFT (:class:`~kvpilot.routing.decide.rates.TTFTPrediction`:
    queue + prefill + transfer + first decode step) is over ``slo_s`` seconds, before
    anything is sent to an engine (Mooncake's early rejection). Returns ``None`` when it
    meets the SLO, or when ``slo_s`` is 0 (no SLO).

    Raises :class:`Rejected` with reason :attr:`~RejectReason.TTFT_SLO`: 429 when it is
    load (without the prefill queue ahead of it the request would meet the SLO;
    ``Retry-After``: that queue's predicted seconds), else 503 (even alone it would not;
    ``Retry-After``: its predicted TTFT, after which the measured rates may differ). The
    message names the predicted TTFT, the SLO and each term.
    """
    ttft = prediction.seconds
    if not slo_s or ttft <= slo_s:
        return
    queue = prediction.queue.seconds
    terms = (
        f"queue {queue:.3f} s, prefill {prediction.prefill.seconds:.3f} s, "
        f"transfer {prediction.transfer.seconds:.3f} s, first decode step {prediction.first_step.seconds:.3f} s, "
        f"overhead {prediction.overhead.seconds:.3f} s"
    )
    if ttft - queue <= slo_s:
        message = f"predicted TTFT {ttft:.3f} s is over server.ttft_slo_s ({slo_s:g} s) for the load ahead ({terms})"
        raise Rejected(RejectReason.TTFT_SLO, 429, max(1, math.ceil(queue)), message)
    message = f"predicted TTFT {ttft:.3f} s is over server.ttft_slo_s ({slo_s:g} s) even without a queue ({terms})"
    raise Rejected(RejectReason.TTFT_SLO, 503, max(1, math.ceil(ttft)), message)
