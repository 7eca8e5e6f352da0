"""The router's composition root: :class:`RouterCore`, built once from the config, the fleet
and a clock, and handed to every front.

It builds what decides and books a request: the index, the load ledger, the sessions, the
health records (circuits, KV-event watch, pair health), the rates, the
:class:`~kvpilot.routing.decide.router.Router` and the
:class:`~kvpilot.routing.decide.lifecycle.Lifecycle`; and the request's way in: admission,
:class:`~kvpilot.routing.serve.intake.RequestIntake`, the metrics and the shared session
store. :meth:`RouterCore.start` opens what the live fronts share with the engines: their
HTTP client and :class:`~kvpilot.routing.serve.upstream.Upstream`, the
:class:`~kvpilot.routing.serve.driver.RequestDriver` (every front's request steps around
D's call) and the relay's :class:`~kvpilot.routing.serve.proxy.Proxy`, the KV-event feeder, Dynamo's discovery, the
engines' limits, the calibration and the ``/metrics`` poller.

The fronts take a core and add only their own I/O: the HTTP relay
(:mod:`kvpilot.routing.serve.app`), Envoy's picker (:mod:`kvpilot.routing.gateway.service`)
and the fleet simulator (``benchmarks/sim/kvpilot.py``: its virtual time is the clock; it
never starts the core and feeds the index itself). None of them builds a router, a
lifecycle, an intake or an index of its own (``tests/unit/routing/test_routing_core.py``).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

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
from kvpilot.routing.decide.lifecycle import REAL_TIME, Clock, Lifecycle
from kvpilot.routing.decide.rates import RateEstimator, RolePriors
from kvpilot.routing.decide.router import Router, policy_from_config
from kvpilot.routing.decide.session_record import SessionStateStore
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import Fleet, fleet_changes, fleet_of
from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.engine_load import EngineLoad
from kvpilot.routing.health.event_watch import EventWatch
from kvpilot.routing.health.pair_health import PairHealth
from kvpilot.routing.health.view import FleetHealth
from kvpilot.routing.ids import WorkerId, pair_name
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.kvindex import KVIndex
from kvpilot.routing.index.queued import RUN_QUEUED_INTERVAL_S, QueuedIndex
from kvpilot.routing.ingest.dynamo_discovery import DynamoDiscovery
from kvpilot.routing.ingest.engine_metrics import EngineLoadPoller, read_engine_load
from kvpilot.routing.ingest.feeder import IndexFeeder
from kvpilot.routing.ingest.workers_file import WorkersFile
from kvpilot.routing.metrics.collectors import (
    EngineLoadCollector,
    EventWatchCollector,
    FeederCollector,
    IndexCollector,
    LedgerCollector,
    PairHealthCollector,
)
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.refusals import RejectReason
from kvpilot.routing.serve.admission import Admission
from kvpilot.routing.serve.calibrate import Calibrator
from kvpilot.routing.serve.driver import RequestDriver
from kvpilot.routing.serve.intake import RequestIntake
from kvpilot.routing.serve.learned_limits import learned_limits
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.proxy import Proxy
from kvpilot.routing.serve.upstream import Upstream
from kvpilot.routing.serve.vllm_upstream import VllmUpstream
from kvpilot.routing.state.sync import SessionSync

log = logging.getLogger(__name__)

CATCH_UP_WAIT_S = 2.0
"""How long startup waits per engine for the index to be caught up from its replay buffer
(each replay fetch gives up after 1 s); then the router serves whatever it has."""

UNAUTHORIZED_MESSAGE = "missing or wrong API key (Authorization: Bearer <key>)"
OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Endpoints that need no API key: liveness probes and Prometheus scrapes."""


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


class RouterCore:
    """The router's collaborators, built once (see the module doc). ``prompts`` renders a
    client's prompt as the engines do (``None``: a core that is handed token ids, as the
    simulator's is, or that only declares its routes and metrics; a client's request is then
    refused). ``clock`` times circuits, pair health, KV-event watches and the engines'
    samples, and dates sessions (the simulator passes its virtual time).

    Its state (the index, the ledger, the sessions, the health records) is the event loop's
    alone: every change to it runs there, the feeder's too (its thread reads and decodes the
    engines' KV events and queues each change, which the loop runs before its next read of the
    index: :class:`~kvpilot.routing.index.queued.QueuedIndex`), so no lock guards it and no
    request waits on another thread. Runs on one event loop; :meth:`start` and :meth:`stop` bracket
    the live fronts' serving."""

    def __init__(
        self, config: RouterConfig, fleet: Fleet, prompts: EnginePrompt | None = None, *, clock: Clock = REAL_TIME
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.clock = clock
        self.index = QueuedIndex(make_index(config.index))
        self.ledger = LoadLedger()
        srv = config.server
        self.admission = Admission(srv.max_concurrent_requests, srv.max_queued_requests, srv.queue_timeout_s)
        dynamo = config.dynamo.enabled  # prefill workers may join at any time
        model = prior_model(config)
        listed = bool(srv.workers_file)  # the fleet is read from a file, and may gain prefill workers
        policy = policy_from_config(config.disaggregation, model) if fleet.prefill or dynamo or listed else None
        sessions = SessionStore(
            config.index.block_size, config.sessions.max_sessions, config.sessions.max_sessions_per_client
        )
        interval = 0.0 if dynamo else srv.engine_metrics_interval_s  # Dynamo's workers have no vLLM /metrics
        self.breaker = CircuitBreaker(srv.circuit_failures, srv.circuit_open_s)
        self.event_watch = EventWatch(config.index.events_stale_after_s)
        self.pair_health = PairHealth(config.cost)
        priors = RolePriors.from_config(config.disaggregation, model)
        self.rates = RateEstimator(lambda engine: priors.of(self.role(engine)))
        self.engine_load = (
            EngineLoadPoller(fleet.workers, interval, clock=clock.monotonic, on_sample=self._engine_sample)
            if interval > 0
            else None
        )
        self.health = FleetHealth(
            self.breaker,
            self.pair_health,
            self.event_watch,
            engine_load=self.engine_load.latest if self.engine_load is not None else None,
            event_batches=self.event_batches,
            monotonic=clock.monotonic,
        )
        self.router = Router(
            fleet, config, self.index, self.ledger, sessions, policy, health=self.health, rates=self.rates
        )
        self.feeder: IndexFeeder | None = None
        """The KV-event subscribers, once :meth:`start` opened them (``None``: none, or not started)."""
        self.metrics = RouterMetrics(self.worker_names())
        store = make_session_store(config.sessions)
        self.session_sync = (
            None
            if store is None
            else SessionSync(
                store,
                sessions,
                self.metrics,
                read_timeout_s=config.sessions.store_read_timeout_s,
                write_timeout_s=config.sessions.store_write_timeout_s,
                ttl_s=config.sessions.store_ttl_s,
                clock=clock.wall,
            )
        )
        self.lifecycle = Lifecycle(
            self.router,
            rates=self.rates,
            prefills_timed_here=self.engine_load is None,
            failure=FailurePolicyConfig(max_stall_s=config.disaggregation.max_stall_s),
            clock=clock,
        )
        self.intake = RequestIntake(
            config,
            self.router,
            self.metrics,
            prompts,
            self.session_sync,
            self.watch_events,
            self.lifecycle.predict,
        )
        for collector in (
            LedgerCollector(self.ledger, self.worker_names),
            FeederCollector(lambda: self.feeder),
            IndexCollector(self.index, self.worker_names, list(config.index.tiers)),
            EventWatchCollector(self.event_watch, self.worker_names),
            PairHealthCollector(
                self.pair_health,
                lambda: [(pair_name(p, d), (p, d)) for p, d in self.pairs()],
            ),
            *([EngineLoadCollector(self.engine_load, self.worker_names)] if self.engine_load is not None else []),
        ):
            self.metrics.registry.register(collector)
        self._api_key = read_secret(srv.api_key_env, "server.api_key_env")
        engine_key = read_secret(srv.engine_api_key_env, "server.engine_api_key_env")
        self._engine_headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
        self._background: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None
        self._driver: RequestDriver | None = None
        self._proxy: Proxy | None = None
        self.discovery: DynamoDiscovery | None = None

    # ---- the fleet ------------------------------------------------------------
    def role(self, worker: str) -> Role | None:
        """``worker``'s role, ``None`` once it left the fleet."""
        try:
            return self.fleet.by_name(WorkerId(worker)).role
        except KeyError:
            return None

    def worker_names(self) -> list[WorkerId]:
        """Every worker's name, in the fleet as it is now."""
        return [w.name for w in self.fleet.workers]

    def pairs(self) -> list[tuple[WorkerId, WorkerId]]:
        """Every (P, D) pair's names, in the fleet as it is now."""
        return [(p.name, d.name) for p in self.fleet.prefill for d in self.fleet.decode]

    def set_fleet(self, fleet: Fleet) -> None:
        """Serve ``fleet`` from the next request on: workers that joined are routed to and
        their KV events read; those that left are no longer routed to, their events no
        longer read and their blocks dropped from the index (requests in flight on them
        finish or fail as they would)."""
        joined, left = fleet_changes(self.fleet, fleet)
        self.router.set_fleet(fleet)
        self.fleet = fleet
        if self.engine_load is not None:
            self.engine_load.follow(fleet.workers)
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

    def _engine_sample(self, worker: WorkerId, sample: EngineLoad) -> None:
        """A worker's polled ``/metrics``: its pair health and its measured rates (P's
        prefills are timed by the proxy, not taken from P's histogram)."""
        self.pair_health.observe(worker, sample.transfer, sample.at)
        self.router.engine_polled(worker)
        self.rates.observe_sample(worker, sample, prefill=self.role(worker) is not Role.PREFILL)

    # ---- KV events ------------------------------------------------------------
    def event_batches(self) -> dict[WorkerId, int]:
        """Each subscribed worker's count of applied KV-event batches."""
        return {sub.worker: sub.stats.batches for sub in (self.feeder.subscribers if self.feeder is not None else ())}

    def watch_events(self) -> None:
        """Flag the workers whose KV events stopped, and clear the ones heard again; each
        change is logged, naming the worker."""
        if not self.event_watch.enabled:
            return
        changed = self.event_watch.update(self.event_batches(), self.clock.monotonic())
        for worker in changed.went_stale:
            log.warning(
                "worker %s prefilled blocks and published no KV event for %.0f s: routed on load alone until "
                "its next batch (is its --kv-events-config endpoint the one the router subscribes to? "
                "`kvpilot engine-flags` prints it)",
                worker,
                self.event_watch.stale_after_s,
            )
        for worker in changed.heard_again:
            log.info("worker %s publishes KV events again", worker)

    # ---- what every front answers alike ----------------------------------------
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

    def health_payload(self) -> dict[str, Any]:
        """``/health``'s answer: the workers served now."""
        return {"status": "ok", "workers": [w.name for w in self.fleet.workers]}

    def fleet_payload(self) -> dict[str, Any]:
        """``/debug/fleet``'s answer: each worker served now, with its role, URL, KV-event
        endpoint and Dynamo instance id (``None`` beside vLLM engines)."""
        instance = self.discovery.instance_id if self.discovery is not None else (lambda _: None)
        return {
            "block_size": self.config.index.block_size,
            "workers": [
                {
                    "name": w.name,
                    "role": w.role.value,
                    "url": w.url,
                    "kv_events_endpoint": w.kv_events_endpoint,
                    "instance_id": instance(w.name),
                }
                for w in self.fleet.workers
            ],
        }

    def models_payload(self) -> dict[str, Any]:
        """``/v1/models``' answer: the one served model."""
        model = {"id": self.config.server.model_name, "object": "model", "owned_by": "kvpilot"}
        return {"object": "list", "data": [model]}

    # ---- the engines ------------------------------------------------------------
    @property
    def proxy(self) -> Proxy:
        """The proxy, once the core has started."""
        assert self._proxy is not None, "the router has not started"
        return self._proxy

    @property
    def driver(self) -> RequestDriver:
        """The request driver every front drives its requests with, once the core has started."""
        assert self._driver is not None, "the router has not started"
        return self._driver

    @property
    def upstream(self) -> Upstream:
        """The engines' client, once the core has started."""
        return self.driver.upstream

    async def start(self, *, feed_index: bool = True) -> None:
        """Open the engines' side: their HTTP client and the proxy, the shared session store,
        the KV-event feeder (with ``feed_index``, one subscriber per worker with a KV-events
        endpoint, and the index caught up from their replay buffers), Dynamo's discovery,
        the fleet from ``server.workers_file`` (read now, then watched), the engines' limits,
        the calibration (``disaggregation.measured_rates``) and the ``/metrics`` poller."""
        timeout = aiohttp.ClientTimeout(total=self.config.server.request_timeout_s)
        # Beside Dynamo, a fresh connection per request: Dynamo 1.6.1's frontend leaves Nagle on
        # its client sockets (dynamo#14643), so on a kept-alive connection the first token,
        # written just after the response headers, waits for the router's delayed ACK (~40 ms,
        # measured here); a new connection ACKs at once (TCP quick-ACK at its start).
        connector = aiohttp.TCPConnector(force_close=self.config.dynamo.enabled)
        self._http = aiohttp.ClientSession(timeout=timeout, connector=connector)
        upstream = await self._upstream(self._http)
        self._driver = RequestDriver(
            upstream,
            self.lifecycle,
            self.metrics,
            prefill_timeout_s=self.config.server.prefill_timeout_s,
            session_served=self.session_sync.push if self.session_sync is not None else None,
        )
        self._proxy = Proxy(self._driver, self.config.server.max_retries)
        if self.session_sync is not None:
            await self.session_sync.open()
        srv = self.config.server
        listed = WorkersFile(Path(srv.workers_file), srv.workers_poll_s) if srv.workers_file else None
        if listed is not None:  # before the feeder: the listed workers' events are read from the start
            self.set_fleet(listed.read())
        dynamic = self.discovery is not None or listed is not None
        if feed_index and (dynamic or any(w.kv_events_endpoint for w in self.fleet.workers)):
            # Dynamo's workers bind their event sockets: the feeder connects to them
            self.feeder = IndexFeeder(
                self.fleet,
                self.index.inner,
                deliver=self.index.defer,
                bind=False if self.discovery else None,
                matches=lambda: self.index.matches,
                idle_read_s=self.config.index.events_idle_read_s,
                read_now=functools.partial(asyncio.get_running_loop().call_soon_threadsafe, self.index.run_queued),
            )
            self.feeder.start()
            self._background.append(asyncio.create_task(self._run_queued_changes()))
            # serve once the index holds what the engines' replay buffers hold (a restart mid-session)
            wait_s = CATCH_UP_WAIT_S * (1 + len(self.feeder.subscribers))
            await asyncio.get_running_loop().run_in_executor(None, self.feeder.caught_up.wait, wait_s)
        if listed is not None:
            self._background.append(asyncio.create_task(listed.watch(self.set_fleet)))
        if self.discovery is not None:
            self.set_fleet(fleet_of(self.discovery.workers()))
            self._background.append(asyncio.create_task(self.discovery.watch(self.set_fleet)))
        urls = [self.config.dynamo.frontend_url] if self.config.dynamo.enabled else [w.url for w in self.fleet.workers]
        self.intake.limits = await learned_limits(
            self._http, urls, self._engine_headers, self.config.server, self.intake.limits
        )
        if self.config.disaggregation.measured_rates:
            await self._calibrate(self._http)
        if self.engine_load is not None:
            self._background.append(asyncio.create_task(self.engine_load.run(self._http)))

    async def _run_queued_changes(self) -> None:
        """Apply the feeder's queued changes where no read of the index did, every
        :data:`~kvpilot.routing.index.queued.RUN_QUEUED_INTERVAL_S`. Runs until cancelled."""
        while True:
            await asyncio.sleep(RUN_QUEUED_INTERVAL_S)
            self.index.run_queued()

    async def _upstream(self, http: aiohttp.ClientSession) -> Upstream:
        """vLLM's engines, or Dynamo's frontend (its discovery opened here)."""
        if not self.config.dynamo.enabled:
            return VllmUpstream(http, self._engine_headers)
        from kvpilot.routing.serve.dynamo_upstream import DynamoUpstream

        self.discovery = await DynamoDiscovery.open(self.config.dynamo)
        return DynamoUpstream(http, self._engine_headers, self.discovery.instance_id)

    async def _calibrate(self, http: aiohttp.ClientSession) -> None:
        """Time the engines before serving (:mod:`kvpilot.routing.serve.calibrate`), each
        prefill as its traffic's is timed (by the engine's ``/metrics`` where they are
        polled; P's by its handoffs)."""
        timeout = aiohttp.ClientTimeout(total=5.0)

        async def metrics_now(worker: Worker) -> EngineLoad | None:
            return (await read_engine_load(http, worker, timeout))[0]

        metrics = None if self.engine_load is None else metrics_now
        calibrator = Calibrator(self.upstream, self.rates, self.config.server, read_metrics=metrics)
        await calibrator.run(self.fleet.workers)  # it logs what it measured; the rates hold it

    async def stop(self) -> None:
        """Close what :meth:`start` opened."""
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
