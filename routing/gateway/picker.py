"""kvpilot's endpoint picker: the router's decision for a request that Envoy carries.

Envoy hands the picker each request's headers and whole body (:mod:`kvpilot.routing.gateway.extproc`)
and, when the request has ended, one access-log entry (:mod:`kvpilot.routing.gateway.access_log`).
Between the two the stream runs from the engine to the client through Envoy alone: no
response byte reaches Python.

:meth:`Picker.pick` does what the HTTP front does up to D's call
(:meth:`~kvpilot.routing.serve.app.RouterServer.intake`: check, the engine's token ids, session, route, TTFT
SLO; then :meth:`~kvpilot.routing.serve.proxy.Proxy.begin`: ledger, metrics, and P's prefill with its
fallback when the route prefills remotely on vLLM engines; beside Dynamo P's step is deferred
into D's call) and answers with D's :class:`~kvpilot.routing.serve.upstream.Destination` and the
answer's ``X-KVPilot-*`` headers (Envoy copies them to the response, see
``deploy/envoy_spec.py``). :meth:`Picker.ended` does what the proxy does after D's stream:
the first-token samples (from Envoy's time to the destination's first body byte), the
session's new state, D's circuit, the ledger's completion.

Which signal feeds which term:

- the ledger's end of prefill: at the route's predicted TTFT after the pick (a timer), or the
  request's end if that comes first; the picker never sees the first token as it happens;
- the TTFT metrics, the prefill rate (a prefill timed by its first token) and each path's
  overhead: the access log's first-body-byte time, less the picker's own time before it
  answered;
- the session's last worker and the shared store's write, D's circuit, the KV events the
  prefilling worker must publish: the access log's status;
- a request whose entry never comes (Envoy restarted before sending it) is ended unanswered
  after ``server.request_timeout_s`` (:meth:`Picker.expire`).

D's end-of-turn offer of a session's KV (vLLM's bidirectional mode) is in D's response body,
which the picker does not read: through Envoy a session's next step never pulls from D by
that offer (option ``pull`` falls to the next cheapest option).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpilot.routing.decide.router import Route
from kvpilot.routing.serve.admission import Rejected
from kvpilot.routing.serve.app import UNAUTHORIZED_MESSAGE, RouterServer
from kvpilot.routing.serve.chat import ChatError
from kvpilot.routing.serve.proxy import Begun, ProxyRequest, Reply, error_reply
from kvpilot.routing.serve.refusals import BadRequest
from kvpilot.routing.serve.upstream import Api, Destination, UpstreamError

log = logging.getLogger(__name__)


class Refused(Exception):
    """The picker answers the client itself: ``status`` and an OpenAI-style JSON error,
    with ``headers`` (``Retry-After`` for load)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **headers: str) -> None:
        super().__init__(message)
        self.status = status
        self.payload = error_reply(status, message, kind).payload
        self.headers = headers


@dataclass(frozen=True, slots=True)
class Picked:
    """Where D's request goes, the body it is sent (``None``: the client's, unchanged) and
    the headers the answer carries."""

    destination: Destination
    body: bytes | None
    answer_headers: dict[str, str]

    @property
    def request_id(self) -> str:
        return self.answer_headers["X-Request-Id"]


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """One access-log entry: the request's id, its status (0 when no response started),
    and the seconds from its arrival to the destination's first body byte (``None``:
    none came) and to its last byte sent to the client."""

    request_id: str
    status: int
    first_body_s: float | None
    duration_s: float


@dataclass(slots=True)
class _InFlight:
    request: ProxyRequest
    begun: Begun
    picked_s: float
    """Seconds from the request's arrival to the picker's answer (D's request leaves then)."""
    prefill_timer: asyncio.TimerHandle | None


class Picker:
    """Picks for Envoy over a started :class:`~kvpilot.routing.serve.app.RouterServer` (see the
    module doc). Runs on the router's event loop; not thread-safe."""

    def __init__(self, server: RouterServer) -> None:
        self._server = server
        self._in_flight: dict[str, _InFlight] = {}

    async def pick(self, path: str, headers: Mapping[str, str], raw: bytes, arrived: float) -> Picked:
        """The destination for one request that arrived at ``arrived``
        (``time.perf_counter()``): ``path`` and ``headers`` as the client sent them (with
        Envoy's ``x-request-id``), ``raw`` its whole body. Raises :class:`Refused`: 404 for
        another path, 401 without the API key (``server.api_key_env``), 400 or 413 for a bad
        body (naming the problem), 409 for a request id
        in flight, 429 or 503 for a predicted TTFT over the SLO, 503 when no worker can
        serve it, 502 when the chosen worker left."""
        try:
            api = Api(path.split("?", 1)[0])
        except ValueError:
            raise Refused(
                404, f"kvpilot serves POST {Api.COMPLETIONS.value} and {Api.CHAT.value}, not {path!r}"
            ) from None
        server = self._server
        if not server.authorized(headers):
            raise Refused(401, UNAUTHORIZED_MESSAGE, "authentication_error", **{"www-authenticate": "Bearer"})
        if len(raw) > server.config.server.max_body_bytes:
            raise Refused(413, str(server.intake.body_too_large()))
        try:
            intake = await server.intake.take(headers, server.intake.checked_body(raw, api), api, arrived)
        except (BadRequest, ChatError) as exc:
            raise Refused(getattr(exc, "status", 400), str(exc)) from None
        except Rejected as exc:
            server.metrics.rejected.labels(exc.reason.value).inc()
            raise Refused(exc.status, str(exc), "overloaded", **{"retry-after": str(exc.retry_after_s)}) from None
        request, route = intake.request, intake.request.route
        begun = await server.proxy.begin(request, route)
        if isinstance(begun, Reply):
            raise Refused(begun.status, begun.payload["error"]["message"])
        try:
            destination = server.proxy.upstream.destination(route.decode, request.engine, begun.handoff)
        except UpstreamError as exc:
            server.proxy.worker_failed(exc.worker)
            server.ledger.complete(route.request_id)
            raise Refused(exc.status, str(exc), "upstream_error") from None
        picked_s = time.perf_counter() - arrived
        self._in_flight[route.request_id] = _InFlight(
            request, begun, picked_s, self._prefill_timer(route, begun, picked_s)
        )
        unchanged = destination.body == intake.client_body  # no session fields, no handoff
        return Picked(destination, None if unchanged else body_bytes(destination.body), begun.headers)

    def _prefill_timer(self, route: Route, begun: Begun, picked_s: float) -> asyncio.TimerHandle | None:
        """Ends the request's prefill in the ledger at its predicted TTFT (see the module
        doc); ``None`` when nothing is predicted (the request's end does it)."""
        prediction = begun.prediction
        if prediction is None:
            return None
        delay = max(0.0, prediction.seconds - picked_s)
        return asyncio.get_running_loop().call_later(delay, self._server.ledger.first_token, route.request_id)

    async def ended(self, end: RequestEnd) -> None:
        """Envoy's entry for a request that ended: the proxy's bookkeeping after D's
        stream (see the module doc). An entry for a request the picker did not pick (it
        refused it, or picked it before a restart) is ignored."""
        item = self._in_flight.pop(end.request_id, None)
        if item is None:
            return
        if item.prefill_timer is not None:
            item.prefill_timer.cancel()
        proxy, route = self._server.proxy, item.request.route
        answered = end.status == 200  # an expired request (status 0) counts against no worker
        try:
            if answered and end.first_body_s is not None:
                since_sent = max(0.0, end.first_body_s - item.picked_s)
                proxy.first_token(route, item.begun, since_sent, end.first_body_s)
            elif end.status >= 500:  # 0: the client left before any answer, not D's fault
                proxy.metrics.upstream_errors.labels(route.decode.name).inc()
                proxy.worker_failed(route.decode)
            await proxy.finish(item.request, route, item.begun, answered=answered)
        finally:
            self._server.ledger.complete(end.request_id)

    async def expire(self, now: float) -> None:
        """End, unanswered, every request picked more than ``server.request_timeout_s``
        before ``now`` (``time.perf_counter()``) whose entry never came."""
        limit = self._server.config.server.request_timeout_s
        stale = [rid for rid, item in self._in_flight.items() if now - item.request.started > limit]
        for rid in stale:
            log.warning("request %s: no access-log entry within %.0f s; ended as unanswered", rid, limit)
            await self.ended(RequestEnd(rid, 0, None, limit))


def body_bytes(body: Mapping[str, Any]) -> bytes:
    """D's body as sent: compact JSON (msgspec: 14x json's speed on a 14K-token prompt)."""
    return msgspec.json.encode(body)
