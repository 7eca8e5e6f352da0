"""What two router replicas lose by not sharing in-flight load, measured on the real
router over fake engines (:mod:`tests.fakes.engine`).

Each replica's load ledger counts only the requests it dispatched. A hot prefix that one
worker caches pulls requests to that worker until its load outweighs the prefix credit;
a replica that sees half the load lets twice as many through. Here four co-located
workers, ``co-0`` holding a 24-block prefix in both replicas' indexes, get 32 concurrent
requests of that prefix plus a distinct 2-block suffix, each held 1 s by the engine:
once through one router, once split 16 / 16 over two. The test prints both spreads
(``-s``) and asserts the direction: the replicas send more to ``co-0``.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp.test_utils import TestClient, TestServer

from kvpilot.routing.config_load import load_config
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.events import BlockStored
from kvpilot.routing.serve.app import RouterServer, build_server
from tests.fakes.engine import PROMPT_WORDS as WORDS
from tests.unit.routing.test_routing_server import BS, run

CO = {f"co-{i}": "colocated" for i in range(4)}
PREFIX = [(i * 7) % len(WORDS) for i in range(24 * BS)]
REQUESTS = 32


def _cache_prefix(router: RouterServer) -> None:
    hashes = [f"hot{i}".encode() for i in range(24)]
    router.core.index.apply(WorkerId("co-0"), BlockStored(hashes, None, PREFIX, BS, medium="GPU"))


def _prompt(n: int) -> list[int]:
    return PREFIX + [(n // len(WORDS)) % len(WORDS), n % len(WORDS)] + [1] * (2 * BS - 2)


async def _burst(clients: list[TestClient], first: int) -> Counter[str]:
    async def one(n: int) -> str:
        client = clients[n % len(clients)]  # client-side round robin
        resp = await client.post("/v1/completions", json={"prompt": _prompt(first + n), "max_tokens": 1})
        assert resp.status == 200, await resp.text()
        return resp.headers["X-KVPilot-Decode-Worker"]

    return Counter(await asyncio.gather(*(one(n) for n in range(REQUESTS))))


def test_two_replicas_without_shared_in_flight_load_overload_the_hot_prefix_worker(model_dir):
    spreads: dict[str, Counter[str]] = {}

    async def scenario(client_a, router_a, engines):
        for engine in engines.values():
            engine.delay_s = 1.0
        cfg = load_config(model_dir / "router.yaml")
        router_b = build_server(cfg, fleet_from_config(cfg), feed_index=False)
        async with TestClient(TestServer(router_b.app(), host="127.0.0.1")) as client_b:
            for router in (router_a, router_b):
                _cache_prefix(router)
            spreads["one router"] = await _burst([client_a], 0)
            spreads["two replicas"] = await _burst([client_a, client_b], REQUESTS)

    run(model_dir, CO, scenario, server_extra={"engine_metrics_interval_s": 0})
    print(f"replica load: {REQUESTS} concurrent requests on a prefix co-0 caches: {dict(spreads)}")
    one, two = spreads["one router"], spreads["two replicas"]
    assert sum(one.values()) == sum(two.values()) == REQUESTS
    assert two["co-0"] > one["co-0"]
