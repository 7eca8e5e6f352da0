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
  waits for P. If P fails (an error, that timeout, no params), the request's
  :class:`~kvpilot.routing.decide.lifecycle.Lifecycle` decides on measured costs
  (:func:`kvpilot.policies.failure.recover`): another prefill worker (once), D prefilling
  the prompt itself within its jitter budget (the route becomes
  :attr:`~kvpilot.routing.decide.router.Kind.FALLBACK`, counted in
  ``kvpilot_router_prefill_fallbacks_total``), or a 503 at once naming why; each counted in
  ``kvpilot_router_prefill_recoveries_total``;
- local prefill or co-located: one engine does both. A request for several samples
  (:attr:`~kvpilot.routing.serve.upstream.EngineRequest.parallel_samples`) routed to a
  remote prefill is prefilled on D instead (counted as a local prefill): vLLM would fan
  its samples out into requests that each read P's one handoff.

D's answer reaches the client as D wrote it (tool calls, reasoning, usage, logprobs), but
for what :mod:`kvpilot.routing.serve.withheld` withholds, whole or streamed: D's offer of the
session's KV (``kv_transfer_params``: ``null`` in a whole answer, gone from a streamed chunk)
and any top-level ``kvpilot_*`` key.

A decode worker that fails before anything reached the client is left out and the
request routed again, up to ``server.max_retries`` times (counted in
``kvpilot_router_retries_total``); a 4xx is the request's fault and is not retried.
Every step is booked by the :class:`~kvpilot.routing.decide.lifecycle.Lifecycle` (the
ledger, circuits, pair health, sessions and their offers, what the rates learn); the
proxy records the outcomes it returns as metrics (the observed over predicted prefill and
TTFT: ``kvpilot_router_ttft_observed_over_predicted``) and hands a session whose state
changed to the shared session store when there is one.

No aiohttp.web here: the HTTP front hands in a :class:`ClientStream` for streamed
answers and turns the returned :class:`Reply` into its response.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpilot.kvconnectors.pull_params import handoff_request, with_hold
from kvpilot.policies.failure import Recovery
from kvpilot.routing.decide.lifecycle import InFlight, Lifecycle, Ticket
from kvpilot.routing.decide.rates import TTFTPrediction
from kvpilot.routing.decide.router import Kind, Route
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.serve.upstream import EngineRequest, PrefillFailure, StreamBroke, Upstream, UpstreamError
from kvpilot.routing.serve.withheld import scrubbed_answer, scrubbed_events

log = logging.getLogger(__name__)

PREDICTED_TTFT_HEADER = "X-KVPilot-Predicted-TTFT-Ms"
"""The answer's header carrying the route's predicted TTFT in milliseconds, or
:data:`UNCALIBRATED` (when the router has a rate estimator): the client can hold it against
the TTFT it sees."""
UNCALIBRATED = "uncalibrated"
""":data:`PREDICTED_TTFT_HEADER`'s value while no engine's prefill has been measured: the
roofline prior of a preset, priced for hardware the engines may not run on, is no
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
    """A request after :meth:`Proxy.begin`: its booking (:class:`~kvpilot.routing.decide.lifecycle.Ticket`:
    how it is served, the worker that prefills it, whether P prefills within D's call, the
    predicted TTFT), P's handoff for D's request (``None``: D prefills the prompt itself),
    and the answer's ``X-KVPilot-*`` headers."""

    ticket: Ticket
    handoff: dict[str, Any] | None
    headers: dict[str, str]


class Proxy:
    """Serves :class:`ProxyRequest` s (see the module doc) through ``upstream``, booked by
    ``lifecycle``; records what each step returns in ``metrics``."""

    def __init__(
        self,
        upstream: Upstream,
        lifecycle: Lifecycle,
        metrics: RouterMetrics,
        max_retries: int,
        *,
        prefill_timeout_s: float,
        session_served: Callable[[SessionId], Awaitable[None]] | None = None,
    ) -> None:
        """``prefill_timeout_s``: the floor of P's timeout (the whole of it without
        predictions). ``session_served``: awaited (outside the lock, before the answer is
        returned) with a session whose step was served and whose state changed: the
        shared store writes it; it must not raise and should be bounded."""
        self.upstream = upstream
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.max_retries = max_retries
        self.prefill_timeout_s = prefill_timeout_s
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
        ticket = begun.ticket
        try:
            reply: Reply | None
            if request.engine.body.get("stream"):
                answered, decode_params = await self._stream(request, begun, client)
                reply = None
            else:
                reply, decode_params = await self._unary(request, begun)
                answered = True
        except UpstreamError as exc:
            self.metrics.circuit_changed(self.lifecycle.decode_failed(ticket, engine_fault=exc.status >= 500))
            raise
        except BaseException:
            self.lifecycle.failed(ticket)
            raise
        await self.finish(ticket, answered=answered, decode_params=decode_params)
        return reply

    async def begin(self, request: ProxyRequest, route: Route) -> Begun | Reply:
        """Everything before D's call: the booking (a 409 :class:`Reply` for a request id
        already in flight), the decision's metrics, and P's prefill with its recovery when
        ``route`` prefills remotely (a 503 :class:`Reply` when the recovery is an error).
        The caller then sends D's request with :attr:`Begun.handoff` and ends the ticket:
        :meth:`finish`, or the lifecycle's ``decode_failed`` or ``failed``."""
        try:
            ticket = self.lifecycle.dispatch(route, request.session, parallel_samples=request.engine.parallel_samples)
        except InFlight as exc:
            return error_reply(409, str(exc))
        self.metrics.decided(route, time.perf_counter() - request.started)
        if ticket.offer_use != "none":
            self.metrics.session_offers.labels(ticket.offer_use).inc()
        handoff: dict[str, Any] | Reply | None = None
        try:
            if ticket.kind is Kind.REMOTE_PREFILL:
                handoff = await self._prefill(ticket, request.engine)
        except BaseException:
            self.lifecycle.failed(ticket)
            raise
        if isinstance(handoff, Reply):
            return handoff
        d = ticket.route.decode.name
        prediction = ticket.prediction
        headers = {
            "X-Request-Id": ticket.request_id,
            "X-KVPilot-Route": ticket.kind.value,
            "X-KVPilot-Prefill-Worker": ticket.prefilled_on,
            "X-KVPilot-Decode-Worker": d,
            **({PREDICTED_TTFT_HEADER: predicted_ttft_header(prediction)} if prediction is not None else {}),
        }
        return Begun(ticket, handoff, headers)

    async def finish(self, ticket: Ticket, *, answered: bool, decode_params: object = None) -> None:
        """D's answer ended (``answered``: whole): the lifecycle's end, its circuit change,
        and the shared store's write of a session whose step was served."""
        ended = self.lifecycle.finished(ticket, answered=answered, decode_params=decode_params)
        self.metrics.circuit_changed(ended.circuit)
        if answered and ticket.fell_back:
            self.metrics.fallbacks.inc()
            if ticket.refused_by is not None:  # P refused what D served: the router's request to P was at fault
                log.error(
                    "request %s: %s refused the router's prefill request, which %s served: a router bug",
                    ticket.request_id,
                    ticket.refused_by,
                    ticket.route.decode.name,
                )
        if ended.session_changed and ticket.session is not None and self.session_served is not None:
            await self.session_served(ticket.session)

    async def _prefill(self, ticket: Ticket, engine: EngineRequest) -> dict[str, Any] | Reply | None:
        """P's handoff params for D; ``None`` when P failed and D prefills (the lifecycle's
        recovery, counted); an error :class:`Reply` when the recovery is to fail at once.
        P's params say whether P prefills within D's call (deferred: Dynamo's frontend).

        With a session offer (D's params from the session's last step, vLLM's
        bidirectional protocol) P may pull D's KV of the session: its connector
        verifies the offer against its own tokens and loads only what matches."""
        while True:
            p = ticket.route.prefill
            assert p is not None
            started = time.perf_counter()
            timeout_s = self.lifecycle.prefill_timeout_s(ticket, self.prefill_timeout_s)
            params = ticket.offer if ticket.offer is not None else handoff_request()
            outcome = await self.upstream.prefill(p, engine, params, timeout_s)
            if outcome.params is not None:
                elapsed = time.perf_counter() - started
                change, ratio = self.lifecycle.prefilled(ticket, elapsed, deferred=outcome.deferred)
                self.metrics.circuit_changed(change)
                if not outcome.deferred:
                    self.metrics.ttft_stage.labels("prefill").observe(elapsed)
                if ratio is not None:
                    self.metrics.predicted_ratio.labels("prefill").observe(ratio)
                if outcome.deferred or ticket.hold is None:  # a deferred handoff is P's header for D's call
                    return outcome.params
                self.metrics.held(ticket.hold)
                return with_hold(outcome.params, ticket.hold.hold)
            refused = outcome.failure is PrefillFailure.REFUSED
            failed = self.lifecycle.prefill_failed(ticket, engine_fault=outcome.engine_fault, refused=refused)
            self.metrics.circuit_changed(failed.circuit)
            action = failed.decision.action
            self.metrics.prefill_failed(p.name, outcome.reason, action)
            log.log(  # a refusal is most likely the client's body: D's answer tells (see finish)
                logging.INFO if refused else logging.WARNING,
                "request %s: prefill on %s failed (%s%s); %s: %s",
                ticket.request_id,
                p.name,
                outcome.reason,
                f": {outcome.detail}" if outcome.detail else "",
                action.value,
                failed.decision.reason,
            )
            if action is Recovery.OTHER_PREFILL:
                continue
            if action is Recovery.LOCAL:
                return None
            self.lifecycle.failed(ticket)
            message = f"prefill on {p.name} failed ({outcome.reason}) and {failed.decision.reason}"
            return error_reply(503, message, "upstream_error")

    async def _unary(self, request: ProxyRequest, begun: Begun) -> tuple[Reply, object]:
        """D's answer as D wrote it but for what :func:`~kvpilot.routing.serve.withheld.scrubbed_answer`
        withholds, and D's ``kv_transfer_params`` (its offer of the session's KV in bidirectional
        mode; ``None`` when absent). The offer names where the session's KV lives and how to read
        it: it is the router's, never a client's."""
        payload = await self.upstream.complete(begun.ticket.route.decode, request.engine, begun.handoff)
        answer, offer = scrubbed_answer(payload)
        return Reply(200, answer, begun.headers), offer

    async def _stream(self, request: ProxyRequest, begun: Begun, client: ClientStream) -> tuple[bool, object]:
        """D's stream relayed to ``client``, each batch of events as it comes, less what
        :func:`~kvpilot.routing.serve.withheld.scrubbed_events` withholds; whether it ended
        normally (a break is sent to the client as an error event and counted against D), and
        D's offer where a chunk carried one (``None``: none, or the stream broke)."""
        ticket = begun.ticket
        d = ticket.route.decode
        sent_at = time.perf_counter()
        async with self.upstream.stream(d, request.engine, begun.handoff) as events:
            await client.open(begun.headers)
            first = True
            offer: object = None
            try:
                async for batch in events:
                    if first:
                        now = time.perf_counter()
                        self.first_token(ticket, now - sent_at, now - request.started)
                    first = False
                    scrubbed, carried = scrubbed_events(batch)
                    offer = carried if carried is not None else offer
                    await client.send(scrubbed)
            except StreamBroke as exc:
                self.metrics.upstream_errors.labels(d.name).inc()
                self.metrics.circuit_changed(self.lifecycle.decode_failed(ticket, engine_fault=True))
                message = f"engine {d.name} ({d.url}): stream broke: {exc}"
                await client.send([json.dumps(error_reply(502, message, "upstream_error").payload)])
                await client.close()
                return False, None
            await client.close()
            return True, offer

    def first_token(self, ticket: Ticket, since_sent_s: float, ttft_s: float) -> None:
        """D's first token came ``since_sent_s`` after D's request was sent and ``ttft_s``
        after the request arrived: the lifecycle's end of prefill and the TTFT metrics."""
        self.metrics.ttft_stage.labels("decode_first_token").observe(since_sent_s)
        self.metrics.ttft.observe(ttft_s)
        ratio = self.lifecycle.first_token(ticket, since_sent_s, ttft_s)
        if ratio is not None:
            self.metrics.predicted_ratio.labels("ttft").observe(ratio)
