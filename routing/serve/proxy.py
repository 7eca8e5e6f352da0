"""Serves one routed request through an :class:`~kvpilot.routing.serve.upstream.Upstream`:
the P->D path with its fallback and retry, and the bookkeeping of every step.

For a :class:`~kvpilot.routing.decide.router.Route`:

- remote prefill: P prefills with ``max_tokens=1`` and a handoff request
  (:func:`kvpilot.kvconnectors.pull_params.handoff_request`), or, at a session's next step,
  D's offer of the session's KV from its last step (vLLM's bidirectional protocol);
  D then decodes with P's returned params. An upstream whose deployment does the
  handoff itself answers P's step at once with a deferred handoff that names P for D's
  call (:attr:`~kvpilot.routing.serve.upstream.PrefillOutcome.deferred`): P is then counted
  as prefilling until D's first token. P is given ``max(server.prefill_timeout_s,
  k x its predicted queue + prefill)`` (:meth:`~kvpilot.routing.decide.rates.TTFTPrediction.prefill_timeout_s`,
  k = :data:`~kvpilot.routing.decide.rates.PREFILL_TIMEOUT_FACTOR`), so a box measured slow
  waits for P. If P fails (an error, that timeout, no params), D prefills the prompt itself: the route
  becomes :attr:`~kvpilot.routing.decide.router.Kind.FALLBACK`, counted in
  ``kvpilot_router_prefill_fallbacks_total``;
- local prefill or co-located: one engine does both. A request for several samples
  (:attr:`~kvpilot.routing.serve.upstream.EngineRequest.parallel_samples`) routed to a
  remote prefill is prefilled on D instead (counted as a local prefill): vLLM would fan
  its samples out into requests that each read P's one handoff.

D's answer reaches the client as D wrote it (tool calls, reasoning, usage, logprobs).

A decode worker that fails before anything reached the client is left out and the
request routed again, up to ``server.max_retries`` times (counted in
``kvpilot_router_retries_total``); a 4xx is the request's fault and is not retried.
Every step is booked: the load ledger (dispatch, first token, a prefill moved to D,
completion), each worker's circuit, each pair's health, the KV events the prefilling
worker must publish, the session's new state and D's offer (handed on to the shared
session store when there is one); with a rate estimator,
P's answer time (what it learns of P's prefill) and the observed over predicted
prefill and TTFT (``kvpilot_router_ttft_observed_over_predicted``).

No aiohttp.web here: the HTTP front hands in a :class:`ClientStream` for streamed
answers and turns the returned :class:`Reply` into its response.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.policies.session_options import OptionPrice
from kvpilot.routing.config import Worker
from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.rates import PrefillPath, RateEstimator, TTFTPrediction, predict_ttft
from kvpilot.routing.decide.router import Kind, Route, Router
from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.event_watch import EventWatch
from kvpilot.routing.health.pair_health import PairHealth
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.serve.upstream import EngineRequest, PrefillFailure, StreamBroke, Upstream, UpstreamError

log = logging.getLogger(__name__)

PREDICTED_TTFT_HEADER = "X-KVPilot-Predicted-TTFT-Ms"
"""The answer's header carrying the route's predicted TTFT in milliseconds, or
:data:`UNCALIBRATED` (when the router has a rate estimator): the client can hold it against
the TTFT it sees."""
UNCALIBRATED = "uncalibrated"
""":data:`PREDICTED_TTFT_HEADER`'s value while no engine's prefill has been measured: the
roofline prior of a preset (an H100 pricing a CPU box's tiny model says 0.009 ms) is no
prediction to hand a client."""


def predicted_ttft_header(prediction: TTFTPrediction) -> str:
    """The route's predicted TTFT in milliseconds, or :data:`UNCALIBRATED` while its prefill is
    priced by the prior alone (a fresh fleet: ``/debug/route`` still shows the prior's figure)."""
    if prediction.prefill.measured_s is None and prediction.prefill.prior_s > 0:
        return UNCALIBRATED
    return f"{prediction.seconds * 1e3:.3f}"


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer for the client: ``status``, a JSON ``payload`` and ``headers``."""

    status: int
    payload: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


def error_reply(status: int, message: str, kind: str = "invalid_request_error") -> Reply:
    """The OpenAI-style error body the router answers with."""
    return Reply(status, {"error": {"message": message, "type": kind, "code": status}})


class ClientStream(Protocol):
    """The client's side of a streamed answer, written in order: ``open`` once, then
    ``send`` per batch of events (each batch one write), then ``close`` once."""

    async def open(self, headers: Mapping[str, str]) -> None: ...
    async def send(self, events: Sequence[str]) -> None: ...
    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """A parsed, routed request. ``engine`` is what the engines are sent; ``started`` is
    ``time.perf_counter()`` at arrival; ``reroute`` routes it again without the given decode
    workers (``None`` when no other worker can decode it)."""

    route: Route
    engine: EngineRequest
    session: SessionId | None
    started: float
    reroute: Callable[[frozenset[WorkerId]], Route | None]


@dataclass(frozen=True, slots=True)
class Begun:
    """A request after :meth:`Proxy.begin`: how it is served (``kind``: a remote prefill
    that fell back is :attr:`~kvpilot.routing.decide.router.Kind.FALLBACK`), the worker that
    prefilled it (or prefills within D's call), P's handoff for D's request (``None``: D
    prefills the prompt itself), whether P prefills within D's call (``deferred``), the
    route's predicted TTFT, and the answer's ``X-KVPilot-*`` headers."""

    kind: Kind
    prefilled_on: WorkerId
    handoff: dict[str, Any] | None
    deferred: bool
    prediction: TTFTPrediction | None
    headers: dict[str, str]


class Proxy:
    """Serves :class:`ProxyRequest` s (see the module doc). ``lock`` guards ``router``
    (the index and sessions it reads), as the index feeder's thread shares it;
    ``event_batches`` gives each subscribed worker's count of applied KV-event batches."""

    def __init__(
        self,
        upstream: Upstream,
        router: Router,
        lock: threading.Lock,
        ledger: LoadLedger,
        metrics: RouterMetrics,
        breaker: CircuitBreaker,
        pair_health: PairHealth,
        event_watch: EventWatch,
        event_batches: Callable[[], Mapping[WorkerId, int]],
        max_retries: int,
        *,
        prefill_timeout_s: float,
        rates: RateEstimator | None = None,
        prefills_timed_here: bool = False,
        session_served: Callable[[SessionId], Awaitable[None]] | None = None,
    ) -> None:
        """``prefill_timeout_s``: the floor of P's timeout (the whole of it without
        ``rates``). ``rates``: predicts each route's TTFT; learns P's prefill from how
        long P took to answer (queue included). ``prefills_timed_here``: the engines'
        own timings are not read (Dynamo's workers have no vLLM ``/metrics``), so every
        prefill that ends at D's first token (D's own, or Dynamo's P's within D's call)
        is timed by that token when nothing was queued ahead of it
        (:meth:`_time_prefill_by_first_token`). ``session_served``: awaited (outside the
        lock, before the answer is returned) with a session whose step was served and
        whose state changed: the shared store writes it; it must not raise and should be
        bounded."""
        self.upstream = upstream
        self.router = router
        self.lock = lock
        self.ledger = ledger
        self.metrics = metrics
        self.breaker = breaker
        self.pair_health = pair_health
        self.event_watch = event_watch
        self.event_batches = event_batches
        self.max_retries = max_retries
        self.prefill_timeout_s = prefill_timeout_s
        self.rates = rates
        self.prefills_timed_here = prefills_timed_here
        self.session_served = session_served

    async def serve(self, request: ProxyRequest, client: ClientStream) -> Reply | None:
        """Serve ``request``, retrying on another decode worker as the module doc says.
        Returns the answer, or ``None`` when it was streamed to ``client``."""
        route, failed = request.route, set[WorkerId]()
        while True:
            try:
                return await self._attempt(request, route, client)
            except UpstreamError as exc:
                self.metrics.upstream_errors.labels(exc.worker.name).inc()
                if exc.status >= 500:
                    self.worker_failed(exc.worker)
                log.warning("request %s: %s", route.request_id, exc)
                if exc.status < 500 or len(failed) >= self.max_retries:
                    return error_reply(exc.status, str(exc), "upstream_error")
                failed.add(exc.worker.name)
                rerouted = request.reroute(frozenset(failed))
                if rerouted is None:  # no other decode worker: the failure stands
                    return error_reply(exc.status, str(exc), "upstream_error")
                route = rerouted
                self.metrics.retries.labels(exc.worker.name).inc()

    async def _attempt(self, request: ProxyRequest, route: Route, client: ClientStream) -> Reply | None:
        """Serve ``route`` once; raises :class:`UpstreamError` when D fails before
        anything was sent to the client (a stream that breaks later ends with an
        error event instead)."""
        begun = await self.begin(request, route)
        if isinstance(begun, Reply):
            return begun
        try:
            reply: Reply | None
            if request.engine.body.get("stream"):  # vLLM streams no kv_transfer_params: no offer to keep
                decode_params = None
                answered = await self._stream(request, route, begun, client)
                reply = None
            else:
                reply, decode_params = await self._unary(request, route, begun.handoff, begun.headers)
                answered = True
            await self.finish(request, route, begun, answered=answered, decode_params=decode_params)
            return reply
        finally:
            self.ledger.complete(route.request_id)

    async def begin(self, request: ProxyRequest, route: Route) -> Begun | Reply:
        """Everything before D's call: the prediction, the ledger's dispatch (a 409
        :class:`Reply` for a request id already in flight), the decision's metrics, and
        P's prefill with its fallback when ``route`` prefills remotely. The caller then
        sends D's request with :attr:`Begun.handoff`, calls :meth:`finish`, and
        completes the request in the ledger whatever happened."""
        rid, p, d = route.request_id, route.prefill_worker.name, route.decode.name
        prediction = self.predict(route)
        try:
            self.ledger.dispatch(rid, p, d, route.chain, route.cached_blocks)
        except ValueError:  # the ledger's "already active"
            return error_reply(409, f"X-Request-Id {rid!r} is already in flight")
        self.metrics.decided(route, time.perf_counter() - request.started)
        try:
            kind, handoff, deferred = route.kind, None, False
            offer = self._session_offer(request.session, route)
            if route.prefill is not None and request.engine.parallel_samples:
                self.ledger.move_prefill(rid, d, route.decode_cached_blocks)
                kind, p = Kind.LOCAL_PREFILL, d
            elif route.prefill is not None:
                self.pair_health.routed(route.prefill.name, route.decode.name, time.monotonic())
                handoff, deferred = await self._prefill(route, request.engine, offer, prediction)
                if handoff is None:
                    kind, p = Kind.FALLBACK, d
        except BaseException:
            self.ledger.complete(rid)
            raise
        headers = {
            "X-Request-Id": rid,
            "X-KVPilot-Route": kind.value,
            "X-KVPilot-Prefill-Worker": p,
            "X-KVPilot-Decode-Worker": d,
            **({PREDICTED_TTFT_HEADER: predicted_ttft_header(prediction)} if prediction is not None else {}),
        }
        return Begun(kind, p, handoff, deferred, prediction, headers)

    async def finish(
        self, request: ProxyRequest, route: Route, begun: Begun, *, answered: bool, decode_params: object = None
    ) -> None:
        """D's answer ended (``answered``: normally): the session's new state, the shared
        store's write, D's circuit, the KV events the prefilling worker must publish.
        The ledger's completion is the caller's."""
        with self.lock:
            self.router.served(request.session, route, decode_params, now=time.time())
        if request.session is not None and self.session_served is not None:
            await self.session_served(request.session)
        if answered:
            self.worker_answered(route.decode)
        self._expect_events(route, begun.prefilled_on)

    def _session_offer(self, session: SessionId | None, route: Route) -> dict[str, Any] | None:
        """D's offer of the session's KV from its last step, when ``route`` pulls it and
        P may still read it (counted either way); taken once."""
        with self.lock:
            offer, use = self.router.take_session_offer(session, route, time.time())
        if use != "none":
            self.metrics.session_offers.labels(use).inc()
        return None if offer is None else dict(offer.params)

    def predict(self, route: Route) -> TTFTPrediction | None:
        """``route``'s predicted TTFT with the load booked now (``None`` without a rate
        estimator): the prefilling worker's booked prefill blocks queue ahead of it, D
        reads what it lacks (nothing for a local prefill), D's booked requests run."""
        lacks = route.prompt_tokens - min(
            route.prompt_tokens, route.decode_cached_blocks * self.router.index.block_size
        )
        return self._predict(route, route.prefill_worker.name, route.prompt_tokens - self._cached_tokens(route), lacks)

    def _cached_tokens(self, route: Route) -> int:
        """The prompt tokens ``route``'s prefilling worker holds (its GPU prefix, at most the prompt)."""
        return min(route.prompt_tokens, route.cached_blocks * self.router.index.block_size)

    def _learn_prefill(self, route: Route, seconds: float) -> None:
        """``route``'s prefilling worker took ``seconds`` for its uncached tokens."""
        assert self.rates is not None
        cached = self._cached_tokens(route)
        self.rates.observe_prefill(route.prefill_worker.name, route.prompt_tokens - cached, cached, seconds)

    def predict_option(self, route: Route, price: OptionPrice) -> TTFTPrediction | None:
        """A session option's predicted TTFT, as :meth:`predict` (``None`` for an
        unavailable option): its prefill worker prefills its ``prefill_tokens`` after the
        rest of the prompt, and a remote one moves its ``moved_tokens`` into D."""
        if price.prefill_worker is None or not price.available:
            return None
        return self._predict(route, WorkerId(price.prefill_worker), price.prefill_tokens, price.moved_tokens)

    def _predict(self, route: Route, prefiller: WorkerId, new: int, moved: int) -> TTFTPrediction | None:
        if self.rates is None:
            return None
        d = route.decode.name
        return predict_ttft(
            self.rates,
            prefiller,
            d,
            new=new,
            cached=route.prompt_tokens - new,
            queued=self.ledger.load(prefiller).active_prefill_blocks * self.router.index.block_size,
            transfer_tokens=moved if prefiller != d else 0,
            streams=self.ledger.load(d).active_requests,
        )

    async def _prefill(
        self, route: Route, engine: EngineRequest, offer: dict[str, Any] | None, prediction: TTFTPrediction | None
    ) -> tuple[dict[str, Any] | None, bool]:
        """P's handoff params for D, or None after a failure (then D prefills; counted),
        and whether P prefills within D's call (deferred: Dynamo's frontend).

        With a session ``offer`` (D's params from the session's last step, vLLM's
        bidirectional protocol) P may pull D's KV of the session: its connector
        verifies the offer against its own tokens and loads only what matches."""
        p = route.prefill
        assert p is not None
        started = time.perf_counter()
        timeout_s = (
            self.prefill_timeout_s if prediction is None else prediction.prefill_timeout_s(self.prefill_timeout_s)
        )
        outcome = await self.upstream.prefill(p, engine, offer if offer is not None else handoff_request(), timeout_s)
        if outcome.params is None:
            if outcome.engine_fault:
                self.worker_failed(p)
                self.pair_health.failed(p.name, route.decode.name, time.monotonic())
            if outcome.failure is PrefillFailure.REFUSED:  # what the router sent P is at fault: a router bug
                log.error(
                    "request %s: %s refused the router's prefill request (%s: %s); local prefill on %s",
                    route.request_id,
                    p.name,
                    outcome.reason,
                    outcome.detail,
                    route.decode.name,
                )
            else:
                log.warning(
                    "request %s: prefill on %s failed (%s); local prefill on %s",
                    route.request_id,
                    p.name,
                    outcome.reason,
                    route.decode.name,
                )
            self.metrics.prefill_failed(p.name, outcome.reason)
            self.ledger.move_prefill(route.request_id, route.decode.name, route.decode_cached_blocks)
            return None, False
        if outcome.deferred:  # P prefills within D's call: its prefill ends at D's first token
            return outcome.params, True
        self.worker_answered(p)
        self.ledger.first_token(route.request_id)
        elapsed = time.perf_counter() - started
        self.metrics.ttft_stage.labels("prefill").observe(elapsed)
        if prediction is not None and prediction.prefill_s > 0:
            self.metrics.predicted_ratio.labels("prefill").observe(elapsed / prediction.prefill_s)
        if self.rates is not None and offer is None:  # a pull's time is not a prefill's
            self._learn_prefill(route, elapsed)
        return outcome.params, False

    async def _unary(
        self, request: ProxyRequest, route: Route, handoff: dict[str, Any] | None, headers: dict[str, str]
    ) -> tuple[Reply, object]:
        """D's answer as D wrote it, and the kv_transfer_params D returned (its offer of the
        session's KV in bidirectional mode; ``None`` when absent)."""
        payload = await self.upstream.complete(route.decode, request.engine, handoff)
        return Reply(200, payload, headers), payload.get("kv_transfer_params")

    async def _stream(self, request: ProxyRequest, route: Route, begun: Begun, client: ClientStream) -> bool:
        """D's stream relayed to ``client``; whether it ended normally (a break is sent
        to the client as an error event and counted against D)."""
        d = route.decode
        sent_at = time.perf_counter()
        async with self.upstream.stream(d, request.engine, begun.handoff) as events:
            await client.open(begun.headers)
            first = True
            try:
                async for batch in events:
                    if first:
                        now = time.perf_counter()
                        self.first_token(route, begun, now - sent_at, now - request.started)
                    first = False
                    await client.send(batch)
            except StreamBroke as exc:
                self.metrics.upstream_errors.labels(d.name).inc()
                self.worker_failed(d)
                message = f"engine {d.name} ({d.url}): stream broke: {exc}"
                await client.send([json.dumps(error_reply(502, message, "upstream_error").payload)])
                await client.close()
                return False
            await client.close()
            return True

    def first_token(self, route: Route, begun: Begun, since_sent_s: float, ttft_s: float) -> None:
        """D's first token came ``since_sent_s`` after D's request was sent and ``ttft_s``
        after the request arrived: the TTFT metrics, the prefill and overhead samples
        (when D did not fall back to prefilling itself), and the ledger's end of prefill."""
        self.metrics.ttft_stage.labels("decode_first_token").observe(since_sent_s)
        self.metrics.ttft.observe(ttft_s)
        prediction = begun.prediction
        if prediction is not None and prediction.seconds > 0:
            self.metrics.predicted_ratio.labels("ttft").observe(ttft_s / prediction.seconds)
        fell_back = route.prefill is not None and begun.handoff is None  # D prefilled after all
        if prediction is not None and self.rates is not None and not fell_back:
            self._time_prefill_by_first_token(route, begun.deferred, prediction, since_sent_s)
            self._learn_overhead(route, prediction, ttft_s)
        self.ledger.first_token(route.request_id)

    def _learn_overhead(self, route: Route, prediction: TTFTPrediction, ttft_s: float) -> None:
        """``route`` ran as predicted and reached its first token after ``ttft_s``: what it
        spent beyond the modelled terms is its path's overhead, once those terms are all
        measurements (:attr:`TTFTPrediction.modelled_measured`)."""
        assert self.rates is not None
        if prediction.modelled_measured:
            path = PrefillPath.LOCAL if route.prefill is None else PrefillPath.REMOTE
            self.rates.observe_overhead(route.decode.name, path, ttft_s - prediction.modelled_s)

    def _time_prefill_by_first_token(
        self, route: Route, deferred: bool, prediction: TTFTPrediction, first_token_s: float
    ) -> None:
        """With ``prefills_timed_here``: D's first token ``first_token_s`` after D's call
        was sent is a prefill sample of the worker that prefilled within that call (D,
        or P when its prefill was ``deferred`` into D's call), its uncached tokens against its
        cached ones, when the prediction queued nothing ahead of it (a queued request's
        wait is not its prefill). The sample holds D's first step and the frontend's hop
        too: on such a fleet they are part of what a prefill costs the client. A
        prefill P answered itself was timed in :meth:`_prefill`."""
        if self.prefills_timed_here and prediction.queue.seconds == 0 and (route.prefill is None or deferred):
            self._learn_prefill(route, first_token_s)

    def _expect_events(self, route: Route, prefilled_on: WorkerId) -> None:
        """``prefilled_on`` served ``route``'s prompt; blocks it did not hold must show up as events."""
        if not self.event_watch.enabled:
            return
        cached = route.cached_blocks if prefilled_on == route.prefill_worker.name else route.decode_cached_blocks
        batches = self.event_batches()
        if route.prompt_blocks > cached and prefilled_on in batches:
            self.event_watch.expect(prefilled_on, batches[prefilled_on], time.monotonic())

    def worker_failed(self, worker: Worker) -> None:
        """An engine failed a request (no answer, timeout, 5xx): count it toward its circuit."""
        if self.breaker.failed(worker.name, time.monotonic()):
            self.metrics.circuit_trips.labels(worker.name).inc()
            self.metrics.circuit_open.labels(worker.name).set(1)
            log.warning(
                "worker %s: circuit open for %.0f s; not routed to until then", worker.name, self.breaker.open_s
            )

    def worker_answered(self, worker: Worker) -> None:
        if self.breaker.succeeded(worker.name):
            self.metrics.circuit_open.labels(worker.name).set(0)
            log.info("worker %s: answered again; circuit closed", worker.name)
