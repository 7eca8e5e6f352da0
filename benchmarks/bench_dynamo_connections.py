"""Why kvpilot's router opens a fresh connection per request to Dynamo's frontend.

Dynamo 1.6.1's frontend leaves Nagle on its client sockets (dynamo#14643). On a
kept-alive connection, a request sent soon after the previous one finished gets its
first token late: the frontend writes the response headers, then the first token as a
second small write, which Nagle holds until the client ACKs the headers, and the
client's delayed ACK waits ~40 ms. A fresh connection ACKs at once (TCP quick-ACK at a
connection's start).

On a 2-worker ``dynamo.mocker`` fleet (``kvpilot.deploy.dynamo_fleet``, the launcher of ``kvpilot
fleet up --dynamo``), this sends ``--requests`` short streamed completions back to back,
each with a fresh random prompt, four ways, one after the other: straight to the
frontend (direct mode, naming a worker) over a kept-alive and over fresh connections,
and through kvpilot's router over a kept-alive and over fresh connections. It prints
each way's TTFT median and p90.

    python -m benchmarks.bench_dynamo_connections
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from kvpilot.deploy import dynamo_fleet
from kvpilot.deploy.dynamo_spec import DynamoFleetSpec
from kvpilot.deploy.fleet import down
from kvpilot.deploy.tiny_model import ensure_tiny_model
from kvpilot.routing.serve.dynamo_upstream import WORKER_INSTANCE_HEADER

PORTS = {"worker_port": 26000, "port_stride": 100, "frontend_port": 26990, "router_port": 26980}
"""This benchmark's ports (26000-26399, 26980 and 26990: no test or other benchmark uses them)."""


async def _ttfts(url: str, headers: dict[str, str], fresh: bool, requests: int, tokens: int) -> list[float]:
    rng = random.Random(7)
    connector = aiohttp.TCPConnector(force_close=fresh)
    out: list[float] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        for _ in range(requests):
            prompt = [rng.randrange(7, 2048) for _ in range(tokens)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True}
            sent = time.perf_counter()
            first = None
            async with http.post(f"{url}/v1/completions", data=json.dumps(body), headers=headers) as response:
                response.raise_for_status()
                async for _chunk in response.content.iter_any():
                    first = first or time.perf_counter() - sent
            assert first is not None
            out.append(first)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    args = parser.parse_args()
    spec = DynamoFleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=Path(tempfile.mkdtemp(prefix="kvpilot-bench-connections-")),
        workers=2,
        **PORTS,  # type: ignore[arg-type]
    )
    fleet = dynamo_fleet.up(spec, timeout=300)
    try:
        instance = dynamo_fleet.generate_instances(spec.discovery_dir)[0]
        json_type = {"Content-Type": "application/json"}
        ways = {
            "frontend, kept-alive": (spec.frontend_url, {**json_type, WORKER_INSTANCE_HEADER: str(instance)}, False),
            "frontend, fresh": (spec.frontend_url, {**json_type, WORKER_INSTANCE_HEADER: str(instance)}, True),
            "router, kept-alive": (fleet.router.url, json_type, False),
            "router, fresh": (fleet.router.url, json_type, True),
        }
        print(f"{args.requests} back-to-back streamed requests of {args.prompt_tokens} tokens each way; TTFT ms")
        for way, (url, headers, fresh) in ways.items():
            ttfts = asyncio.run(_ttfts(url, headers, fresh, args.requests, args.prompt_tokens))
            p90 = statistics.quantiles(ttfts, n=10)[-1]
            print(f"  {way:20s} median {statistics.median(ttfts) * 1e3:6.1f}   p90 {p90 * 1e3:6.1f}")
    finally:
        down(spec.run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
