"""The one request driver: a routed request's steps around D's call, booked by the
:class:`~kvpilot.routing.decide.lifecycle.Lifecycle` and recorded in the metrics, for every
front alike. The relay (:class:`~kvpilot.routing.serve.proxy.Proxy`) adds D's call and its
HTTP streaming; Envoy's picker (:class:`~kvpilot.routing.gateway.picker.Picker`) adds the
destination it names and the access log's end.

A request's steps, in order: :meth:`RequestDriver.begin` (the session's claim for its client,
the booking, the decision's metrics, and, for a remote prefill, P's prefill with its
recovery), then D's call by the front, then exactly one end: :meth:`RequestDriver.finish`
(D answered, whole or not), :meth:`RequestDriver.decode_failed` (D failed: counted against
D and its circuit) or :meth:`RequestDriver.failed` (the request ended otherwise). Between
them :meth:`RequestDriver.first_token` (D's first token seen) and
:meth:`RequestDriver.prefill_over` (the prefill presumed done, for a front that never sees
the first token as it happens).

For a remote prefill: P prefills with ``max_tokens=1`` and a handoff request
(:func:`kvpilot.kvconnectors.pull_params.handoff_request`), or, at a session's next step, D's
offer of the session's KV from its last step (vLLM's bidirectional protocol). An upstream
whose deployment does the handoff itself answers P's step at once with a deferred handoff
that names P for D's call (:attr:`~kvpilot.routing.serve.upstream.PrefillOutcome.deferred`):
P is then counted as prefilling until D's first token. P is given ``max(floor, k x its
predicted queue + prefill)`` (:meth:`~kvpilot.routing.decide.rates.TTFTPrediction.prefill_timeout_s`,
k = :data:`~kvpilot.routing.decide.rates.PREFILL_TIMEOUT_FACTOR`). If P fails (an error, that
timeout, no params), the lifecycle decides on measured costs
(:func:`kvpilot.policies.failure.recover`): another prefill worker (once), D prefilling the
prompt itself within its jitter budget (the route becomes
:attr:`~kvpilot.routing.decide.router.Kind.FALLBACK`, counted in
``kvpilot_router_prefill_fallbacks_total``), or a 503 at once naming why; each counted in
``kvpilot_router_prefill_recoveries_total``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.kvconnectors.pull_params import handoff_request, with_hold
from kvpilot.policies.failure import Recovery
from kvpilot.routing.decide.lifecycle import InFlight, Lifecycle, Ticket
from kvpilot.routing.decide.rates import TTFTPrediction
from kvpilot.routing.decide.router import Kind, Route
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.serve.upstream import EngineRequest, PrefillFailure, Upstream

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


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """A parsed, routed request. ``engine`` is what the engines are sent; ``started`` is
    ``time.perf_counter()`` at arrival; ``reroute`` routes it again without the given decode
    workers (``None`` when no other worker can decode it); ``client`` is its sender's address
    as the front saw it (``None``: unknown, and its session counts for no client's
    ``sessions.max_sessions_per_client``)."""

    route: Route
    engine: EngineRequest
    session: SessionId | None
    started: float
    reroute: Callable[[frozenset[WorkerId]], Route | None]
    client: str | None = None


@dataclass(frozen=True, slots=True)
class Begun:
    """A request after :meth:`RequestDriver.begin`: its booking (:class:`~kvpilot.routing.decide.lifecycle.Ticket`:
    how it is served, the worker that prefills it, whether P prefills within D's call, the
    predicted TTFT), P's handoff for D's request (``None``: D prefills the prompt itself),
    and the answer's ``X-KVPilot-*`` headers."""

    ticket: Ticket
    handoff: dict[str, Any] | None
    headers: dict[str, str]


class RequestDriver:
    """Drives requests through ``lifecycle`` (see the module doc): P's prefill through
    ``upstream``, what each step returns recorded in ``metrics``."""

    def __init__(
        self,
        upstream: Upstream,
        lifecycle: Lifecycle,
        metrics: RouterMetrics,
        *,
        prefill_timeout_s: float,
        session_served: Callable[[SessionId], Awaitable[None]] | None = None,
    ) -> None:
        """``prefill_timeout_s``: the floor of P's timeout (the whole of it without
        predictions). ``session_served``: awaited (before the answer is returned) with a session
        whose step was served and whose state changed: the shared store writes it; it must not
        raise and should be bounded."""
        self.upstream = upstream
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.prefill_timeout_s = prefill_timeout_s
        self.session_served = session_served

    async def begin(self, request: ProxyRequest, route: Route) -> Begun | Reply:
        """Everything before D's call: the session's claim for ``request.client`` (a retry
        claims it again, a no-op), the booking (a 409 :class:`Reply` for a request id already
        in flight), the decision's metrics, and P's prefill with its recovery when ``route``
        prefills remotely (a 503 :class:`Reply` when the recovery is an error). The caller
        then calls D with :attr:`Begun.handoff` and ends the ticket (module doc)."""
        if request.client is not None:
            self.lifecycle.claim_session(request.session, request.client)
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
        prediction = ticket.prediction
        headers = {
            "X-Request-Id": ticket.request_id,
            "X-KVPilot-Route": ticket.kind.value,
            "X-KVPilot-Prefill-Worker": ticket.prefilled_on,
            "X-KVPilot-Decode-Worker": ticket.route.decode.name,
            **({PREDICTED_TTFT_HEADER: predicted_ttft_header(prediction)} if prediction is not None else {}),
        }
        return Begun(ticket, handoff, headers)

    def first_token(self, ticket: Ticket, since_sent_s: float, ttft_s: float) -> None:
        """D's first token came ``since_sent_s`` after D's request was sent and ``ttft_s``
        after the request arrived: the lifecycle's end of prefill and the TTFT metrics."""
        self.metrics.ttft_stage.labels("decode_first_token").observe(since_sent_s)
        self.metrics.ttft.observe(ttft_s)
        ratio = self.lifecycle.first_token(ticket, since_sent_s, ttft_s)
        if ratio is not None:
            self.metrics.predicted_ratio.labels("ttft").observe(ratio)

    def prefill_over(self, ticket: Ticket) -> None:
        """The ticket's prefill is presumed done (the ledger stops counting it), for a front
        that sees no first token as it happens."""
        self.lifecycle.prefill_over(ticket)

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

    def decode_failed(self, ticket: Ticket, *, engine_fault: bool) -> None:
        """D failed the ticket (``engine_fault``: a 5xx, a broken stream, a D that left; else
        D refused the request, a 4xx): counted against D, and against its circuit when it is
        D's fault. No session step is booked."""
        self.metrics.upstream_errors.labels(ticket.route.decode.name).inc()
        self.metrics.circuit_changed(self.lifecycle.decode_failed(ticket, engine_fault=engine_fault))

    def failed(self, ticket: Ticket) -> None:
        """The ticket ended otherwise (cancelled, or no one's fault): its booking is undone;
        a no-op for a ticket that already ended."""
        self.lifecycle.failed(ticket)

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
