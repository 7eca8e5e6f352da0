"""What the engines report about their own load, read from their Prometheus ``/metrics``.

The router's :class:`~routing.ledger.LoadLedger` only sees traffic that went
through this router. An engine's own gauges also count traffic that did not
(a second router, direct clients), so the router polls them:
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (vLLM 0.32; summed over label sets, KV usage is
the maximum). :func:`parse_engine_load` is pure and reads only those lines, so a
large exposition costs little; :class:`EngineLoadPoller` is the asyncio loop.
A sample older than ``max_age_s`` is ignored (an engine that stopped answering
reports nothing, rather than stale load).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from routing.engines import Worker
from routing.index import WorkerId

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's self-reported load at ``at`` (``time.monotonic()``)."""

    running: float
    waiting: float
    kv_usage: float
    at: float


def parse_engine_load(text: str, at: float) -> EngineLoad | None:
    """The three gauges from a Prometheus text exposition; None if ``KV_USAGE`` is absent.

    Lines that are not ``name{labels} value`` or ``name value`` for these names
    are skipped; a non-finite value is ignored.
    """
    sums = {RUNNING: 0.0, WAITING: 0.0}
    usage: float | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, value_text = line.partition(" ")
        else:
            value_text = rest.rpartition("}")[2]
        name = name.strip()
        if name not in sums and name != KV_USAGE:
            continue
        try:
            value = float(value_text.split()[0])
        except (IndexError, ValueError):
            continue
        if not math.isfinite(value):
            continue
        if name == KV_USAGE:
            usage = value if usage is None else max(usage, value)
        else:
            sums[name] += value
    if usage is None:
        return None
    return EngineLoad(sums[RUNNING], sums[WAITING], usage, at)


class EngineLoadPoller:
    """Polls every worker's ``/metrics`` each ``interval_s``; keeps the last good sample.

    Failures are counted per ``(worker, reason)`` in :attr:`failures` and
    logged once per worker until it answers again; the loop never raises.
    """

    def __init__(
        self,
        workers: Iterable[Worker],
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workers = tuple(workers)
        self.interval_s = interval_s
        self.max_age_s = 3 * interval_s
        self.failures: Counter[tuple[WorkerId, str]] = Counter()
        self._clock = clock
        self._samples: dict[WorkerId, EngineLoad] = {}
        self._failing: set[WorkerId] = set()

    def latest(self, worker: WorkerId) -> EngineLoad | None:
        """``worker``'s last sample if it is fresh, else None."""
        sample = self._samples.get(worker)
        if sample is None or self._clock() - sample.at > self.max_age_s:
            return None
        return sample

    async def run(self, http: aiohttp.ClientSession) -> None:
        """Poll until cancelled."""
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s))
        while True:
            await asyncio.gather(*(self._poll(http, w, timeout) for w in self.workers))
            await asyncio.sleep(self.interval_s)

    async def _poll(self, http: aiohttp.ClientSession, worker: Worker, timeout: aiohttp.ClientTimeout) -> None:
        reason = None
        try:
            async with http.get(f"{worker.url}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    reason = f"http_{resp.status}"
                else:
                    sample = parse_engine_load(await resp.text(), self._clock())
                    if sample is None:
                        reason = "no_kv_usage"
                    else:
                        self._samples[worker.name] = sample
        except asyncio.TimeoutError:
            reason = "timeout"
        except (aiohttp.ClientError, UnicodeDecodeError):
            reason = "connection"
        if reason is None:
            self._failing.discard(worker.name)
            return
        self.failures[(worker.name, reason)] += 1
        if worker.name not in self._failing:
            self._failing.add(worker.name)
            log.warning("engine %s: /metrics unreadable (%s); using the router's own load only", worker.name, reason)
