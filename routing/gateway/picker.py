"""kvpilot's endpoint picker: the router's decision for a request that Envoy carries.

Envoy hands the picker each request's headers and whole body (:mod:`kvpilot.routing.gateway.extproc`)
and, when the request has ended, one access-log entry (:mod:`kvpilot.routing.gateway.access_log`).
Between the two the stream runs from the engine to the client through Envoy alone: no
response byte reaches Python.

:meth:`Picker.pick` drives the request's :class:`~kvpilot.routing.decide.lifecycle.Lifecycle`
as the relay does up to D's call: an admission slot (``server.max_concurrent_requests`` and
its queue: 429 or 503 with ``Retry-After``, as GAIE's protocol lets an endpoint picker
refuse), the intake (check, the engine's token ids, session, route, TTFT SLO), then
:meth:`~kvpilot.routing.serve.driver.RequestDriver.begin`, as the relay (the session's claim
for its client, the TCP peer Envoy saw: ``sessions.max_sessions_per_client``; the booking and
P's prefill with its
recovery when the route prefills remotely on vLLM engines: another P, D, or a 503; beside
Dynamo P's step is deferred into D's call). It answers with D's
:class:`~kvpilot.routing.serve.upstream.Destination` and the answer's ``X-KVPilot-*`` headers
(Envoy copies them to the response, see ``deploy/envoy_spec.py``). :meth:`Picker.ended`
does what the relay does after D's stream (the first-token samples from Envoy's time to
the destination's first body byte, the lifecycle's end) and frees the slot.

Which signal feeds which term:

- the ledger's end of prefill: at the route's predicted TTFT after the pick (a timer), or the
  request's end if that comes first; the picker never sees the first token as it happens;
- the TTFT metrics, the prefill rate (a prefill timed by its first token) and each path's
  overhead: the access log's first-body-byte time, less the picker's own time before it
  answered;
- the session's last worker and the shared store's write, D's circuit, the KV events the
  prefilling worker must publish: the access log's status and response flags (a stream D
  broke after its 200's headers is D's failure, and books no session step);
- a request whose entry never comes (Envoy restarted before sending it) is ended unanswered
  after ``server.request_timeout_s`` (:meth:`Picker.expire`).

The destination is an ``IP:port``: Envoy's original-destination cluster connects to
nothing else, and GAIE's protocol names a pod's address. Engines are named by host name
in the router's config (a Kubernetes Service, a host of one's own), so the picker
resolves each name through the system's resolver (DNS, ``/etc/hosts``) off the request
path (:class:`Addresses`: refreshed on a timer by :mod:`kvpilot.routing.gateway.service`,
read per request from memory). DNS rather than watching pods through the Kubernetes API:
it needs no API access, RBAC or client library in the router, and works the same on
hosts of one's own; in a cluster each engine's Service is headless, so its name resolves to
its pod's IP (``deploy/k8s/workloads.py``). The cost: an engine whose pod moved is reached
at its old address until the next refresh (and the resolver's cache) sees the new one;
until then D's request fails as a worker that left does.

What the relay does and Envoy's path cannot: D's end-of-turn offer of a session's KV (vLLM's
bidirectional mode) is in D's response body, which the picker does not read, so through
Envoy a session's next step never pulls from D by that offer (option ``pull`` falls to the
next cheapest option); and a D that fails before its first byte is not retried on another
D (Envoy's original-destination cluster has only the one address the picker named).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpilot.routing.config import ServerConfig, Worker
from kvpilot.routing.core import UNAUTHORIZED_MESSAGE
from kvpilot.routing.gateway.contract import is_ip_address
from kvpilot.routing.refusals import BadRequest
from kvpilot.routing.serve.admission import Admission, Rejected
from kvpilot.routing.serve.chat import ChatError
from kvpilot.routing.serve.driver import Begun, ProxyRequest, Reply, RequestDriver, error_reply
from kvpilot.routing.serve.intake import RequestIntake
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


UPSTREAM_BROKE = frozenset({"UR", "UC", "UF", "UT", "UO", "URX", "UPE"})
"""Envoy's response flags that mean the destination failed the request: it reset the stream
or closed the connection (``UR``, ``UC``, mid-stream too), could not be reached (``UF``),
timed out (``UT``), overflowed (``UO``, ``URX``) or broke the protocol (``UPE``)."""
CLIENT_LEFT = "DC"
"""Envoy's response flag for a client that closed its connection first."""


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """One access-log entry: the request's id, its status (0 when no response started),
    the seconds from its arrival to the destination's first body byte (``None``: none
    came) and to its last byte sent to the client, and Envoy's response flags."""

    request_id: str
    status: int
    first_body_s: float | None
    duration_s: float
    flags: frozenset[str] = frozenset()

    @property
    def answered(self) -> bool:
        """The destination's whole answer reached the client: a 200 neither side broke off."""
        return self.status == 200 and not self.upstream_broke and CLIENT_LEFT not in self.flags

    @property
    def upstream_broke(self) -> bool:
        """The destination failed it: a 5xx, or a stream it broke after a 200's headers."""
        return self.status >= 500 or bool(self.flags & UPSTREAM_BROKE)


@dataclass(slots=True)
class _InFlight:
    request: ProxyRequest
    begun: Begun
    picked_s: float
    """Seconds from the request's arrival to the picker's answer (D's request leaves then)."""
    prefill_timer: asyncio.TimerHandle | None


Lookup = Callable[[str], Awaitable[str]]
"""A host name's address, resolved without blocking the event loop; raises ``OSError``."""


async def resolve_host(host: str) -> str:
    """``host``'s first IPv4 address by the system's resolver (``getaddrinfo``, on the
    event loop's thread pool), else its first IPv6 one: IPv4 first because an engine bound
    to ``0.0.0.0`` or ``127.0.0.1`` (vLLM's ``--host``) is not reached on ``localhost``'s
    ``::1``. Raises ``OSError`` when it has neither."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    for family in (socket.AF_INET, socket.AF_INET6):
        for info in infos:
            if info[0] == family:
                return str(info[4][0])
    raise OSError(f"{host!r} has no IPv4 or IPv6 address")


class Addresses:
    """The address the picker names for each destination host (see the module doc): a
    host name as ``lookup`` last resolved it, an IP address as written. Runs on the
    router's event loop; not thread-safe."""

    def __init__(self, lookup: Lookup = resolve_host) -> None:
        self._lookup = lookup
        self._ips: dict[str, str] = {}
        self._failing: set[str] = set()

    async def refresh(self, hosts: Iterable[str] = ()) -> None:
        """Resolve ``hosts`` and every host name already seen, concurrently. A name that
        no longer resolves keeps its last address, one never resolved stays unknown
        (:meth:`ip_port` tries it again); a name that stops resolving and a moved one are
        logged once. Never raises ``OSError``."""
        names = sorted({h for h in (*hosts, *self._ips) if not is_ip_address(h)})
        found = await asyncio.gather(*(self._lookup(h) for h in names), return_exceptions=True)
        for host, ip in zip(names, found, strict=True):
            if isinstance(ip, OSError):
                if host not in self._failing:
                    log.warning("%s does not resolve (%s); kept: %s", host, ip, self._ips.get(host, "no address"))
                self._failing.add(host)
                continue
            if isinstance(ip, BaseException):
                raise ip
            self._failing.discard(host)
            old = self._ips.get(host)
            if old is not None and old != ip:
                log.info("%s moved from %s to %s", host, old, ip)
            self._ips[host] = ip

    async def ip_port(self, worker: Worker, host_port: str) -> str:
        """``host_port`` (``host:port``, the host bare, an IPv6 address too) as the
        ``IP:port`` (``[v6]:port``) Envoy connects to for ``worker``: from memory, or,
        for a host never seen, resolved once now (off the event loop) and kept. Raises
        :class:`UpstreamError` (502) for a host that does not resolve."""
        host, _, port = host_port.rpartition(":")
        ip = self._ips.get(host)
        if ip is None:
            try:
                ip = host if is_ip_address(host) else await self._lookup(host)
            except OSError as exc:
                raise UpstreamError(worker, 502, f"its host {host!r} does not resolve: {exc}") from None
            self._ips[host] = ip
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Picker:
    """Picks for Envoy (see the module doc), given at construction what it drives: the
    request ``intake`` (check, token ids, session, route, TTFT SLO), the request ``driver``
    (its steps before and after D's call, booked by the lifecycle, with the metrics, and
    the upstream that names D's destination), ``admission`` (one slot from the pick to the
    access log's entry), the ``server`` section's limits, ``authorized`` (the API key check)
    and the destinations' ``addresses``. Runs on the router's event loop; not thread-safe."""

    def __init__(
        self,
        intake: RequestIntake,
        driver: RequestDriver,
        admission: Admission,
        server: ServerConfig,
        authorized: Callable[[Mapping[str, str]], bool],
        addresses: Addresses,
    ) -> None:
        self._intake = intake
        self._driver = driver
        self._admission = admission
        self._metrics = driver.metrics
        self._server = server
        self._authorized = authorized
        self._addresses = addresses
        self._in_flight: dict[str, _InFlight] = {}

    async def pick(
        self, path: str, headers: Mapping[str, str], raw: bytes, arrived: float, client: str | None = None
    ) -> Picked:
        """The destination for one request that arrived at ``arrived``
        (``time.perf_counter()``): ``path`` and ``headers`` as the client sent them (with
        Envoy's ``x-request-id``), ``raw`` its whole body, ``client`` its sender's address as
        Envoy saw it (``None``: Envoy sent none, and the request's session counts for no
        client's ``sessions.max_sessions_per_client``; the session, if it names one, is
        claimed once the request is routed, before its booking). Raises :class:`Refused`: 404 for
        another path, 401 without the API key (``server.api_key_env``), 400 or 413 for a bad
        body (naming the problem), 409 for a request id in flight, 429 or 503 when the
        router is at capacity (``server.max_concurrent_requests`` and its queue, as the relay)
        or for a predicted TTFT over the SLO, 503 when no worker can serve it or its
        prefill failed past recovery, 502 when the chosen worker left."""
        try:
            api = Api(path.split("?", 1)[0])
        except ValueError:
            raise Refused(
                404, f"kvpilot serves POST {Api.COMPLETIONS.value} and {Api.CHAT.value}, not {path!r}"
            ) from None
        if not self._authorized(headers):
            raise Refused(401, UNAUTHORIZED_MESSAGE, "authentication_error", **{"www-authenticate": "Bearer"})
        if len(raw) > self._server.max_body_bytes:
            raise Refused(413, str(self._intake.body_too_large()))
        try:
            await self._admission.acquire()
        except Rejected as exc:
            raise self._rejected(exc) from None
        try:
            return await self._pick_admitted(api, headers, raw, arrived, client)
        except BaseException:
            self._admission.release()
            raise

    def _rejected(self, exc: Rejected) -> Refused:
        self._metrics.rejected.labels(exc.reason.value).inc()
        return Refused(exc.status, str(exc), "overloaded", **{"retry-after": str(exc.retry_after_s)})

    async def _pick_admitted(
        self, api: Api, headers: Mapping[str, str], raw: bytes, arrived: float, client: str | None
    ) -> Picked:
        intake = self._intake
        try:
            taken = await intake.take(headers, intake.checked_body(raw, api), api, arrived, client)
        except (BadRequest, ChatError) as exc:
            raise Refused(getattr(exc, "status", 400), str(exc)) from None
        except Rejected as exc:
            raise self._rejected(exc) from None
        request = taken.request
        begun = await self._driver.begin(request, request.route)
        if isinstance(begun, Reply):
            raise Refused(begun.status, begun.payload["error"]["message"], begun.payload["error"]["type"])
        ticket = begun.ticket
        decode = ticket.route.decode
        try:
            destination = self._driver.upstream.destination(decode, request.engine, begun.handoff)
            address = await self._addresses.ip_port(decode, destination.host_port)
        except UpstreamError as exc:
            self._driver.decode_failed(ticket, engine_fault=True)
            raise Refused(exc.status, str(exc), "upstream_error") from None
        picked_s = time.perf_counter() - arrived
        self._in_flight[ticket.request_id] = _InFlight(request, begun, picked_s, self._prefill_timer(begun, picked_s))
        unchanged = destination.body == taken.client_body  # no session fields, no handoff
        body = None if unchanged else body_bytes(destination.body)
        return Picked(dataclasses.replace(destination, host_port=address), body, begun.headers)

    def _prefill_timer(self, begun: Begun, picked_s: float) -> asyncio.TimerHandle | None:
        """Ends the request's prefill in the lifecycle at its predicted TTFT (see the module
        doc); ``None`` when nothing is predicted (the request's end does it)."""
        prediction = begun.ticket.prediction
        if prediction is None:
            return None
        delay = max(0.0, prediction.seconds - picked_s)
        return asyncio.get_running_loop().call_later(delay, self._driver.prefill_over, begun.ticket)

    async def ended(self, end: RequestEnd) -> None:
        """Envoy's entry for a request that ended: the driver's steps after D's stream (see
        the module doc) and the request's admission slot. An entry for a request the picker
        did not pick (it refused it, or picked it before a restart) is ignored."""
        item = self._in_flight.pop(end.request_id, None)
        if item is None:
            return
        if item.prefill_timer is not None:
            item.prefill_timer.cancel()
        ticket = item.begun.ticket
        try:
            if end.status == 200 and end.first_body_s is not None:
                since_sent = max(0.0, end.first_body_s - item.picked_s)
                self._driver.first_token(ticket, since_sent, end.first_body_s)
            if end.upstream_broke:  # D's fault: no session step booked, D's circuit counts it
                self._driver.decode_failed(ticket, engine_fault=True)
            else:  # a client's 4xx, a client that left, an entry that never came: no one's fault
                await self._driver.finish(ticket, answered=end.answered)
        finally:
            self._driver.failed(ticket)  # a no-op for a ticket that ended above
            self._admission.release()

    async def expire(self, now: float) -> None:
        """End, unanswered, every request picked more than ``server.request_timeout_s``
        before ``now`` (``time.perf_counter()``) whose entry never came."""
        limit = self._server.request_timeout_s
        stale = [rid for rid, item in self._in_flight.items() if now - item.request.started > limit]
        for rid in stale:
            log.warning("request %s: no access-log entry within %.0f s; ended as unanswered", rid, limit)
            await self.ended(RequestEnd(rid, 0, None, limit))


def body_bytes(body: Mapping[str, Any]) -> bytes:
    """D's body as sent: compact JSON, encoded by msgspec."""
    return msgspec.json.encode(body)
