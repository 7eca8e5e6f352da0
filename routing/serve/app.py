"""The router's HTTP front (aiohttp): OpenAI-compatible, token ids to the engines.

:class:`RouterServer` is the composition root (index, ledger, sessions, health,
router, proxy, metrics, pollers, the shared session store) and the HTTP handlers. Per request: admit it
(:mod:`kvpilot.routing.serve.admission`: a full queue is a 429, a queue wait past its
timeout a 503, both with ``Retry-After``), take it in (:mod:`kvpilot.routing.serve.intake`:
parse and validate the body, 400 naming the field; only the fields of
:mod:`kvpilot.routing.serve.request_fields` are accepted, so a client cannot set
``kv_transfer_params``; compute the prompt's token ids as the engine will; take the session's
record from the shared store
(:mod:`kvpilot.routing.state.sync`); route (:mod:`kvpilot.routing.decide.router`); refuse a
route whose predicted TTFT is over ``server.ttft_slo_s``: 429 for load, else 503, with
``Retry-After``) and hand the route to the
proxy (:mod:`kvpilot.routing.serve.proxy`: P, fallback, retry, bookkeeping), whose answer (the
engine's, as it wrote it) is written here as JSON or as server-sent events.

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
discovery, followed live (:mod:`kvpilot.routing.ingest.dynamo_discovery`, :meth:`RouterServer.set_fleet`).
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import ipaddress
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from kvpilot.policies.failure import FailurePolicyConfig
from kvpilot.routing.config import (
    ConfigError,
    IndexBackend,
    IndexConfig,
    Role,
    RouterConfig,
    SessionConfig,
    SessionStoreKind,
    Worker,
    prior_model,
    read_secret,
)
from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.lifecycle import Lifecycle
from kvpilot.routing.decide.rates import RateEstimator, RolePriors, TTFTPrediction
from kvpilot.routing.decide.router import Router, policy_from_config
from kvpilot.routing.decide.session_record import SessionStateStore
from kvpilot.routing.decide.sessions import InvalidSessionKey, SessionStore, scoped, session_key
from kvpilot.routing.fleet import Fleet, fleet_changes, fleet_of
from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.engine_load import EngineLoad
from kvpilot.routing.health.event_watch import EventWatch
from kvpilot.routing.health.pair_health import PairHealth
from kvpilot.routing.ids import WorkerId, pair_name
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.kvindex import KVIndex
from kvpilot.routing.ingest.dynamo_discovery import DynamoDiscovery
from kvpilot.routing.ingest.engine_metrics import EngineLoadPoller, read_engine_load
from kvpilot.routing.ingest.feeder import IndexFeeder
from kvpilot.routing.metrics.collectors import (
    EngineLoadCollector,
    EventWatchCollector,
    FeederCollector,
    IndexCollector,
    LedgerCollector,
    PairHealthCollector,
)
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.refusals import BadRequest, RejectReason
from kvpilot.routing.serve.admission import Admission, Rejected
from kvpilot.routing.serve.calibrate import Calibrator
from kvpilot.routing.serve.chat import ChatError, ChatTemplate
from kvpilot.routing.serve.intake import RequestIntake
from kvpilot.routing.serve.learned_limits import learned_limits
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.proxy import Proxy, error_reply
from kvpilot.routing.serve.sse import sse_events
from kvpilot.routing.serve.tokenizer import TOKENIZER_FILE, PromptTokenizer
from kvpilot.routing.serve.upstream import Api, Upstream
from kvpilot.routing.serve.vllm_upstream import VllmUpstream
from kvpilot.routing.state.sync import SessionSync

log = logging.getLogger(__name__)


CATCH_UP_WAIT_S = 2.0
"""How long startup waits per engine for the index to be caught up from its replay buffer
(each replay fetch gives up after 1 s); then the router serves whatever it has."""

UNAUTHORIZED_MESSAGE = "missing or wrong API key (Authorization: Bearer <key>)"
OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Endpoints that need no API key: liveness probes and Prometheus scrapes."""
ADMIN_PATHS = frozenset({"/debug/route"})
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


def make_index(cfg: IndexConfig) -> KVIndex:
    """The index ``cfg.backend`` names: kvpilot's :class:`BlockIndex` or Dynamo's
    ``RadixTree`` (:mod:`kvpilot.routing.index.dynamo`, needs ``ai-dynamo-runtime``)."""
    if cfg.backend is IndexBackend.DYNAMO:
        try:
            from kvpilot.routing.index.dynamo import DynamoIndex
        except ImportError as exc:
            raise ConfigError(
                "index.backend", f"'dynamo' needs ai-dynamo-runtime (pip install 'kvpilot[dynamo]'): {exc}"
            ) from None
        return DynamoIndex(cfg.block_size, kv_group=cfg.kv_group)
    return BlockIndex(cfg.block_size, kv_group=cfg.kv_group, log_capacity=cfg.removal_log_capacity)


def make_session_store(cfg: SessionConfig) -> SessionStateStore | None:
    """The shared store ``cfg.store`` names (``None``: this router's memory only)."""
    if cfg.store is SessionStoreKind.MEMORY:
        return None
    try:
        from kvpilot.routing.state.redis_store import RedisSessionStore
    except ImportError as exc:
        needs = f"'redis' needs the redis client (pip install 'kvpilot[redis]'): {exc}"
        raise ConfigError("sessions.store", needs) from None
    password = read_secret(cfg.redis_password_env, "sessions.redis_password_env")
    return RedisSessionStore(cfg.redis_url, cfg.store_key_prefix, password=password)


class RouterServer:
    """Builds the aiohttp app around a :class:`~kvpilot.routing.decide.router.Router`.

    ``feed_index`` starts one subscriber per worker with a KV-events endpoint
    at app startup (bound then) and stops them at cleanup.
    """

    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        prompts: EnginePrompt,
        *,
        feed_index: bool = True,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.prompts = prompts
        self.lock = threading.Lock()
        self.index = make_index(config.index)
        self.ledger = LoadLedger()
        srv = config.server
        self.admission = Admission(srv.max_concurrent_requests, srv.max_queued_requests, srv.queue_timeout_s)
        dynamo = config.dynamo.enabled  # prefill workers may join at any time
        model = prior_model(config)
        policy = policy_from_config(config.disaggregation, model) if fleet.prefill or dynamo else None
        sessions = SessionStore(
            config.index.block_size, config.sessions.max_sessions, config.sessions.max_sessions_per_client
        )
        interval = 0.0 if dynamo else config.server.engine_metrics_interval_s  # Dynamo's workers have no vLLM /metrics
        self.breaker = CircuitBreaker(srv.circuit_failures, srv.circuit_open_s)
        self.event_watch = EventWatch(config.index.events_stale_after_s)
        self.pair_health = PairHealth(config.cost)
        priors = RolePriors.from_config(config.disaggregation, model)
        self.rates = RateEstimator(lambda engine: priors.of(self._role(engine)))
        self.engine_load = (
            EngineLoadPoller(fleet.workers, interval, on_sample=self._engine_sample) if interval > 0 else None
        )
        self.router = Router(
            fleet,
            config,
            self.index,
            self.ledger,
            sessions,
            policy,
            engine_load=self.engine_load.latest if self.engine_load is not None else None,
            barred=lambda: self.breaker.barred(time.monotonic()),
            events_stale=self.event_watch.is_stale,
            pair_penalties=lambda: self.pair_health.penalties(time.monotonic()),
            rates=self.rates,
        )
        self._background: list[asyncio.Task[None]] = []
        self.feeder: IndexFeeder | None = None
        self._feed_index = feed_index
        self.metrics = RouterMetrics(self.worker_names())
        store = make_session_store(config.sessions)
        self.session_sync = (
            None
            if store is None
            else SessionSync(
                store,
                sessions,
                self.lock,
                self.metrics,
                read_timeout_s=config.sessions.store_read_timeout_s,
                write_timeout_s=config.sessions.store_write_timeout_s,
                ttl_s=config.sessions.store_ttl_s,
            )
        )
        self.lifecycle = Lifecycle(
            self.router,
            self.lock,
            self.breaker,
            self.pair_health,
            self.event_watch,
            self.event_batches,
            rates=self.rates,
            prefills_timed_here=self.engine_load is None,
            failure=FailurePolicyConfig(max_stall_s=config.disaggregation.max_stall_s),
        )
        self.intake = RequestIntake(
            config,
            self.router,
            self.lock,
            self.metrics,
            prompts,
            self.session_sync,
            self.watch_events,
            self.lifecycle.predict,
        )
        for collector in (
            LedgerCollector(self.ledger, self.worker_names),
            FeederCollector(lambda: self.feeder),
            IndexCollector(self.index, self.worker_names, list(config.index.tiers), self.lock),
            EventWatchCollector(self.event_watch, self.worker_names),
            PairHealthCollector(
                self.pair_health,
                lambda: [(pair_name(p, d), (p, d)) for p, d in self.pairs()],
            ),
            *([EngineLoadCollector(self.engine_load, self.worker_names)] if self.engine_load is not None else []),
        ):
            self.metrics.registry.register(collector)
        self._http: aiohttp.ClientSession | None = None
        self._proxy: Proxy | None = None
        self.discovery: DynamoDiscovery | None = None
        self._api_key = read_secret(config.server.api_key_env, "server.api_key_env")
        self._admin_token = read_secret(config.server.admin_token_env, "server.admin_token_env")
        self.gateway_token = read_secret(config.gateway.token_env, "gateway.token_env")
        """The token every call to the picker's gRPC port needs (:mod:`kvpilot.routing.gateway.auth`)."""
        engine_key = read_secret(config.server.engine_api_key_env, "server.engine_api_key_env")
        self._engine_headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.server.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/debug/route", self._debug_route)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.server.request_timeout_s)
        # Beside Dynamo, a fresh connection per request: Dynamo 1.6.1's frontend leaves Nagle on
        # its client sockets (dynamo#14643), so on a kept-alive connection the first token,
        # written just after the response headers, waits for the router's delayed ACK (~40 ms,
        # measured here); a new connection ACKs at once (TCP quick-ACK at its start).
        connector = aiohttp.TCPConnector(force_close=self.config.dynamo.enabled)
        self._http = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._proxy = Proxy(
            await self._upstream(self._http),
            self.lifecycle,
            self.metrics,
            self.config.server.max_retries,
            prefill_timeout_s=self.config.server.prefill_timeout_s,
            session_served=self.session_sync.push if self.session_sync is not None else None,
        )
        if self.session_sync is not None:
            await self.session_sync.open()
        if self._feed_index and (self.discovery is not None or any(w.kv_events_endpoint for w in self.fleet.workers)):
            # Dynamo's workers bind their event sockets: the feeder connects to them
            self.feeder = IndexFeeder(self.fleet, self.index, self.lock, bind=False if self.discovery else None)
            self.feeder.start()
            # serve once the index holds what the engines' replay buffers hold (a restart mid-session)
            wait_s = CATCH_UP_WAIT_S * (1 + len(self.feeder.subscribers))
            await asyncio.get_running_loop().run_in_executor(None, self.feeder.caught_up.wait, wait_s)
        if self.discovery is not None:
            self.set_fleet(fleet_of(self.discovery.workers()))
            self._background.append(asyncio.create_task(self.discovery.watch(self.set_fleet)))
        urls = [self.config.dynamo.frontend_url] if self.config.dynamo.enabled else [w.url for w in self.fleet.workers]
        self.intake.limits = await learned_limits(
            self._http, urls, self._engine_headers, self.config.server, self.intake.limits
        )
        if self.config.disaggregation.measured_rates:
            await self._calibrate()
        if self.engine_load is not None:
            self._background.append(asyncio.create_task(self.engine_load.run(self._http)))

    async def _calibrate(self) -> None:
        """Time the engines before serving (:mod:`kvpilot.routing.serve.calibrate`), each
        prefill as its traffic's is timed (by the engine's ``/metrics`` where they are
        polled; P's by its handoffs)."""
        assert self._proxy is not None
        http = self._http
        assert http is not None
        timeout = aiohttp.ClientTimeout(total=5.0)

        async def metrics_now(worker: Worker) -> EngineLoad | None:
            return (await read_engine_load(http, worker, timeout))[0]

        metrics = None if self.engine_load is None else metrics_now
        calibrator = Calibrator(self._proxy.upstream, self.rates, self.config.server, read_metrics=metrics)
        await calibrator.run(self.fleet.workers)  # it logs what it measured; the rates hold it

    async def _stop(self, _: web.Application) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        if self.session_sync is not None:
            await self.session_sync.close()
        if self.feeder is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.feeder.stop)
        if self.discovery is not None:
            self.discovery.close()

    async def _upstream(self, http: aiohttp.ClientSession) -> Upstream:
        """vLLM's engines, or Dynamo's frontend (its discovery opened here)."""
        if not self.config.dynamo.enabled:
            return VllmUpstream(http, self._engine_headers)
        from kvpilot.routing.serve.dynamo_upstream import DynamoUpstream

        self.discovery = await DynamoDiscovery.open(self.config.dynamo)
        return DynamoUpstream(http, self._engine_headers, self.discovery.instance_id)

    def _role(self, worker: str) -> Role | None:
        """``worker``'s role, ``None`` once it left the fleet."""
        try:
            return self.fleet.by_name(WorkerId(worker)).role
        except KeyError:
            return None

    def _engine_sample(self, worker: WorkerId, sample: EngineLoad) -> None:
        """A worker's polled ``/metrics``: its pair health and its measured rates (P's
        prefills are timed by the proxy, not taken from P's histogram)."""
        self.pair_health.observe(worker, sample.transfer, sample.at)
        with self.lock:
            self.router.engine_polled(worker)
        self.rates.observe_sample(worker, sample, prefill=self._role(worker) is not Role.PREFILL)

    def set_fleet(self, fleet: Fleet) -> None:
        """Serve ``fleet`` from the next request on: workers that joined are routed to and
        their KV events read; those that left are no longer routed to, their events no
        longer read and their blocks dropped from the index (requests in flight on them
        finish or fail as they would)."""
        joined, left = fleet_changes(self.fleet, fleet)
        with self.lock:
            self.router.set_fleet(fleet)
        self.fleet = fleet
        if self.feeder is not None:
            for worker in left:
                self.feeder.remove(worker.name)
            for worker in joined:
                self.feeder.add(worker)
        if joined or left:
            log.info(
                "fleet: joined %s; left %s",
                ", ".join(w.name for w in joined) or "none",
                ", ".join(w.name for w in left) or "none",
            )

    def worker_names(self) -> list[WorkerId]:
        """Every worker's name, in the fleet as it is now."""
        return [w.name for w in self.fleet.workers]

    def pairs(self) -> list[tuple[WorkerId, WorkerId]]:
        """Every (P, D) pair's names, in the fleet as it is now."""
        return [(p.name, d.name) for p in self.fleet.prefill for d in self.fleet.decode]

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
        if not self.authorized(request.headers):
            response = _error(401, UNAUTHORIZED_MESSAGE, "authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """Whether ``headers`` carry the API key (always, when none is configured); a
        refusal is counted in ``kvpilot_router_rejected_total``."""
        if self._api_key is None:
            return True
        sent = headers.get("Authorization", "")
        if hmac.compare_digest(sent.encode(), f"Bearer {self._api_key}".encode()):
            return True
        self.metrics.rejected.labels(RejectReason.UNAUTHORIZED.value).inc()
        return False

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
            self.metrics.rejected.labels(RejectReason.UNAUTHORIZED.value).inc()
        return allowed

    async def _health(self, _: web.Request) -> web.Response:
        """Liveness: 200 with the workers served now (no API key needed)."""
        return web.json_response(self.health_payload())

    async def _models(self, _: web.Request) -> web.Response:
        """The served model (``server.model_name``), OpenAI's list format."""
        return web.json_response(self.models_payload())

    def health_payload(self) -> dict[str, Any]:
        """``/health``'s answer: the workers served now."""
        return {"status": "ok", "workers": [w.name for w in self.fleet.workers]}

    def models_payload(self) -> dict[str, Any]:
        """``/v1/models``' answer: the one served model."""
        model = {"id": self.config.server.model_name, "object": "model", "owned_by": "kvpilot"}
        return {"object": "list", "data": [model]}

    async def _metrics(self, _: web.Request) -> web.Response:
        """The router's Prometheus metrics (no API key needed; the metrics reference lists them)."""
        self.watch_events()
        body, content_type = self.metrics.render()
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
            async with self.admission.admit():
                return await self._explain(request)
        except Rejected as exc:
            return self._overloaded(exc)

    async def _explain(self, request: web.Request) -> web.Response:
        """``/debug/route``'s answer, once admitted."""
        try:
            body = await self._body(request, api=None)
            api = Api.CHAT if "messages" in body else Api.COMPLETIONS
            token_ids, session = await self.intake.tokenized(request.headers, body, api)
            await self.intake.pull_session(session)
            with self.lock:
                held = session is not None and session in self.router.sessions
            route = self.intake.route(request.headers, token_ids, body, api, session if held else None, dry_run=True)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        predicted = self.lifecycle.predict(route)
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
                "events_stale": sorted(self.event_watch.stale),
                "pair_penalty_blocks": {
                    pair_name(p, d): self.pair_health.penalty_blocks(p, d, time.monotonic()) for p, d in self.pairs()
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
                        "predicted": _as_dict(self.lifecycle.predict_option(route, price)),
                    }
                    for price in route.options
                ],
                "predicted": _as_dict(predicted),
                "learned_rates": self.rates.learned(),
                "explain": route.explain(),
            }
        )

    # ---- parsing and routing -------------------------------------------------
    async def _body(self, request: web.Request, api: Api | None) -> dict[str, Any]:
        """The request's body, checked (:meth:`checked_body`)."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise self.intake.body_too_large() from None
        return self.intake.checked_body(raw, api)

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
            async with self.admission.admit():
                return await self._serve_admitted(request, api)
        except Rejected as exc:
            return self._overloaded(exc)

    def _overloaded(self, exc: Rejected) -> web.Response:
        """The refusal of a request not admitted (or over the TTFT SLO), counted, with ``Retry-After``."""
        self.metrics.rejected.labels(exc.reason.value).inc()
        response = _error(exc.status, str(exc), "overloaded")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    async def _serve_admitted(self, request: web.Request, api: Api) -> web.StreamResponse:
        """Parse, route and hand the route to the proxy."""
        started = time.perf_counter()
        assert self._proxy is not None, "the app has not started"
        try:
            body = await self._body(request, api)
            self._claim_session(request, body)
            intake = await self.intake.take(request.headers, body, api, started)
        except (BadRequest, ChatError) as exc:
            return _error(getattr(exc, "status", 400), str(exc))
        client = _SSEResponse(request)
        reply = await self._proxy.serve(intake.request, client)
        if reply is None:
            assert client.response is not None
            return client.response
        return web.json_response(reply.payload, status=reply.status, headers=reply.headers)

    def _claim_session(self, request: web.Request, body: Mapping[str, Any]) -> None:
        """The request's session, if it names one, is its client's (``sessions.max_sessions_per_client``;
        the client is the TCP peer's address: behind another proxy, that proxy's). A malformed
        session field is left for the intake to refuse."""
        try:
            key = session_key(body, request.headers)
        except InvalidSessionKey:
            return
        if key is not None:
            with self.lock:
                self.router.sessions.claim(scoped(key, body.get("cache_salt")), request.remote or "")

    @property
    def proxy(self) -> Proxy:
        """The proxy, once the app has started."""
        assert self._proxy is not None, "the app has not started"
        return self._proxy

    def event_batches(self) -> dict[WorkerId, int]:
        """Each subscribed worker's count of applied KV-event batches."""
        return {sub.worker: sub.stats.batches for sub in (self.feeder.subscribers if self.feeder is not None else ())}

    def watch_events(self) -> None:
        """Flag the workers whose KV events stopped, and clear the ones heard again."""
        if self.event_watch.enabled:
            self.event_watch.update(self.event_batches(), time.monotonic())


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
    return RouterServer(config, fleet, prompts, feed_index=feed_index)
