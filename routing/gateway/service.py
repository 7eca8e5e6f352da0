"""The picker's gRPC server, started beside the router's HTTP front on its event loop.

:func:`attach` adds to the router's aiohttp app a start step (after the router's own: the
index caught up, the fleet found) that serves, on ``server.host:gateway.picker_port``,
Envoy's ext_proc service (:mod:`kvpilot.routing.gateway.extproc`) and the OTLP logs service its
access log exports to (:mod:`kvpilot.routing.gateway.access_log`), each call checked for
``gateway.token_env``'s token when one is set (:mod:`kvpilot.routing.gateway.auth`), and a task that ends requests
whose access-log record never came (:meth:`~kvpilot.routing.gateway.picker.Picker.expire`).
Another task resolves the destinations' host names every :data:`RESOLVE_EVERY_S`
(:class:`~kvpilot.routing.gateway.picker.Addresses`); the config's hosts are resolved once
before the picker serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc as ls_grpc

from kvpilot.routing.config import RouterConfig, read_secret
from kvpilot.routing.core import OPEN_PATHS, UNAUTHORIZED_MESSAGE, RouterCore
from kvpilot.routing.gateway.access_log import AccessLogReceiver
from kvpilot.routing.gateway.auth import TokenInterceptor
from kvpilot.routing.gateway.extproc import ExternalProcessor
from kvpilot.routing.gateway.picker import Addresses, Picker
from kvpilot.routing.refusals import RejectReason
from kvpilot.routing.serve.driver import error_reply
from kvpilot.routing.serve.loopback import beyond_loopback

log = logging.getLogger(__name__)

EXPIRE_EVERY_S = 5.0
"""How often requests without an access-log record are looked for."""
GRACE_S = 5.0
"""How long a stopping picker lets its open gRPC calls finish."""
RESOLVE_EVERY_S = 5.0
"""How often the destinations' host names are resolved again: an engine whose pod moved
is reached at its new address within this (plus the resolver's own cache)."""


def destination_hosts(config: RouterConfig) -> list[str]:
    """The hosts the picker may name: every worker's, and Dynamo's frontend."""
    urls = [w.url for w in config.workers] + ([config.dynamo.frontend_url] if config.dynamo.enabled else [])
    return [host for host in (urlsplit(url).hostname for url in urls) if host is not None]


def _answer_get(core: RouterCore) -> Any:
    """The router's answer to a GET that reached the picker: (status, JSON payload); the
    API key is required as at the router's HTTP front."""

    def answer(path: str, headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
        path = path.split("?", 1)[0]
        if path not in OPEN_PATHS and not core.authorized(headers):
            return 401, error_reply(401, UNAUTHORIZED_MESSAGE, "authentication_error").payload
        if path == "/v1/models":
            return 200, core.models_payload()
        if path == "/health":
            return 200, core.health_payload()
        return 404, error_reply(404, f"no GET {path!r} here").payload

    return answer


def attach(app: web.Application, core: RouterCore) -> None:
    """Serve the picker with ``app`` (see the module doc), once ``core`` has started (the
    app's own start step, added before this one, starts it). Reads ``gateway.token_env``'s
    token now."""
    config = core.config
    token = read_secret(config.gateway.token_env, "gateway.token_env")
    state: dict[str, Any] = {}

    async def start(_: web.Application) -> None:
        addresses = Addresses()
        await addresses.refresh(destination_hosts(config))
        picker = Picker(
            core.intake,
            core.driver,
            core.admission,
            config.server,
            core.authorized,
            addresses,
        )
        if token is None and beyond_loopback(config.server.host):
            log.warning("the picker is reachable beyond this machine with no token (set gateway.token_env)")
        refused = core.metrics.rejected.labels(RejectReason.UNAUTHORIZED.value).inc
        grpc_server = grpc.aio.server(interceptors=[] if token is None else [TokenInterceptor(token, refused)])
        ep_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(picker, _answer_get(core), config.server.max_body_bytes), grpc_server
        )
        ls_grpc.add_LogsServiceServicer_to_server(AccessLogReceiver(picker), grpc_server)
        address = f"{config.server.host}:{config.gateway.picker_port}"
        if grpc_server.add_insecure_port(address) == 0:
            raise OSError(f"the picker cannot listen on {address}")
        await grpc_server.start()
        state["server"] = grpc_server
        state["tasks"] = [asyncio.create_task(_expire(picker)), asyncio.create_task(_refresh(addresses))]
        log.info("endpoint picker (ext_proc, OTLP access log) on %s", address)

    async def stop(_: web.Application) -> None:
        for task in state.get("tasks", ()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        grpc_server = state.get("server")
        if grpc_server is not None:
            await grpc_server.stop(GRACE_S)

    app.on_startup.append(start)
    app.on_cleanup.insert(0, stop)


async def _expire(picker: Picker) -> None:
    while True:
        await asyncio.sleep(EXPIRE_EVERY_S)
        await picker.expire(time.perf_counter())


async def _refresh(addresses: Addresses) -> None:
    while True:
        await asyncio.sleep(RESOLVE_EVERY_S)
        await addresses.refresh()
