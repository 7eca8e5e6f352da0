"""The shared session store against a real ``redis-server`` (``tests/redis_server.py``):
records, their expiry, the sync's reads and writes, outages and timeouts, and two
routers (replicas, or one router and its restart) sharing a session over fake engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvpilot.routing.config import ConfigError, RouterConfig
from kvpilot.routing.decide.session_record import RECORD_VERSION, OfferRecord, SessionRecord, StoreOp, merge
from kvpilot.routing.decide.sessions import SessionOffer, SessionStore
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.state.redis_store import RedisSessionStore
from kvpilot.routing.state.sync import SessionSync
from tests.fakes.ports import free_ports
from tests.redis_server import running_redis
from tests.unit.routing.test_routing_server import PD, PROMPT, run

S = SessionId("agent")
OFFER = {"do_remote_decode": True, "remote_block_ids": [[5, 6]], "remote_engine_id": "decode-0"}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(free_ports(1)[0], tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"test-{request.node.name}:"  # each test its own keys


def _sync(url: str, prefix: str, metrics: RouterMetrics, **kw: float) -> tuple[SessionSync, SessionStore]:
    sessions = SessionStore(block_size=4, max_sessions=16)
    timeouts = {"read_timeout_s": 0.2, "write_timeout_s": 0.2, "ttl_s": 60.0, **kw}
    sync = SessionSync(RedisSessionStore(url, prefix), sessions, metrics, **timeouts)
    return sync, sessions


def _served(sessions: SessionStore, steps: int, expires_at: float | None) -> None:
    state = sessions.get(S)
    state.steps, state.last_worker, state.last_prefill = steps, WorkerId("decode-0"), WorkerId("prefill-0")
    state.offer = SessionOffer(WorkerId("decode-0"), OFFER, expires_at)


def _value(metrics: RouterMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_record_written_by_one_router_is_merged_by_another_and_expires_with_ds_lease(redis_url, prefix):
    async def main() -> None:
        metrics = RouterMetrics([])
        writer, written = _sync(redis_url, prefix, metrics)
        reader, read = _sync(redis_url, prefix, metrics)
        lease = time.time() + 30
        _served(written, 3, lease)
        await writer.push(S)
        assert await reader.pull(S) is True
        state = read.get(S)
        assert (state.steps, state.last_worker, state.last_prefill) == (3, "decode-0", "prefill-0")
        assert state.offer == SessionOffer(WorkerId("decode-0"), OFFER, lease)
        assert await reader.pull(S) is False  # not newer than what it now knows
        assert _value(metrics, "kvpilot_router_session_store_restored_total") == 1
        ttl_ms = redis.Redis.from_url(redis_url).pttl(prefix + "session:" + S)
        assert 28_000 < ttl_ms <= 30_000  # D's lease, not store_ttl_s (60 s)
        await writer.close()
        await reader.close()

    asyncio.run(main())


def test_a_record_without_a_lease_lives_store_ttl_s_and_a_lapsed_lease_drops_the_offer(redis_url, prefix):
    async def main() -> None:
        metrics = RouterMetrics([])
        sync, sessions = _sync(redis_url, prefix, metrics, ttl_s=45.0)
        key = prefix + "session:" + S
        client = redis.Redis.from_url(redis_url)
        _served(sessions, 1, None)
        await sync.push(S)
        assert 43_000 < client.pttl(key) <= 45_000
        _served(sessions, 2, time.time() - 1)  # D's hold already over when written
        await sync.push(S)
        stored = SessionRecord.from_bytes(client.get(key))
        assert (stored.steps, stored.offer, stored.decode) == (2, None, "decode-0")
        assert 43_000 < client.pttl(key) <= 45_000
        await sync.close()

    asyncio.run(main())


def test_a_newer_local_view_is_kept_and_an_unknown_version_is_ignored():
    sessions = SessionStore(block_size=4, max_sessions=4)
    _served(sessions, 5, None)
    older = SessionRecord(RECORD_VERSION, 4, "decode-1", None, OfferRecord("decode-1", {}, None))
    assert merge(sessions.get(S), older) is False
    assert sessions.get(S).last_worker == "decode-0"
    alien = SessionRecord(RECORD_VERSION + 1, 9, "decode-1", None).to_bytes()
    with pytest.raises(ValueError, match="version"):
        SessionRecord.from_bytes(alien)
    with pytest.raises(ValueError, match="not a session record"):
        SessionRecord.from_bytes(b"\x00garbage")


def test_a_store_that_is_down_is_counted_and_never_raises(prefix):
    async def main() -> None:
        metrics = RouterMetrics([])
        dead = f"redis://127.0.0.1:{free_ports(1)[0]}/0"  # nothing listens there
        sync, sessions = _sync(dead, prefix, metrics)
        await sync.open()  # the router's start: counted, not raised
        _served(sessions, 1, None)
        assert await sync.pull(S) is False
        await sync.push(S)
        assert sessions.get(S).last_worker == "decode-0"  # the local view stands
        assert _value(metrics, "kvpilot_router_session_store_errors_total", op=StoreOp.READ.value) == 1
        assert _value(metrics, "kvpilot_router_session_store_errors_total", op=StoreOp.WRITE.value) == 1
        assert _value(metrics, "kvpilot_router_session_store_errors_total", op=StoreOp.CONNECT.value) == 1
        await sync.close()

    asyncio.run(main())


def test_open_connects_before_the_first_read(redis_url, prefix):
    """The router's start connects: the first session's read is then one round trip, not a
    connection and its handshake inside the 50 ms read timeout."""

    async def main() -> None:
        metrics = RouterMetrics([])
        sync, _ = _sync(redis_url, prefix, metrics)
        admin = redis.Redis.from_url(redis_url)
        before = len(admin.client_list())
        await sync.open()
        assert len(admin.client_list()) == before + 1
        assert _value(metrics, "kvpilot_router_session_store_errors_total", op=StoreOp.CONNECT.value) == 0
        await sync.close()
        admin.close()

    asyncio.run(main())


def test_a_store_that_does_not_answer_costs_a_step_its_timeouts_at_most(redis_url, prefix):
    async def main() -> None:
        metrics = RouterMetrics([])
        sync, sessions = _sync(redis_url, prefix, metrics, read_timeout_s=0.05, write_timeout_s=0.05)
        assert await sync.pull(S) is False  # connected and answering
        redis.Redis.from_url(redis_url).client_pause(1000)  # the server stops answering clients for 1 s
        _served(sessions, 1, None)
        started = time.perf_counter()
        assert await sync.pull(S) is False
        await sync.push(S)
        elapsed = time.perf_counter() - started
        assert elapsed < 0.5, elapsed
        for op in (StoreOp.READ, StoreOp.WRITE):
            assert _value(metrics, "kvpilot_router_session_store_errors_total", op=op.value) == 1
        await asyncio.sleep(1.0)
        await sync.close()

    asyncio.run(main())


def test_redis_needs_a_url():
    from kvpilot.policies.typed_config import convert

    with pytest.raises(ConfigError, match=r"sessions\.redis_url"):
        convert({"sessions": {"store": "redis"}}, RouterConfig)
    with pytest.raises(ConfigError, match=r"sessions\.store: must be one of 'memory', 'redis'"):
        convert({"sessions": {"store": "etcd"}}, RouterConfig)


def test_a_session_alternating_between_two_routers_is_served_as_one_router_would(model_dir: Path, redis_url, prefix):
    """Two replicas over one fleet share the session through Redis: each step after the
    first is priced as a session step (affinity: the last step's P and D again, which
    needs the last P), whichever replica served the step before; D's offer reaches the
    other replica too. (These fake engines publish no KV events: a replica that never
    saw the session has no chain of it, so the offer's reach is what the index says D
    holds, here nothing, and the pull option is unavailable to it.)"""
    from aiohttp.test_utils import TestClient, TestServer

    from kvpilot.routing.config_load import load_config
    from kvpilot.routing.fleet import fleet_from_config
    from kvpilot.routing.serve.app import build_server

    async def step(client: TestClient, tokens: int) -> str:
        body = {"prompt": PROMPT + [7] * tokens, "conversation_id": "agent", "max_tokens": 2}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        return resp.headers["X-KVPilot-Route"]

    async def scenario(client_a, router_a, engines):
        engines["decode-0"].session_offer = {**OFFER, "kvpilot_expires_at": time.time() + 300}
        cfg = load_config(model_dir / "router.yaml")  # the same config: a replica
        router_b = build_server(cfg, fleet_from_config(cfg), feed_index=False)
        async with TestClient(TestServer(router_b.app(), host="127.0.0.1")) as client_b:
            for n, client in enumerate((client_a, client_b, client_a, client_b)):
                assert await step(client, 4 * (n + 1)) == "remote_prefill"
            texts = [await (await c.get("/metrics")).text() for c in (client_a, client_b)]
        for text in texts:  # steps 2 and 4 on B, 3 on A
            assert 'kvpilot_router_session_store_errors_total{op="read"} 0.0' in text
        assert 'kvpilot_router_session_options_total{option="affinity"} 1.0' in texts[0]
        assert 'kvpilot_router_session_options_total{option="affinity"} 2.0' in texts[1]
        assert "kvpilot_router_session_store_restored_total 1.0" in texts[0]
        assert "kvpilot_router_session_store_restored_total 2.0" in texts[1]
        state = router_b.core.router.sessions.get(SessionId("agent"))
        assert (state.steps, state.offer is not None) == (4, True)

    sessions = {"force_option": "affinity", "store": "redis", "redis_url": redis_url, "store_key_prefix": prefix}
    run(model_dir, PD, scenario, disaggregation={"max_local_tokens": 0}, sessions=sessions)


def test_without_the_store_a_second_router_knows_nothing_of_the_session(model_dir: Path):
    """The control: the same alternation with the in-memory default; B's step is priced
    as a new request (no session option), so the test above can fail."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvpilot.routing.config_load import load_config
    from kvpilot.routing.fleet import fleet_from_config
    from kvpilot.routing.serve.app import build_server

    async def scenario(client_a, router_a, engines):
        cfg = load_config(model_dir / "router.yaml")
        router_b = build_server(cfg, fleet_from_config(cfg), feed_index=False)
        async with TestClient(TestServer(router_b.app(), host="127.0.0.1")) as client_b:
            for n, client in enumerate((client_a, client_b)):
                body = {"prompt": PROMPT + [7] * (4 * n + 4), "conversation_id": "agent", "max_tokens": 2}
                assert (await client.post("/v1/completions", json=body)).status == 200
            text = await (await client_b.get("/metrics")).text()
        assert 'kvpilot_router_session_options_total{option="affinity"} 0.0' in text

    run(model_dir, PD, scenario, disaggregation={"max_local_tokens": 0}, sessions={"force_option": "affinity"})


def test_a_router_whose_store_is_down_serves_every_step_and_counts_it(model_dir: Path):
    """``sessions.store: redis`` with nothing listening: each step is answered, routed on the
    router's own state (the later steps still priced as session steps), and every read and
    write is counted."""
    dead = f"redis://127.0.0.1:{free_ports(1)[0]}/0"

    async def scenario(client, router, engines):
        for n in range(3):
            body = {"prompt": PROMPT + [7] * (4 * n + 4), "conversation_id": "agent", "max_tokens": 2}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
        text = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_session_store_errors_total{op="read"} 3.0' in text
        assert 'kvpilot_router_session_store_errors_total{op="write"} 3.0' in text
        assert 'kvpilot_router_session_store_errors_total{op="connect"} 1.0' in text
        assert 'kvpilot_router_session_options_total{option="affinity"} 2.0' in text

    sessions = {"force_option": "affinity", "store": "redis", "redis_url": dead}
    run(model_dir, PD, scenario, disaggregation={"max_local_tokens": 0}, sessions=sessions)
