"""The router's added latency on the live CPU fleet.

Starts one co-located tiny engine behind the router and sends the same short
completions (``max_tokens=1``, a prompt already in the engine's prefix cache) both
directly to the engine and through the router, interleaved, ``--requests`` times
each. It reports medians and p90s of the two and their difference: the time the
router adds (tokenizing, hashing the prompt's blocks, the index lookup, the cost
function, one more HTTP hop). It does so once per index backend (kvpilot's
``BlockIndex``, then Dynamo's ``RadixTree``), each on a fresh fleet, so the two
are compared on the same live traffic.

    python -m benchmarks.bench_router_overhead
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.tiny_model import ensure_tiny_model
from kvpilot.routing.config import IndexBackend


def _timed(url: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    complete(url, prompt, max_tokens=1)
    return time.perf_counter() - started


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


def measure(backend: str, requests: int, tokens: int) -> tuple[list[float], list[float]]:
    """(direct, routed) latencies of ``requests`` interleaved pairs on a fresh one-engine fleet."""
    run_dir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-"))
    spec = FleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=run_dir,
        prefill=0,
        decode=0,
        colocated=1,
        engine_port=8910,
        side_channel_port=6910,
        events_port=7010,
        router_port=8900,
        index_backend=IndexBackend(backend),
    )
    started = fleet_io.up(spec, progress=lambda _: None)
    try:
        engine, router = started.engines[0].url, started.router.url
        prompt = [(i * 7919) % 2000 + 7 for i in range(tokens)]
        for url in (engine, router, engine, router):  # warm the cache and both paths
            complete(url, prompt, max_tokens=1)
        direct, routed = [], []
        for _ in range(requests):
            direct.append(_timed(engine, prompt))
            routed.append(_timed(router, prompt))
    finally:
        fleet_io.down(run_dir)
    return direct, routed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=1024)
    backends = [backend.value for backend in IndexBackend]
    parser.add_argument("--backends", nargs="+", choices=backends, default=backends)
    args = parser.parse_args()

    print(f"{args.requests} requests each, {args.tokens}-token cached prompt, max_tokens=1\n")
    print(
        "| index backend | direct p50 ms | routed p50 ms | router adds p50 ms | routed/direct p50 "
        "| direct p90 ms | routed p90 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends:
        direct, routed = measure(backend, args.requests, args.tokens)
        d50, r50 = statistics.median(direct), statistics.median(routed)
        print(
            f"| {backend} | {d50 * 1e3:.2f} | {r50 * 1e3:.2f} | {(r50 - d50) * 1e3:+.2f} | {r50 / d50:.2f}x | "
            f"{_p90(direct) * 1e3:.2f} | {_p90(routed) * 1e3:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
