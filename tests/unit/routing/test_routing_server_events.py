"""Component test: vLLM's real ZmqEventPublisher -> the router's index feeder -> /debug/route.

Two co-located workers; the router binds both KV-event endpoints (the
publishers connect, as engines with a ``tcp://127.0.0.1:PORT`` endpoint do).
Only worker ``w2`` publishes the prompt's blocks, so the router must pick it.
Everything stays on 127.0.0.1; no engine is started.
"""

from __future__ import annotations

import asyncio
import re
import time

from aiohttp.test_utils import TestClient, TestServer

from kvpilot.routing.config import RouterConfig
from kvpilot.routing.core import RouterCore
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.serve.app import RouterServer
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.fakes.kv_events import vllm_batch, vllm_block_stored, vllm_kv_events, vllm_publisher
from tests.fakes.ports import free_ports

vllm_kv_events()  # its publisher: this module is skipped without vLLM

BS = 4
PROMPT = list(range(1000, 1040))  # 10 blocks


def _config(model_dir, ports: list[int]) -> RouterConfig:
    from kvpilot.routing.config import IndexConfig, Role, ServerConfig, Worker
    from kvpilot.routing.ids import WorkerId

    workers = tuple(
        Worker(
            WorkerId(name),
            Role.COLOCATED,
            "http://127.0.0.1:9",  # never called: /debug/route sends nothing
            kv_events_endpoint=f"tcp://127.0.0.1:{ports[2 * i]}",
            replay_endpoint=f"tcp://127.0.0.1:{ports[2 * i + 1]}",
        )
        for i, name in enumerate(("w1", "w2"))
    )
    server = ServerConfig(model_dir=str(model_dir), max_model_len=4096)  # no engine answers /v1/models here
    return RouterConfig(index=IndexConfig(block_size=BS), server=server, workers=workers)


def _batch(blocks: int) -> object:
    return vllm_batch(
        [
            vllm_block_stored(f"w2-{i}".encode(), f"w2-{i - 1}".encode() if i else None, PROMPT[i * BS : (i + 1) * BS])
            for i in range(blocks)
        ]
    )


def test_debug_route_picks_the_worker_that_published_the_blocks(model_dir):
    ports = free_ports(4)
    cfg = _config(model_dir, ports)
    server = RouterServer(RouterCore(cfg, fleet_from_config(cfg), EnginePrompt(PromptTokenizer(model_dir), None)))

    async def main() -> None:
        async with TestClient(TestServer(server.app(), host="127.0.0.1")) as client:
            assert server.core.feeder is not None and len(server.core.feeder.subscribers) == 2
            publisher = vllm_publisher(cfg.workers[1].kv_events_endpoint, cfg.workers[1].replay_endpoint)
            try:
                publisher.publish(_batch(7))  # may be lost before the connection is up: replay recovers it
                info: dict = {}
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    publisher.publish(vllm_batch([]))
                    await asyncio.sleep(0.2)
                    info = await (await client.post("/debug/route", json={"prompt": PROMPT})).json()
                    if info["cached_blocks"]:
                        break
                assert info["decode_worker"] == "w2", info
                assert info["cached_blocks"] == 7 and info["overlap"] == {"w2": {"GPU": 7}}
                metrics = await (await client.get("/metrics")).text()
                assert 'kvpilot_router_index_blocks{tier="GPU",worker="w2"} 7.0' in metrics
                batches = re.search(r'^kvpilot_router_kv_event_batches_total\{worker="w2"\} (\S+)$', metrics, re.M)
                assert batches is not None and float(batches.group(1)) >= 1  # a series exists from the start at 0
            finally:
                publisher.shutdown()
        assert server.core.feeder.subscribers == ()  # stopped and closed at cleanup

    asyncio.run(main())
