"""Closed to strangers (issue 41): each test sends the forged or hostile input and shows it
refused. The router runs for real (aiohttp's test server, its picker's gRPC server) in front
of :mod:`tests.fakes.engine` engines, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
import yarl
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.typedefs import Handler
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as ls
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc as ls_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.logs.v1 import logs_pb2

from kvpilot.routing.config import ConfigError, SessionConfig, read_secret
from kvpilot.routing.config_load import load_config
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.gateway.access_log import LOG_GROUPS_FIELD, LOG_RECORDS_FIELD
from kvpilot.routing.gateway.service import attach
from kvpilot.routing.ids import SessionId
from kvpilot.routing.serve.app import Access, RouterServer, access_of, build_server, is_loopback
from kvpilot.routing.serve.upstream import Api
from tests.fakes.engine import PROMPT_WORDS as WORDS
from tests.fakes.engine import FakeEngine
from tests.fakes.ports import free_ports

TOKEN_ENV = "KVPILOT_TEST_GATEWAY_TOKEN"
ADMIN_ENV = "KVPILOT_TEST_ADMIN_TOKEN"
PROMPT = [i % len(WORDS) for i in range(40)]
Scenario = Callable[[TestClient, RouterServer, int], Awaitable[None]]


def run(
    model_dir: Path, scenario: Scenario, *, picker: bool = False, peer: list[str] | None = None, **sections: Any
) -> None:
    """One co-located fake engine, the router (with its picker on a free port when
    ``picker``), then ``scenario(client, router, picker_port)``. With ``peer``, every request
    reaches the router as if from the address ``peer[0]`` holds then (the client still
    connects over 127.0.0.1)."""

    async def main() -> None:
        engine = FakeEngine("co-0")
        engine_server = TestServer(engine.app(), host="127.0.0.1")
        await engine_server.start_server()
        (picker_port,) = free_ports(1)
        server = {"model_dir": str(model_dir), **sections.pop("server", {})}
        doc = {
            "index": {"block_size": 4},
            "server": server,
            "workers": [{"name": "co-0", "role": "colocated", "url": str(engine_server.make_url("/")).rstrip("/")}],
            **({"gateway": {"picker_port": picker_port, **sections.pop("gateway", {})}} if picker else {}),
            **sections,
        }
        path = model_dir / "strangers.yaml"
        path.write_text(yaml.safe_dump(doc))
        config = load_config(path)
        router = build_server(config, fleet_from_config(config), feed_index=False)
        app = router.app()
        if peer is not None:
            app.middlewares.insert(0, _forged_peer(peer))
        if picker:
            attach(app, router.core)
        try:
            async with TestClient(TestServer(app, host="127.0.0.1")) as client:
                await scenario(client, router, picker_port)
        finally:
            await engine_server.close()

    asyncio.run(main())


def _forged_peer(peer: list[str]) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware, first in the chain, that hands the router each request as if its TCP
    peer were ``peer[0]`` (aiohttp's ``Request.clone(remote=...)``)."""

    @web.middleware
    async def forge(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request.clone(remote=peer[0]))

    return forge


# ---- the picker's gRPC port: ext_proc and the access log ------------------------------


def _header(key: str, value: str) -> base_pb2.HeaderValue:
    return base_pb2.HeaderValue(key=key, raw_value=value.encode())


async def _pick(channel: grpc.aio.Channel, request_id: str, metadata: tuple[tuple[str, str], ...]) -> None:
    """Envoy's ext_proc stream for one completion, as kvpilot's Envoy config sends it."""
    headers = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                _header(":path", "/v1/completions"),
                _header(":method", "POST"),
                _header("content-type", "application/json"),
                _header("x-request-id", request_id),
            ]
        )
    )
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    stream = ep_grpc.ExternalProcessorStub(channel).Process(metadata=metadata)
    await stream.write(ep.ProcessingRequest(request_headers=headers))
    await stream.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    answers = [await stream.read(), await stream.read()]
    await stream.done_writing()
    assert answers[1].request_body.response.header_mutation.set_headers, answers[1]  # a destination


def _failed_records(request_ids: list[str]) -> ls.ExportLogsServiceRequest:
    """Access-log records saying each request's destination answered 503."""
    records = []
    for rid in request_ids:
        record = logs_pb2.LogRecord()
        for key, value in (("request_id", rid), ("status", "503"), ("duration_us", "900"), ("response_flags", "-")):
            record.attributes.append(common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value)))
        records.append(record)
    request = ls.ExportLogsServiceRequest()
    resource = request.resource_logs.add()
    group = _field(resource, LOG_GROUPS_FIELD).add()  # whichever copy of the OTLP modules is installed
    _field(group, LOG_RECORDS_FIELD).extend(records)
    return request


def _field(message: Any, number: int) -> Any:
    return getattr(message, message.DESCRIPTOR.fields_by_number[number].name)


def _trips(router: RouterServer) -> float:
    return (
        router.core.metrics.registry.get_sample_value("kvpilot_router_circuit_trips_total", {"worker": "co-0"}) or 0.0
    )


def test_forged_access_log_records_without_the_token_open_no_circuit(model_dir, monkeypatch):
    """Three forged 503 records for requests in flight would open co-0's circuit (the
    positive control sends them with the token); without it every call is refused."""
    monkeypatch.setenv(TOKEN_ENV, "gw-s3cret")
    good = (("authorization", "Bearer gw-s3cret"),)

    async def scenario(client, router, picker_port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker_port}") as channel:
            ids = ["r1", "r2", "r3"]
            for rid in ids:
                await _pick(channel, rid, good)
            logs = ls_grpc.LogsServiceStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "gw-s3cret"),)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await logs.Export(_failed_records(ids), metadata=metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "gw-s3cret" not in (refused.value.details() or "")
            stranger = ep_grpc.ExternalProcessorStub(channel).Process()  # nor is a stranger routed
            assert await stranger.code() is grpc.StatusCode.UNAUTHENTICATED
            assert _trips(router) == 0
            await logs.Export(_failed_records(ids), metadata=good)
            assert _trips(router) == 1  # the same records from Envoy, with the token: the circuit opens

    run(model_dir, scenario, picker=True, gateway={"token_env": TOKEN_ENV})


# ---- /debug/route: an admin path that creates no session -------------------------------


ADMIN_TOKEN, API_KEY = "admin-s3cret", "client-key"
SENT = {"admin token": f"Bearer {ADMIN_TOKEN}", "API key": f"Bearer {API_KEY}", "wrong": "Bearer WRONG", "none": None}
LOOPBACK, STRANGER = "127.0.0.1", "203.0.113.7"
DEBUG_ROUTE_STATUS = {
    # (API key set, admin token set): {peer: the status for each of SENT, in its order}
    (False, False): {LOOPBACK: (200, 200, 200, 200), STRANGER: (403, 403, 403, 403)},
    (False, True): {LOOPBACK: (200, 403, 403, 403), STRANGER: (200, 403, 403, 403)},
    (True, False): {LOOPBACK: (401, 200, 401, 401), STRANGER: (403, 403, 403, 403)},
    (True, True): {LOOPBACK: (200, 403, 403, 403), STRANGER: (200, 403, 403, 403)},
}
"""Who gets ``/debug/route``: with an admin token, its bearer from any address; without, a
loopback peer only, with the API key when one is set. The client key never stands in for the
admin token."""


@pytest.mark.parametrize(("api_key", "admin_token"), list(DEBUG_ROUTE_STATUS), ids=lambda on: "set" if on else "unset")
def test_the_admin_endpoint_is_closed_whatever_else_is_configured(model_dir, monkeypatch, api_key, admin_token):
    """Every peer and bearer against ``DEBUG_ROUTE_STATUS``; client endpoints keep the API
    key's rule (401 without it when one is set, from any address) and ``/health`` and
    ``/metrics`` stay open."""
    monkeypatch.setenv("KVPILOT_TEST_KEY", API_KEY)
    monkeypatch.setenv(ADMIN_ENV, ADMIN_TOKEN)
    peer = [LOOPBACK]

    async def scenario(client, router, _):
        for address, statuses in DEBUG_ROUTE_STATUS[api_key, admin_token].items():
            peer[0] = address
            for (sent, bearer), status in zip(SENT.items(), statuses, strict=True):
                headers = {} if bearer is None else {"Authorization": bearer}
                case = (address, sent)
                resp = await client.post("/debug/route", json={"prompt": PROMPT}, headers=headers)
                assert resp.status == status, case
                text = await resp.text()
                assert ADMIN_TOKEN not in text and API_KEY not in text, case
                if status == 200:
                    assert json.loads(text)["decode_worker"] == "co-0", case
                respelled = yarl.URL("/debug/%72oute", encoded=True)  # the same route, spelled otherwise
                assert (await client.post(respelled, json={"prompt": PROMPT}, headers=headers)).status == status, case
                fleet = await client.get("/debug/fleet", headers=headers)  # the other admin endpoint, the same rule
                assert fleet.status == status, case
                if status == 200:
                    assert [w["name"] for w in (await fleet.json())["workers"]] == ["co-0"], case
                client_status = 401 if api_key and sent != "API key" else 200
                models = await client.get("/v1/models", headers=headers)
                assert models.status == client_status, case
                if client_status == 401:
                    assert models.headers["WWW-Authenticate"] == "Bearer", case
                for path in ("/health", "/metrics"):
                    assert (await client.get(path, headers=headers)).status == 200, (path, *case)
        peer[0] = STRANGER
        key = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body, headers=key)).status == 200  # served from afar

    server = {"api_key_env": "KVPILOT_TEST_KEY"} if api_key else {}
    run(model_dir, scenario, peer=peer, server={**server, **({"admin_token_env": ADMIN_ENV} if admin_token else {})})


def test_every_endpoint_is_declared_open_client_or_admin(model_dir):
    """A new endpoint is a client's unless declared otherwise: this table names each one, so
    that an operator's endpoint cannot be added without deciding who may call it."""
    declared = {
        "/v1/completions": Access.CLIENT,
        "/v1/chat/completions": Access.CLIENT,
        "/v1/models": Access.CLIENT,
        "/health": Access.OPEN,
        "/metrics": Access.OPEN,
        "/debug/route": Access.ADMIN,
        "/debug/fleet": Access.ADMIN,
    }
    config = load_config(_write_config(model_dir))
    routes = build_server(config, fleet_from_config(config), feed_index=False).app().router.routes()
    paths = {route.resource.canonical for route in routes if route.resource is not None}
    assert paths == set(declared)
    assert {path: access_of(path) for path in paths} == declared


def _write_config(model_dir: Path) -> Path:
    path = model_dir / "declared.yaml"
    worker = {"name": "co-0", "role": "colocated", "url": "http://127.0.0.1:9"}
    path.write_text(yaml.safe_dump({"server": {"model_dir": str(model_dir)}, "workers": [worker]}))
    return path


def test_the_explain_tokenizes_off_the_event_loop_and_waits_for_admission(model_dir, monkeypatch):
    """``/debug/route`` renders and tokenizes a text prompt in a worker thread, and is refused
    as a client's request is (429, ``Retry-After``) while the router is full."""

    async def scenario(client, router, _):
        loop_thread, tokenized_on = threading.get_ident(), []
        token_ids = router.core.intake.prompts.token_ids

        def recorded(api: Api, body: dict[str, Any], **kwargs: Any) -> list[int]:
            tokenized_on.append(threading.get_ident())
            return token_ids(api, body, **kwargs)

        monkeypatch.setattr(router.core.intake.prompts, "token_ids", recorded)
        text = " ".join(WORDS[i % len(WORDS)] for i in range(40))
        for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
            assert (await client.post("/debug/route", json=body)).status == 200, body
        assert len(tokenized_on) == 2 and loop_thread not in tokenized_on
        await router.core.admission.acquire()  # the one slot taken, no queue
        try:
            full = await client.post("/debug/route", json={"prompt": text})
            assert full.status == 429 and full.headers["Retry-After"] == "2"
        finally:
            router.core.admission.release()
        assert len(tokenized_on) == 2  # refused before its prompt was read
        assert (await client.post("/debug/route", json={"prompt": text})).status == 200

    run(model_dir, scenario, server={"max_concurrent_requests": 1, "max_queued_requests": 0, "queue_timeout_s": 2.0})


@pytest.mark.parametrize(
    ("peer", "allowed"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.7", False),
        ("203.0.113.7", False),
        ("::ffff:203.0.113.7", False),
        (None, False),
        ("x", False),
    ],
)
def test_without_an_admin_token_debug_route_answers_only_this_host(peer, allowed):
    assert is_loopback(peer) is allowed


def test_a_dry_run_creates_no_session(model_dir):
    async def scenario(client, router, _):
        for i in range(5):
            resp = await client.post("/debug/route", json={"prompt": PROMPT, "conversation_id": f"probe-{i}"})
            assert resp.status == 200
        assert len(router.core.router.sessions) == 0
        body = {"prompt": PROMPT, "max_tokens": 2, "conversation_id": "real"}
        assert (await client.post("/v1/completions", json=body)).status == 200
        assert router.core.router.sessions.get(SessionId("real")).steps == 1
        explained = await (await client.post("/debug/route", json={**body, "prompt": [*PROMPT, 1]})).json()
        assert explained["session_option"] is None or explained["options"]  # the live session is explained

    run(model_dir, scenario)


# ---- sessions: only served ones live, a limit per client -------------------------------


def _served(store: SessionStore, key: str) -> None:
    store.get(SessionId(key)).steps += 1  # what Router.served does


def test_a_flood_of_new_session_ids_drops_no_served_session():
    store = SessionStore(block_size=2, max_sessions=4)
    for key in ("a", "b"):
        _served(store, key)
    for i in range(1000):
        store.get(SessionId(f"flood-{i}"))  # named by requests never served
    assert SessionId("a") in store and SessionId("b") in store
    assert store.get(SessionId("a")).steps == 1 and store.get(SessionId("b")).steps == 1


def test_a_client_past_its_limit_drops_its_own_sessions_only():
    store = SessionStore(block_size=2, max_sessions=100, max_per_client=3)
    store.claim(SessionId("victim"), "10.0.0.1")
    _served(store, "victim")
    for i in range(50):
        store.claim(SessionId(f"mine-{i}"), "10.0.0.2")
        _served(store, f"mine-{i}")
    assert SessionId("victim") in store
    assert [SessionId(f"mine-{i}") in store for i in range(46, 50)] == [False, True, True, True]
    assert len(store) == 4


def test_the_relay_holds_a_client_to_its_session_limit(model_dir):
    async def scenario(client, router, _):
        for i in range(6):
            body = {"prompt": PROMPT, "max_tokens": 2, "conversation_id": f"s{i}"}
            assert (await client.post("/v1/completions", json=body)).status == 200
        held = [SessionId(f"s{i}") in router.core.router.sessions for i in range(6)]
        assert held == [False, False, False, False, True, True]

    run(model_dir, scenario, sessions={"max_sessions_per_client": 2})


# ---- secrets: from the environment or a file, never echoed -----------------------------


def test_a_password_in_the_redis_url_is_refused_without_echoing_it():
    with pytest.raises(ConfigError) as refused:
        SessionConfig(store="redis", redis_url="redis://:hunter2@redis.internal:6379/0")
    assert "hunter2" not in str(refused.value) and "redis_password_env" in str(refused.value)


def test_a_secret_is_read_from_its_variable_or_a_file_and_never_named_in_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPILOT_TEST_SECRET", "from-env")
    assert read_secret("KVPILOT_TEST_SECRET", "k") == "from-env"
    monkeypatch.delenv("KVPILOT_TEST_SECRET")
    (tmp_path / "secret").write_text("from-file\n")
    monkeypatch.setenv("KVPILOT_TEST_SECRET_FILE", str(tmp_path / "secret"))
    assert read_secret("KVPILOT_TEST_SECRET", "k") == "from-file"
    monkeypatch.setenv("KVPILOT_TEST_SECRET", "both-set")
    with pytest.raises(ConfigError, match="not both") as refused:
        read_secret("KVPILOT_TEST_SECRET", "k")
    assert "both-set" not in str(refused.value) and "from-file" not in str(refused.value)
    assert read_secret("", "k") is None
