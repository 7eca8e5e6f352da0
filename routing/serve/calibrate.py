"""Calibration before ready: the router times its engines itself before it serves, so its
first predictions are measurements, not the roofline prior of a preset GPU.

Per role (decode, co-located, prefill), the first ``server.calibration_workers`` workers,
one at a time (an engine timed alone), through the upstream a routed request takes, every
probe below sent once untimed and then timed on fresh prompts (:data:`WARM_PASSES`: a cold
engine's first prefill of a length is slow):

- **prefill**: for each length ``L`` of ``server.calibration_prompt_tokens``, a prompt of ``L``
  fresh token ids answered with one token (``L`` tokens prefilled from nothing), then the
  same prompt with :data:`CACHED_EXTENSION` more (those few prefilled after ``L`` cached).
  Each is timed as the worker's traffic is: by the engine's own ``/metrics`` where the router
  polls them, read before and after the probe
  (:func:`kvpilot.routing.decide.rates.observe_interval`: the engine's prefill time, without
  the HTTP around it), else (beside Dynamo) by its TTFT, as the proxy times requests there;
- **decode**: for each ``B`` of ``server.calibration_decode_streams``, ``B`` streams at once of
  :data:`DECODE_TOKENS` tokens on short fresh prompts; the mean gap between a stream's tokens
  is one sample of the decode step beside ``B - 1`` others;
- **prefill workers**: each probe above as a real handoff, the router's own remote path: P
  prefills with a handoff request (``max_tokens=1``), timed as the proxy times P's
  handoffs (the call, since P's KV held for a peer costs P more than a plain request, and a
  plain probe would underprice the remote path), then the first calibrated decode worker
  reads that KV with one token, streamed (and timed by D's metrics: its KV reads), so P
  frees it as after any handoff. A deployment that prefills on P within D's call (Dynamo's
  frontend: a deferred handoff) is not probed there: P's prefill has no time of its own to
  take;
- **overhead**: each timed prefill probe's first token, against the terms the calibrated fits
  predict for it (:class:`FirstToken`): the overhead of its path, local for a probe of D
  or a co-located worker, remote for a handoff (what P's call, the handoff and the HTTP
  around them add, which on a small model can be a large share of a remote step's TTFT).

The samples are provisional: they price the first requests, and each model drops them once
the engine's own traffic gave it enough samples spanning their length (probes are not the
traffic: kept where it has been, they would bend its fit), and keeps those beyond it (where
the traffic has not been, a probe is the engine's only measurement; a D serving short
session increments prices a long one by its probes:
:meth:`kvpilot.policies.measured_fit.LinearFit.add`).
Until an engine is calibrated or timed on traffic, it is predicted from the fit of the one
with the most samples (the fleet serves one model: the rates' fallback).
A probe that fails or outlasts :data:`PROBE_TIMEOUT_S` is skipped and logged: the router then
serves on what it has. Fresh ids are drawn from a seeded RNG per start, below the model's
vocabulary (``config.json``'s ``vocab_size``), so no probe finds another's blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.routing.config import Role, ServerConfig, Worker
from kvpilot.routing.decide.measured_prices import PathInputs, predict_path
from kvpilot.routing.decide.rates import PrefillPath, RateEstimator, observe_interval
from kvpilot.routing.health.engine_load import EngineLoad
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.serve.upstream import Api, EngineRequest, StreamBroke, Upstream, UpstreamError

log = logging.getLogger(__name__)

CACHED_EXTENSION = 64
"""Tokens added to a prefill probe's prompt for its cached-prefix twin."""
DECODE_TOKENS = 16
"""Tokens each decode probe's streams generate."""
DECODE_PROMPT_TOKENS = 32
PROBE_TIMEOUT_S = 60.0
WARM_PASSES = 1
"""Untimed passes of a worker's probes (fresh prompts of the same lengths) before the timed
one: an engine's first prefill of a length runs cold and slower than later ones, and
priced by cold probes the engine's prefills would be overpredicted."""
FIRST_TOKEN_ID = 10
"""Fresh ids start here (below it: a tokenizer's special tokens)."""
DEFAULT_VOCAB = 32000


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A timed probe's first token: ``prefill_worker`` prefilled ``new`` tokens after
    ``cached`` ones, ``decode_worker`` read ``moved`` tokens of KV from it (0: it prefilled
    them itself) and answered ``seconds`` after the probe was sent."""

    prefill_worker: WorkerId
    decode_worker: WorkerId
    new: int
    cached: int
    moved: int
    seconds: float

    def residual_s(self, rates: RateEstimator) -> float:
        """What it spent beyond the modelled terms as ``rates`` now predict them: its
        path's overhead (:meth:`~kvpilot.routing.decide.rates.RateEstimator.observe_overhead`)."""
        path = PathInputs(
            self.prefill_worker,
            self.decode_worker,
            prompt_tokens=self.new + self.cached,
            cached_tokens=self.cached,
            queued_tokens=0,
            moved_tokens=self.moved,
            streams=0,
        )
        predicted = predict_path(rates, path)
        return self.seconds - predicted.modelled_s


@dataclass(frozen=True, slots=True)
class Calibrated:
    """What one start measured: per worker, its prefill samples ``(new, cached, seconds)``
    and decode samples ``(streams, step seconds)``; the overhead samples' count."""

    prefill: dict[str, list[tuple[int, int, float]]]
    decode: dict[str, list[tuple[int, float]]]
    overheads: int
    """Probes whose first token gave an overhead sample (:class:`FirstToken`)."""
    seconds: float


def vocab_size(model_dir: str) -> int:
    """The served model's vocabulary (its ``config.json``), or :data:`DEFAULT_VOCAB` when none is readable."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_VOCAB


def chosen_workers(workers: Sequence[Worker], per_role: int) -> list[Worker]:
    """The first ``per_role`` workers of each role, in fleet order."""
    taken: dict[Role, int] = {}
    chosen = []
    for worker in workers:
        if taken.get(worker.role, 0) < per_role:
            taken[worker.role] = taken.get(worker.role, 0) + 1
            chosen.append(worker)
    return chosen


MetricsReader = Callable[[Worker], Awaitable[EngineLoad | None]]
"""A worker's ``/metrics`` now (``None`` when unreadable)."""


class Calibrator:
    """Times ``workers`` through ``upstream`` into ``rates`` (the module doc). With
    ``read_metrics``, prefills are timed by each worker's own metrics, as its traffic's are."""

    def __init__(
        self,
        upstream: Upstream,
        rates: RateEstimator,
        config: ServerConfig,
        seed: int | None = None,
        read_metrics: MetricsReader | None = None,
    ) -> None:
        self.upstream = upstream
        self.rates = rates
        self.config = config
        self.read_metrics = read_metrics
        self._vocab = max(FIRST_TOKEN_ID + 1, vocab_size(config.model_dir))
        self._rng = random.Random(seed if seed is not None else time.time_ns())

    def _fresh(self, n: int) -> list[int]:
        return [self._rng.randrange(FIRST_TOKEN_ID, self._vocab) for _ in range(n)]

    def _request(self, prompt: list[int], max_tokens: int) -> EngineRequest:
        body = {"model": self.config.model_name, "prompt": prompt, "max_tokens": max_tokens}
        return EngineRequest(Api.COMPLETIONS, {**body, "stream": True, "ignore_eos": True}, prompt)

    async def _token_times(
        self, worker: Worker, prompt: list[int], max_tokens: int, handoff: dict[str, object] | None = None
    ) -> list[float]:
        """Seconds from the send to each event batch of ``worker``'s stream (``handoff``:
        P's params, for ``worker`` to read P's KV)."""
        started = time.perf_counter()
        times = []
        async with self.upstream.stream(worker, self._request(prompt, max_tokens), handoff) as events:
            async for batch in events:
                now = time.perf_counter() - started
                times += [now] * sum(1 for data in batch if data != "[DONE]")
        return times

    def _prefill_probes(self) -> list[tuple[int, int, list[int]]]:
        """Each prefill probe: its new and cached tokens, its prompt (module doc)."""
        limit = self.config.max_prompt_tokens or None
        probes = []
        for length in self.config.calibration_prompt_tokens:
            if limit is not None and length + CACHED_EXTENSION > limit:
                continue
            prompt = self._fresh(length)
            probes += [(length, 0, prompt), (CACHED_EXTENSION, length, prompt + self._fresh(CACHED_EXTENSION))]
        return probes

    async def _metrics(self, worker: Worker, timed: bool) -> EngineLoad | None:
        """``worker``'s metrics now, around a timed probe (``None`` untimed, or without them)."""
        return await self.read_metrics(worker) if timed and self.read_metrics is not None else None

    async def _prefill(self, worker: Worker, samples: list[tuple[int, int, float]], timed: bool) -> list[FirstToken]:
        """``worker``'s prefill probes; timed, their samples and first tokens."""
        first_tokens: list[FirstToken] = []
        for new, cached, prompt in self._prefill_probes():
            before = await self._metrics(worker, timed)
            times = await asyncio.wait_for(self._token_times(worker, prompt, 1), PROBE_TIMEOUT_S)
            if not timed or not times:
                continue
            seconds = await self._observe_prefill(worker, new, cached, times[0], before)
            if seconds is not None:
                samples.append((new, cached, seconds))
                first_tokens.append(FirstToken(worker.name, worker.name, new, cached, 0, times[0]))
        return first_tokens

    async def _handoffs(
        self, p: Worker, d: Worker, samples: list[tuple[int, int, float]], timed: bool
    ) -> list[FirstToken]:
        """P's prefill probes as handoffs that ``d`` reads (module doc); timed, P's samples,
        D's KV reads (by D's metrics) and each handoff's first token."""
        first_tokens: list[FirstToken] = []
        for new, cached, prompt in self._prefill_probes():
            started = time.perf_counter()
            outcome = await self.upstream.prefill(p, self._request(prompt, 1), handoff_request(), PROBE_TIMEOUT_S)
            seconds = time.perf_counter() - started
            if outcome.params is None:
                raise UpstreamError(p, outcome.status or 0, f"handoff probe failed: {outcome.reason} {outcome.detail}")
            if outcome.deferred:
                log.info("%s prefills within its decode worker's call: not calibrated", p.name)
                return first_tokens
            before = await self._metrics(d, timed)
            times = await asyncio.wait_for(self._token_times(d, prompt, 1, outcome.params), PROBE_TIMEOUT_S)
            if not timed:
                continue
            after = await self._metrics(d, before is not None)  # D's read, by its metrics
            if before is not None and after is not None:
                observe_interval(self.rates, d.name, before, after, prefill=False, provisional=True)
            self.rates.observe_prefill(p.name, new, cached, seconds, provisional=True)
            samples.append((new, cached, seconds))
            if times:  # D lacks the new tokens alone: it read the cached ones at the probe before
                first_tokens.append(FirstToken(p.name, d.name, new, cached, new, seconds + times[0]))
        return first_tokens

    async def _observe_prefill(
        self, worker: Worker, new: int, cached: int, first_token_s: float, before: EngineLoad | None
    ) -> float | None:
        """One probe's prefill, fed to the rates as the worker's traffic's is (module doc):
        by its metrics ``before`` the probe and now, else (no metrics) by its first token."""
        if self.read_metrics is None:
            self.rates.observe_prefill(worker.name, new, cached, first_token_s, provisional=True)
            return first_token_s
        after = await self.read_metrics(worker)
        if before is None or after is None or after.rates.prefill_requests <= before.rates.prefill_requests:
            return None
        observe_interval(self.rates, worker.name, before, after, provisional=True)
        return after.rates.prefill_seconds - before.rates.prefill_seconds

    async def _decode(self, worker: Worker, samples: list[tuple[int, float]], timed: bool) -> None:
        for streams in self.config.calibration_decode_streams:
            runs = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        self._token_times(worker, self._fresh(DECODE_PROMPT_TOKENS), DECODE_TOKENS)
                        for _ in range(streams)
                    )
                ),
                PROBE_TIMEOUT_S,
            )
            for times in runs:  # each stream's mean gap is one sample
                if timed and len(times) > 1 and times[-1] > times[0]:
                    step = (times[-1] - times[0]) / (len(times) - 1)
                    self.rates.observe_decode(worker.name, streams, step, provisional=True)
                    samples.append((streams, step))

    async def run(self, workers: Sequence[Worker]) -> Calibrated:
        """Calibrate the chosen ``workers`` one at a time, prefill workers last (their
        handoffs are read by the first chosen decode worker; none without one), each
        with every probe twice, timed the second time (:data:`WARM_PASSES`); never
        raises for a failed probe."""
        started = time.perf_counter()
        prefill: dict[str, list[tuple[int, int, float]]] = {}
        decode: dict[str, list[tuple[int, float]]] = {}
        first_tokens: list[FirstToken] = []
        chosen = chosen_workers(workers, self.config.calibration_workers)
        reader = next((w for w in chosen if w.role is Role.DECODE), None)
        for worker in sorted(chosen, key=lambda w: w.role is Role.PREFILL):
            try:
                for timed in [False] * WARM_PASSES + [True]:
                    if worker.role is not Role.PREFILL:
                        first_tokens += await self._prefill(worker, prefill.setdefault(worker.name, []), timed)
                        await self._decode(worker, decode.setdefault(worker.name, []), timed)
                    elif reader is not None:
                        first_tokens += await self._handoffs(worker, reader, prefill.setdefault(worker.name, []), timed)
            except (UpstreamError, StreamBroke, TimeoutError, OSError) as exc:
                log.warning("calibration of %s stopped (%s); it is predicted from what was measured", worker.name, exc)
        for first in first_tokens:  # against the calibrated fits, every probe in
            path = PrefillPath.of(first.prefill_worker, first.decode_worker)
            self.rates.observe_overhead(first.decode_worker, path, first.residual_s(self.rates), provisional=True)
        result = Calibrated(prefill, decode, len(first_tokens), time.perf_counter() - started)
        log.info(
            "calibrated %d workers in %.1f s: %d prefill, %d decode and %d overhead samples",
            len(prefill),
            result.seconds,
            sum(map(len, prefill.values())),
            sum(map(len, decode.values())),
            result.overheads,
        )
        return result
