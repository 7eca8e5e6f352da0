"""Beside Dynamo, the pure parts and the in-process edges: an instance as a worker,
the config section, a fleet that changes (router, feeder, server), and the Dynamo
upstream's headers against a fake frontend. Dynamo itself runs in tests/e2e/test_dynamo.py."""

from __future__ import annotations

import asyncio
import queue
import random
import time
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp.test_utils import TestServer

from kvpilot.routing.config import (
    ConfigError,
    DynamoConfig,
    Role,
    RouterConfig,
    ServerConfig,
    Worker,
    prior_model,
)
from kvpilot.routing.config_load import load_config
from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.router import NoHealthyWorker, Router, policy_from_config
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import fleet_changes, fleet_from_config, fleet_of
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.ingest.dynamo_discovery import kv_events_endpoint, request_plane_address, worker_of
from kvpilot.routing.ingest.feeder import IndexFeeder
from kvpilot.routing.serve.app import build_server
from kvpilot.routing.serve.dynamo_upstream import (
    PREFILL_INSTANCE_HEADER,
    WORKER_INSTANCE_HEADER,
    DynamoUpstream,
    with_token_data,
)
from kvpilot.routing.serve.upstream import Api, EngineRequest, PrefillFailure, UpstreamError
from tests.fakes.engine import FakeEngine, word_model_dir
from tests.fakes.ports import free_ports

BS = 4
FRONTEND = "http://127.0.0.1:8090"
ADDRESS = "127.0.0.1:19171/588fbdbd1e911894/dynamo/backend/generate"  # as Dynamo 1.6.1 writes it


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        (ADDRESS, ("127.0.0.1", 19171)),
        ("127.0.0.1:36559", ("127.0.0.1", 36559)),
        ("[::1]:4000/abc/ns/c/e", ("::1", 4000)),
        ("dynamo.backend.generate-588fbdbd", None),  # a NATS subject: no host and port
        ("127.0.0.1:99999/x", None),
        (":80/x", None),
    ],
)
def test_the_request_plane_address_is_read_as_host_and_port(address, expected):
    assert request_plane_address(address) == expected


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ({"kv_events_port_offset": 100}, "tcp://127.0.0.1:19271"),  # many workers on one host
        ({"kv_events_port_offset": -1000}, "tcp://127.0.0.1:18171"),
        ({"kv_events_port": 20080}, "tcp://127.0.0.1:20080"),  # one worker per host
        ({}, None),  # no rule: no events, routed on load alone
    ],
)
def test_a_worker_s_kv_events_endpoint_follows_the_configured_port_rule(rule, expected):
    assert kv_events_endpoint(DynamoConfig(frontend_url=FRONTEND, **rule), ADDRESS) == expected


def test_an_instance_is_a_worker_named_by_role_and_id_reached_through_the_frontend():
    cfg = DynamoConfig(frontend_url=FRONTEND, kv_events_port_offset=100)
    worker = worker_of(cfg, Role.PREFILL, 0x588FBDBD1E911894, ADDRESS)
    assert worker.name == "prefill-588fbdbd1e911894" and worker.role is Role.PREFILL
    assert worker.url == FRONTEND
    assert worker.kv_events_endpoint == "tcp://127.0.0.1:19271" and worker.topic == ""
    assert worker_of(cfg, Role.DECODE, 7, "nats-subject").kv_events_endpoint is None


def test_an_instance_named_in_kv_events_endpoints_is_read_there_before_any_port_rule():
    # workers in one process share its request-plane port: only their ids tell them apart
    named = {"588FBDBD1E911894": "tcp://127.0.0.1:28500"}
    cfg = DynamoConfig(frontend_url=FRONTEND, kv_events_port_offset=100, kv_events_endpoints=named)
    assert dict(cfg.kv_events_endpoints) == {"588fbdbd1e911894": "tcp://127.0.0.1:28500"}
    assert worker_of(cfg, Role.DECODE, 0x588FBDBD1E911894, ADDRESS).kv_events_endpoint == "tcp://127.0.0.1:28500"
    assert worker_of(cfg, Role.DECODE, 7, ADDRESS).kv_events_endpoint == "tcp://127.0.0.1:19271"  # the rule


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"frontend_url": "127.0.0.1:8090"}, "dynamo.frontend_url: must be http"),
        ({"discovery_backend": "nats"}, "dynamo.discovery_backend: must be one of 'file', 'etcd'"),
        ({"decode_endpoint": "backend.generate"}, "dynamo.decode_endpoint: must be namespace.component.endpoint"),
        ({"discovery_interval_s": 0}, "dynamo.discovery_interval_s: must be a finite number > 0"),
        ({"kv_events_port": 20080, "kv_events_port_offset": 100}, "not both"),
        ({"kv_events_port": 70000}, "dynamo.kv_events_port: must be a finite number >= 0 and < 65536"),
        ({"kv_events_endpoints": {"decode-1": "tcp://127.0.0.1:1"}}, "keys are instance ids in hex"),
        ({"kv_events_endpoints": {"1f": "127.0.0.1:1"}}, "1f: must be tcp://host:port"),
    ],
)
def test_the_dynamo_section_is_checked_naming_the_field(tmp_path, section, message):
    import yaml

    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"dynamo": {"frontend_url": FRONTEND, **section}}))
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "r.yaml")


def test_beside_dynamo_the_fleet_starts_empty_and_configured_workers_are_refused():
    dynamo = DynamoConfig(frontend_url=FRONTEND + "/")
    assert dynamo.frontend_url == FRONTEND and dynamo.enabled and not DynamoConfig().enabled
    assert fleet_from_config(RouterConfig(dynamo=dynamo)).workers == ()
    worker = Worker(WorkerId("d0"), Role.DECODE, "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="come from Dynamo's discovery"):
        fleet_from_config(RouterConfig(dynamo=dynamo, workers=(worker,)))


def _w(name: str, role: Role = Role.DECODE, port: int = 1, events: str | None = None) -> Worker:
    return Worker(WorkerId(name), role, f"http://127.0.0.1:{port}", kv_events_endpoint=events, topic="")


def test_fleet_changes_name_who_joined_and_who_left():
    old = fleet_of([_w("p0", Role.PREFILL), _w("d0"), _w("d1")])
    new = fleet_of([_w("p0", Role.PREFILL), _w("d1", port=2), _w("d2")])
    joined, left = fleet_changes(old, new)
    assert [w.name for w in joined] == ["d1", "d2"]  # d1's url changed: it left and joined again
    assert [w.name for w in left] == ["d0", "d1"]
    assert fleet_changes(new, new) == ((), ())


def _router(fleet_workers: list[Worker]) -> Router:
    cfg = RouterConfig()
    return Router(
        fleet_of(fleet_workers),
        cfg,
        BlockIndex(BS),
        LoadLedger(),
        SessionStore(BS, 8),
        policy_from_config(cfg.disaggregation, prior_model(cfg)),
        random.Random(0),
    )


def test_a_router_routes_over_the_fleet_it_was_last_given():
    router = _router([])
    with pytest.raises(NoHealthyWorker):  # a discovered fleet with no worker yet: a 503
        router.route([1, 2, 3, 4], "r0")
    router.set_fleet(fleet_of([_w("d0")]))
    assert router.route([1, 2, 3, 4], "r1").decode.name == "d0"
    router.set_fleet(fleet_of([_w("d1")]))  # d0 left, d1 joined
    assert {router.route([i, 2, 3, 4], f"r{i}").decode.name for i in range(8)} == {"d1"}
    router.set_fleet(fleet_of([_w("p0", Role.PREFILL)]))  # prefill workers only: nobody can decode
    with pytest.raises(NoHealthyWorker):
        router.route([1, 2, 3, 4], "r9")


def test_a_session_whose_last_workers_left_is_routed_afresh():
    p0, p1, d0 = _w("p0", Role.PREFILL), _w("p1", Role.PREFILL, 2), _w("d0", port=3)
    router = _router([p0, d0])
    session = SessionId("s")
    prompt = list(range(8 * BS))
    router.served(session, router.route(prompt, "r1", session=session))
    router.set_fleet(fleet_of([p1, d0]))  # the session's last P left
    route = router.route([*prompt, *range(100, 100 + BS)], "r2", session=session)
    assert route.decode.name == "d0" and route.prefill_worker.name in ("p1", "d0")


def test_a_router_with_prefill_workers_needs_a_policy():
    router = Router(fleet_of([]), RouterConfig(), BlockIndex(BS), LoadLedger(), SessionStore(BS, 8), None)
    with pytest.raises(ValueError, match="local-vs-remote policy"):
        router.set_fleet(fleet_of([_w("p0", Role.PREFILL), _w("d0")]))


def _stored(tokens: list[int], block: int) -> bytes:
    event = {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None}
    event |= {"token_ids": tokens, "block_size": BS}
    return msgspec.msgpack.encode([time.time(), [event]])


def _wait(condition: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_the_feeder_reads_a_worker_that_joins_and_forgets_one_that_leaves():
    """Publishers that bind (as Dynamo's workers do), a feeder that connects to them; the
    index is this thread's alone: the feeder's thread hands it every change."""
    ctx = zmq.Context()
    port_a, port_b = free_ports(2)
    pubs = []
    for port in (port_a, port_b):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{port}")
        pubs.append(pub)
    index, changes = BlockIndex(BS), queue.SimpleQueue[Any]()
    a = _w("a", events=f"tcp://127.0.0.1:{port_a}")
    b = _w("b", events=f"tcp://127.0.0.1:{port_b}")
    feeder = IndexFeeder(fleet_of([a]), index, deliver=changes.put, context=ctx, poll_ms=20, bind=False)
    feeder.start()
    chain = PromptChain([1, 2, 3, 4], BS)

    def holds(name: str) -> bool:
        while not changes.empty():  # the owner runs the changes handed to it, in order
            changes.get()()
        return bool(index.match(chain).blocks.get(WorkerId(name)))

    def publish(pub: zmq.Socket[bytes], until: Any) -> bool:
        """Publish seq 0 until ``until()`` (a connecting SUB misses what came before it)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not until():
            pub.send_multipart((b"", (0).to_bytes(8, "big"), _stored([1, 2, 3, 4], 11)))
            time.sleep(0.05)
        return bool(until())

    try:
        assert publish(pubs[0], lambda: holds("a"))
        feeder.add(b)
        assert publish(pubs[1], lambda: holds("b"))
        assert sorted(s.worker for s in feeder.subscribers) == ["a", "b"]
        feeder.remove(WorkerId("a"))
        assert _wait(lambda: not holds("a"))
        assert [s.worker for s in feeder.subscribers] == ["b"]
        pubs[0].send_multipart((b"", (1).to_bytes(8, "big"), _stored([1, 2, 3, 4], 11)))
        time.sleep(0.2)
        assert not holds("a")  # nothing of a departed worker is applied again
    finally:
        feeder.stop()
        for pub in pubs:
            pub.close()
        ctx.term()


def test_the_server_serves_the_fleet_it_was_last_given(tmp_path):
    server_cfg = ServerConfig(model_dir=str(word_model_dir(tmp_path)))
    cfg = RouterConfig(server=server_cfg, dynamo=DynamoConfig(frontend_url=FRONTEND))
    server = build_server(cfg, fleet_from_config(cfg), feed_index=False)  # not started: no discovery
    server.core.set_fleet(fleet_of([_w("d0")]))
    assert server.core.router.route([1, 2, 3, 4], "r0").decode.name == "d0"
    server.core.set_fleet(fleet_of([_w("d1"), _w("p0", Role.PREFILL, 2)]))  # d0 left; d1 and a prefill worker joined
    assert server.core.worker_names() == ["p0", "d1"] and server.core.pairs() == [("p0", "d1")]
    assert server.core.router.route([1, 2, 3, 4], "r1").decode.name == "d1"
    text = server.core.metrics.render()[0].decode()
    assert 'kvpilot_router_active_requests{worker="d1"}' in text
    assert 'kvpilot_router_active_requests{worker="d0"}' not in text  # the departed worker's gauges go
    assert 'kvpilot_router_pair_penalty_blocks{pair="p0->d1"}' in text


def _frontend_run(scenario: Any) -> tuple[FakeEngine, Any]:
    async def main() -> Any:
        frontend = FakeEngine("frontend")
        server = TestServer(frontend.app(), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("/")).rstrip("/")
        ids = {WorkerId("p0"): 11, WorkerId("d0"): 22}
        try:
            async with aiohttp.ClientSession() as http:
                upstream = DynamoUpstream(http, {"Authorization": "Bearer k"}, ids.get)
                return frontend, await scenario(upstream, url)
        finally:
            await server.close()

    return asyncio.run(main())


def test_dynamo_s_prefill_is_deferred_and_d_s_call_names_both_instances():
    async def scenario(upstream: DynamoUpstream, url: str) -> Any:
        p, d = Worker(WorkerId("p0"), Role.PREFILL, url), Worker(WorkerId("d0"), Role.DECODE, url)
        ids = [1, 2]
        outcome = await upstream.prefill(p, _completion({"prompt": ids}, ids), {"do_remote_decode": True}, 30.0)
        payload = await upstream.complete(d, _completion({"model": "tiny", "prompt": ids}, ids), outcome.params)
        text = _completion({"model": "tiny", "prompt": "a b c", "stream": True}, [1, 2, 3])
        async with upstream.stream(d, text, None) as events:
            streamed = [data async for batch in events for data in batch]
        return outcome, payload, streamed

    frontend, (outcome, payload, streamed) = _frontend_run(scenario)
    assert outcome.deferred and outcome.params == {PREFILL_INSTANCE_HEADER: "11"}
    assert payload["choices"][0]["text"] == "frontend:2" and streamed[-1] == "[DONE]"
    first, second = frontend.headers
    assert first[WORKER_INSTANCE_HEADER] == "22" and first[PREFILL_INSTANCE_HEADER] == "11"
    assert second[WORKER_INSTANCE_HEADER] == "22" and PREFILL_INSTANCE_HEADER not in second
    assert first["Authorization"] == "Bearer k"
    assert all("kv_transfer_params" not in body for body in frontend.bodies)  # Dynamo hands the KV over itself
    assert frontend.bodies[0]["prompt"] == [1, 2] and "nvext" not in frontend.bodies[0]  # token ids as sent
    # a text prompt goes as the client sent it, with the router's ids: the frontend does not tokenize again
    assert frontend.bodies[1]["prompt"] == "a b c" and frontend.bodies[1]["nvext"] == {"token_data": [1, 2, 3]}


def _completion(body: dict[str, Any], token_ids: list[int]) -> EngineRequest:
    return EngineRequest(Api.COMPLETIONS, body, body["prompt"] if isinstance(body["prompt"], list) else token_ids)


def test_a_worker_that_left_dynamo_fails_before_any_call():
    async def scenario(upstream: DynamoUpstream, url: str) -> Any:
        gone = Worker(WorkerId("d9"), Role.DECODE, url)
        gone_p = Worker(WorkerId("p9"), Role.PREFILL, url)
        outcome = await upstream.prefill(gone_p, _completion({"prompt": [1]}, []), {}, 30.0)
        with pytest.raises(UpstreamError) as raised:
            await upstream.complete(gone, _completion({"prompt": [1]}, []), None)
        return outcome, raised.value

    frontend, (outcome, error) = _frontend_run(scenario)
    assert outcome.params is None and outcome.failure is PrefillFailure.CONNECTION
    assert error.status == 502 and "left the Dynamo deployment" in str(error)
    assert frontend.bodies == []


def test_the_frontend_gets_the_client_s_agent_hints_beside_the_router_s_ids():
    hints = {"osl": 64, "latency_sensitivity": 1.2}
    text = EngineRequest(Api.COMPLETIONS, {"prompt": "a b"}, [1, 2], hints)
    assert with_token_data(text)["nvext"] == {"agent_hints": hints, "token_data": [1, 2]}
    ids = [3, 4]
    token_ids = EngineRequest(Api.COMPLETIONS, {"prompt": ids}, ids, hints)
    assert with_token_data(token_ids)["nvext"] == {"agent_hints": hints}
    chat = EngineRequest(Api.CHAT, {"messages": []}, [5], None)
    assert with_token_data(chat) == {"messages": []}  # nothing to add: the body as sent
