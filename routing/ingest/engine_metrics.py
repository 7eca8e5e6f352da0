"""What the engines report about their own load, read from their Prometheus ``/metrics``.

The router's :class:`~kvpilot.routing.decide.ledger.LoadLedger` only sees traffic that went
through this router. An engine's own gauges also count traffic that did not
(a second router, direct clients), so the router polls them:
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (vLLM 0.32; summed over label sets, KV usage is
the maximum), and the NIXL transfer counters that rate each (P, D) pair
(:data:`TRANSFER_COUNTERS`, :mod:`kvpilot.routing.health.pair_health`). :func:`parse_engine_load`
is pure and hands only those lines to
``prometheus_client``'s parser, so a large exposition costs little on the router's
loop; :class:`EngineLoadPoller` is the asyncio loop.
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

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvpilot.kvconnectors import vllm_metrics
from kvpilot.routing.config import Worker
from kvpilot.routing.health.engine_load import EngineLoad, RateCounters
from kvpilot.routing.health.pair_health import TransferCounters
from kvpilot.routing.ids import WorkerId

log = logging.getLogger(__name__)

_RUNNING = vllm_metrics.NUM_REQUESTS_RUNNING.sample
_WAITING = vllm_metrics.NUM_REQUESTS_WAITING.sample
_KV_USAGE = vllm_metrics.KV_CACHE_USAGE_PERC.sample
TRANSFER_COUNTERS = {
    vllm_metrics.NIXL_NUM_FAILED_TRANSFERS.total: "failures",
    vllm_metrics.NIXL_NUM_KV_EXPIRED_REQS.total: "expired_leases",
    vllm_metrics.NIXL_XFER_TIME_SECONDS.sum: "transfer_seconds",
    vllm_metrics.NIXL_XFER_TIME_SECONDS.count: "transfers",
}
"""The series behind :class:`~kvpilot.routing.health.pair_health.TransferCounters` (summed over label sets).
A failed read is NIXL's failed transfer; ``vllm:kvpilot_load_failures`` counts the same reads
again (by what vLLM's ``kv_load_failure_policy`` did with them), so it is not summed in."""
RATE_COUNTERS = {
    vllm_metrics.REQUEST_PREFILL_TIME_SECONDS.sum: "prefill_seconds",
    vllm_metrics.REQUEST_PREFILL_TIME_SECONDS.count: "prefill_requests",
    vllm_metrics.INTER_TOKEN_LATENCY_SECONDS.sum: "decode_step_seconds",
    vllm_metrics.INTER_TOKEN_LATENCY_SECONDS.count: "decode_steps",
    vllm_metrics.NIXL_BYTES_TRANSFERRED.sum: "read_bytes",
}
"""The series behind :class:`~kvpilot.routing.health.engine_load.RateCounters` (summed over label sets),
besides the prompt tokens by source (:data:`TOKENS_BY_SOURCE`)."""
_BY_SOURCE = vllm_metrics.PROMPT_TOKENS_BY_SOURCE.total
TOKENS_BY_SOURCE = {
    vllm_metrics.PromptTokenSource.LOCAL_COMPUTE.value: "computed_tokens",
    vllm_metrics.PromptTokenSource.LOCAL_CACHE_HIT.value: "cached_tokens",
    vllm_metrics.PromptTokenSource.EXTERNAL_KV_TRANSFER.value: "external_tokens",
}
"""``vllm:prompt_tokens_by_source_total``'s ``source`` label -> its
:class:`~kvpilot.routing.health.engine_load.RateCounters` field."""
# A sample line of one of these starts with its name and then labels or a space.
_WANTED_LINES = tuple(
    name + after
    for name in (_RUNNING, _WAITING, _KV_USAGE, *TRANSFER_COUNTERS, *RATE_COUNTERS, _BY_SOURCE)
    for after in "{ \t"
)


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, as ``prometheus_client``'s parser reads it.

    Sample names are as exposed (a counter's ``_total``, a histogram's ``_bucket``,
    ``_sum`` and ``_count``); values may be ``nan`` or infinite. A line the parser
    refuses is dropped and the rest is read as if it were not there, so junk never
    raises; empty text gives ``[]``.
    """
    try:
        return _parse(text)
    except ValueError:
        return _parse("\n".join(line for line in text.split("\n") if _parses(line)))


def _parse(text: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _parses(line: str) -> bool:
    """Whether the parser takes ``line`` alone; it refuses a line for its own text only,
    so the lines it takes alone it also takes together."""
    try:
        _parse(line)
    except ValueError:
        return False
    return True


def parse_engine_load(text: str, at: float) -> EngineLoad | None:
    """The three gauges, the transfer counters and the rate counters from a Prometheus
    text exposition; None if KV usage is absent (a counter that is absent reads 0).

    Only those sample lines are parsed; a line the parser refuses or a
    non-finite value is ignored. Never raises.
    """
    wanted = "\n".join(line for line in text.split("\n") if line.lstrip().startswith(_WANTED_LINES))
    sums = {_RUNNING: 0.0, _WAITING: 0.0}
    transfer = dict.fromkeys(TRANSFER_COUNTERS.values(), 0.0)
    rates = dict.fromkeys((*RATE_COUNTERS.values(), *TOKENS_BY_SOURCE.values()), 0.0)
    usage: float | None = None
    for sample in parse_samples(wanted):
        value = float(sample.value)
        if not math.isfinite(value):
            continue
        if sample.name == _KV_USAGE:
            usage = value if usage is None else max(usage, value)
        elif sample.name in sums:
            sums[sample.name] += value
        elif sample.name == _BY_SOURCE:
            source = TOKENS_BY_SOURCE.get(sample.labels.get("source", ""))
            if source is not None:
                rates[source] += value
        if sample.name in TRANSFER_COUNTERS:
            transfer[TRANSFER_COUNTERS[sample.name]] += value
        if sample.name in RATE_COUNTERS:
            rates[RATE_COUNTERS[sample.name]] += value
    if usage is None:
        return None
    return EngineLoad(sums[_RUNNING], sums[_WAITING], usage, at, TransferCounters(**transfer), RateCounters(**rates))


async def read_engine_load(
    http: aiohttp.ClientSession,
    worker: Worker,
    timeout: aiohttp.ClientTimeout,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[EngineLoad | None, str | None]:
    """``worker``'s ``/metrics`` now (stamped by ``clock``), parsed, or why not
    (``http_<status>``, ``no_kv_usage``, ``timeout``, ``connection``); never raises."""
    try:
        async with http.get(f"{worker.url}/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return None, f"http_{resp.status}"
            sample = parse_engine_load(await resp.text(), clock())
            return (sample, None) if sample is not None else (None, "no_kv_usage")
    except asyncio.TimeoutError:
        return None, "timeout"
    except (aiohttp.ClientError, UnicodeDecodeError):
        return None, "connection"


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
        on_sample: Callable[[WorkerId, EngineLoad], None] | None = None,
    ) -> None:
        """``on_sample(worker, sample)`` is called once per good sample, as it arrives."""
        self.workers = tuple(workers)
        self._on_sample = on_sample
        self.interval_s = interval_s
        self.max_age_s = 3 * interval_s
        self.failures: Counter[tuple[WorkerId, str]] = Counter()
        self._clock = clock
        self._samples: dict[WorkerId, EngineLoad] = {}
        self._failing: set[WorkerId] = set()

    def follow(self, workers: Iterable[Worker]) -> None:
        """Poll ``workers`` from the next round on (engines joined or left); a departed one's
        last sample is dropped."""
        self.workers = tuple(workers)
        names = {w.name for w in self.workers}
        self._samples = {name: sample for name, sample in self._samples.items() if name in names}

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
        sample, reason = await read_engine_load(http, worker, timeout, self._clock)
        if sample is not None:
            self._samples[worker.name] = sample
            if self._on_sample is not None:
                self._on_sample(worker.name, sample)
        if reason is None:
            self._failing.discard(worker.name)
            return
        self.failures[(worker.name, reason)] += 1
        if worker.name not in self._failing:
            self._failing.add(worker.name)
            log.warning("engine %s: /metrics unreadable (%s); using the router's own load only", worker.name, reason)
