"""The router's HTTP front (aiohttp): OpenAI-compatible, token ids to the engines.

:class:`RouterServer` is the HTTP handlers over a :class:`~kvpilot.routing.core.RouterCore`
(the composition root: index, ledger, sessions, health, router, lifecycle, intake, driver, proxy,
metrics, pollers, the shared session store), which it starts and stops with its app. Per request: admit it
(:mod:`kvpilot.routing.serve.admission`: a full queue is a 429, a queue wait past its
timeout a 503, both with ``Retry-After``), take it in (:mod:`kvpilot.routing.serve.intake`:
parse and validate the body, 400 naming the field; only the fields of
:mod:`kvpilot.routing.serve.request_fields` are accepted, so a client cannot set
``kv_transfer_params``; compute the prompt's token ids as the engine will; take the session's
record from the shared store
(:mod:`kvpilot.routing.state.sync`); route (:mod:`kvpilot.routing.decide.router`); refuse a
route whose predicted TTFT is over ``server.ttft_slo_s``: 429 for load, else 503, with
``Retry-After``) and hand the route to the
proxy (:mod:`kvpilot.routing.serve.proxy`: D's call and its retry, every step around it
driven by :mod:`kvpilot.routing.serve.driver`), whose answer (the engine's, as it wrote it) is
written here as JSON or as server-sent events.

An upstream failure reaches the client as a JSON error naming the engine (the
engine's 4xx status is kept, anything else is a 502); the router keeps serving.
Response headers ``X-Request-Id``, ``X-KVPilot-Route``, ``X-KVPilot-Prefill-Worker``,
``X-KVPilot-Decode-Worker`` say where it went. ``POST /debug/route`` explains a
decision without sending anything. Who may call each endpoint (:class:`Access`) is checked on
every request, whatever else is configured: an admin endpoint needs the admin token, or with
none a loopback peer. Metrics: :class:`RouterMetrics` (listed in
``docs/guides/router.md``).

Beside Dynamo (``dynamo.frontend_url`` set, docs/guides/dynamo.md) the engines are Dynamo's
frontend in direct mode (:mod:`kvpilot.routing.serve.dynamo_upstream`) and the fleet is Dynamo's
discovery, followed live (:mod:`kvpilot.routing.ingest.dynamo_discovery`, :meth:`RouterCore.set_fleet`).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from kvpilot.routing.config import ConfigError, RouterConfig, read_secret
from kvpilot.routing.core import OPEN_PATHS, UNAUTHORIZED_MESSAGE, RouterCore
from kvpilot.routing.decide.rates import TTFTPrediction
from kvpilot.routing.fleet import Fleet
from kvpilot.routing.ids import pair_name
from kvpilot.routing.refusals import BadRequest, RejectReason
from kvpilot.routing.serve.admission import Rejected
from kvpilot.routing.serve.chat import ChatError, ChatTemplate
from kvpilot.routing.serve.driver import error_reply
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.sse import sse_events
from kvpilot.routing.serve.tokenizer import TOKENIZER_FILE, PromptTokenizer
from kvpilot.routing.serve.upstream import Api

ADMIN_PATHS = frozenset({"/debug/route", "/debug/fleet"})
"""Endpoints for operators, not clients (:meth:`RouterServer.admin_allowed`)."""
ADMIN_REFUSED_MESSAGE = (
    "an admin endpoint needs the admin token (Authorization: Bearer <token>, server.admin_token_env), "
    "or, with none set, a request from the router's own host"
)


class Access(enum.Enum):
    """Who may call an endpoint (:func:`access_of`); :meth:`RouterServer._guard` checks it on
    every request, whatever else is configured. Each member's docstring is its line in the
    endpoints reference."""

    OPEN = "open"
    """Anyone, for liveness probes and Prometheus scrapes (``OPEN_PATHS``)."""
    CLIENT = "client"
    """With ``server.api_key_env`` set, a client that sends ``Authorization: Bearer <key>``
    (else 401); without, anyone."""
    ADMIN = "admin"
    """Operators (``ADMIN_PATHS``, :meth:`RouterServer.admin_allowed`). With
    ``server.admin_token_env`` set, ``Authorization: Bearer <token>`` from any address (the
    API key does not open it); without, a loopback peer (127.0.0.0/8, ``::1``) only, with the
    API key when one is set. Any other peer or bearer gets 403 (a loopback peer without the
    API key, 401)."""


def access_of(path: str) -> Access:
    """Who may call the endpoint at ``path`` (an endpoint's declared path, not a client's spelling of it)."""
    if path in OPEN_PATHS:
        return Access.OPEN
    return Access.ADMIN if path in ADMIN_PATHS else Access.CLIENT


def _endpoint(request: web.Request) -> str:
    """The declared path of the route that answers ``request`` (aiohttp's matched resource,
    however the client spelled the path), or the request's path when no route matches."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def is_loopback(peer: str | None) -> bool:
    """Whether ``peer`` (a TCP peer's address as aiohttp reports it) is this host's loopback
    (127.0.0.0/8, ``::1``, or 127.0.0.0/8 as a dual-stack socket reports it,
    ``::ffff:127.x.y.z``); ``None`` or anything unreadable is not."""
    if peer is None:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


def _as_dict(prediction: TTFTPrediction | None) -> dict[str, object] | None:
    """A prediction for ``/debug/route``: the TTFT, the prior's, each term's prior and
    measured seconds."""
    return None if prediction is None else prediction.as_dict()


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    reply = error_reply(status, message, kind)
    return web.json_response(reply.payload, status=reply.status)


class _SSEResponse:
    """The proxy's :class:`~kvpilot.routing.serve.proxy.ClientStream` over aiohttp: the
    client's streamed response, prepared when the proxy opens it."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    async def open(self, headers: Mapping[str, str]) -> None:
        sse = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        self.response = web.StreamResponse(headers={**headers, **sse})
        await self.response.prepare(self._request)

    async def send(self, events: Sequence[str]) -> None:
        assert self.response is not None
        await self.response.write(sse_events(events))

    async def close(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


class RouterServer:
    """Builds the aiohttp app around ``core``, started with the app and stopped at its
    cleanup. ``feed_index``: the core's start opens one subscriber per worker with a
    KV-events endpoint (:meth:`RouterCore.start`)."""

    def __init__(self, core: RouterCore, *, feed_index: bool = True) -> None:
        self.core = core
        self._feed_index = feed_index
        self._admin_token = read_secret(core.config.server.admin_token_env, "server.admin_token_env")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.core.config.server.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/debug/route", self._debug_route)
        app.router.add_get("/debug/fleet", self._debug_fleet)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        await self.core.start(feed_index=self._feed_index)

    async def _stop(self, _: web.Application) -> None:
        await self.core.stop()

    # ---- small endpoints ---------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Each request against its endpoint's :class:`Access`, with or without an API key: an
        open endpoint is answered; an admin endpoint needs :meth:`admin_allowed` (else 403)
        and, with no admin token set, the API key as any other endpoint; any other endpoint
        needs the API key when one is set (else 401, ``WWW-Authenticate: Bearer``)."""
        access = access_of(_endpoint(request))
        if access is Access.OPEN:
            return await handler(request)
        if access is Access.ADMIN and not self.admin_allowed(request.remote, request.headers):
            return _error(403, ADMIN_REFUSED_MESSAGE, "permission_error")
        if access is Access.ADMIN and self._admin_token is not None:
            return await handler(request)
        if not self.core.authorized(request.headers):
            response = _error(401, UNAUTHORIZED_MESSAGE, "authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    def admin_allowed(self, peer: str | None, headers: Mapping[str, str]) -> bool:
        """Whether a request from ``peer`` with ``headers`` may use an admin endpoint: with
        ``server.admin_token_env`` set, it carries that token (compared in constant time; from
        any address; the client API key does not do); without, it comes from this host's
        loopback (127.0.0.0/8, ::1; the API key is then checked as for any endpoint). A refusal
        is counted as unauthorized."""
        if self._admin_token is not None:
            sent = headers.get("Authorization", "").encode()
            allowed = hmac.compare_digest(sent, f"Bearer {self._admin_token}".encode())
        else:
            allowed = is_loopback(peer)
        if not allowed:
            self.core.metrics.rejected.labels(RejectReason.UNAUTHORIZED.value).inc()
        return allowed

    async def _health(self, _: web.Request) -> web.Response:
        """Liveness: 200 with the workers served now (no API key needed)."""
        return web.json_response(self.core.health_payload())

    async def _debug_fleet(self, _: web.Request) -> web.Response:
        """The workers served now, each with its role, URL, KV-event endpoint and (beside
        Dynamo) its instance id: what a gateway's own decision needs to reach them."""
        return web.json_response(self.core.fleet_payload())

    async def _models(self, _: web.Request) -> web.Response:
        """The served model (``server.model_name``), OpenAI's list format."""
        return web.json_response(self.core.models_payload())

    async def _metrics(self, _: web.Request) -> web.Response:
        """The router's Prometheus metrics (no API key needed; the metrics reference lists them)."""
        self.core.watch_events()
        body, content_type = self.core.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _debug_route(self, request: web.Request) -> web.Response:
        """Explain the routing decision for a completion or chat body without sending it: every
        candidate's cost term by term, the local-vs-remote verdict, a session's five options,
        the predicted TTFT, prior and measured. An admin endpoint (:meth:`admin_allowed`); it
        creates no session: one this router does not hold is explained as a first step.

        Admitted as a client's request is (a full router answers 429 or 503 with
        ``Retry-After``), and its prompt rendered and tokenized off the event loop as a
        client's is (:meth:`~kvpilot.routing.serve.intake.RequestIntake.tokenized`)."""
        try:
            async with self.core.admission.admit():
                return await self._explain(request)
        except Rejected as exc:
            return self._overloaded(exc)

    async def _explain(self, request: web.Request) -> web.Response:
        """``/debug/route``'s answer, once admitted."""
        core, intake = self.core, self.core.intake
        try:
            body = await self._body(request, api=None)
            api = Api.CHAT if "messages" in body else Api.COMPLETIONS
            token_ids, session = await intake.tokenized(request.headers, body, api)
            await intake.pull_session(session)
            held = session is not None and session in core.router.sessions
            route = intake.route(
                request.headers, token_ids, body, api, session if held else None, dry_run=True, timed=False
            )
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        predicted = core.lifecycle.predict(route)
        now = core.clock.monotonic()
        return web.json_response(
            {
                "request_id": route.request_id,
                "kind": route.kind.value,
                "prefill_worker": route.prefill_worker.name,
                "decode_worker": route.decode.name,
                "prompt_tokens": route.prompt_tokens,
                "prompt_blocks": route.prompt_blocks,
                "cached_blocks": route.cached_blocks,
                "overlap": route.match.blocks,
                "events_stale": sorted(core.event_watch.stale),
                "pair_penalty_blocks": {
                    pair_name(p, d): core.pair_health.penalty_blocks(p, d, now) for p, d in core.pairs()
                },
                "session_option": route.option.value if route.option is not None else None,
                "options": [
                    {
                        "option": price.option.value,
                        "article_option": price.option.article_number,
                        "available": price.available,
                        "ttft_s": price.seconds if price.available else None,
                        "prefill_worker": price.prefill_worker,
                        "why": price.explain(),
                        "chosen": price.option is route.option,
                        "predicted": _as_dict(core.lifecycle.predict_option(route, price)),
                    }
                    for price in route.options
                ],
                "predicted": _as_dict(predicted),
                "learned_rates": core.rates.learned(),
                "explain": route.explain(),
            }
        )

    # ---- parsing and routing -------------------------------------------------
    async def _body(self, request: web.Request, api: Api | None) -> dict[str, Any]:
        """The request's body, checked (:meth:`checked_body`)."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise self.core.intake.body_too_large() from None
        return self.core.intake.checked_body(raw, api)

    # ---- the proxy ---------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI completions (streamed or not): routed, prefilled on P or D, answered by D.
        Sessions from ``conversation_id`` / ``prompt_cache_key`` or ``X-Session-ID``."""
        return await self._serve(request, Api.COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI chat completions, served as ``/v1/completions`` is, by the engines' own chat
        endpoint (their templates, tool-call and reasoning parsers)."""
        return await self._serve(request, Api.CHAT)

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        """Admit (or refuse early, with ``Retry-After``), then serve."""
        try:
            async with self.core.admission.admit():
                return await self._serve_admitted(request, api)
        except Rejected as exc:
            return self._overloaded(exc)

    def _overloaded(self, exc: Rejected) -> web.Response:
        """The refusal of a request not admitted (or over the TTFT SLO), counted, with ``Retry-After``."""
        self.core.metrics.rejected.labels(exc.reason.value).inc()
        response = _error(exc.status, str(exc), "overloaded")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    async def _serve_admitted(self, request: web.Request, api: Api) -> web.StreamResponse:
        """Parse, route and hand the route to the proxy."""
        started = time.perf_counter()
        proxy = self.core.proxy
        try:
            body = await self._body(request, api)
            # the session, if it names one, is its client's: the TCP peer's address (behind another proxy, that proxy's)
            intake = await self.core.intake.take(request.headers, body, api, started, request.remote or "")
        except (BadRequest, ChatError) as exc:
            return _error(getattr(exc, "status", 400), str(exc))
        client = _SSEResponse(request)
        reply = await proxy.serve(intake.request, client)
        if reply is None:
            assert client.response is not None
            return client.response
        return web.json_response(reply.payload, status=reply.status, headers=reply.headers)


def build_server(config: RouterConfig, fleet: Fleet, *, feed_index: bool = True) -> RouterServer:
    """A server for ``config`` reading ``server.model_dir`` (tokenizer and chat template).
    Raises :class:`ConfigError` naming the directory when it holds no ``tokenizer.json``."""
    model_dir = Path(config.server.model_dir)
    if not (model_dir / TOKENIZER_FILE).is_file():
        raise ConfigError(
            "server.model_dir", f"no {TOKENIZER_FILE} in {str(model_dir.resolve())!r}: the router tokenizes with it"
        )
    prompts = EnginePrompt(
        PromptTokenizer(model_dir),
        ChatTemplate.from_model_dir(model_dir),
        completion_special_tokens=not config.dynamo.enabled,  # Dynamo's frontend adds none
    )
    return RouterServer(RouterCore(config, fleet, prompts), feed_index=feed_index)
