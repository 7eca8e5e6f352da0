"""The latency the shared session store (``sessions.store: redis``) adds to a request.

A session's step costs the router one read of its record before routing
(:meth:`kvpilot.routing.state.sync.SessionSync.pull`: a Redis ``GET``, the msgpack decode, the
merge under the lock) and one write after it was served, before the answer returns
(:meth:`~kvpilot.routing.state.sync.SessionSync.push`: the record built, ``SET PX``). This starts
a ``redis-server`` on 127.0.0.1 (persistence off) and times ``--n`` writes and reads of
records with an offer of ``--blocks`` block ids, sequentially, on one event loop.

    python -m benchmarks.bench_session_store [--n 2000] [--blocks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from kvpilot.deploy.redis_server import running_redis
from kvpilot.routing.decide.sessions import SessionOffer, SessionStore
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.state.redis_store import RedisSessionStore
from kvpilot.routing.state.sync import SessionSync

PORT = 6391


def _ms(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=100)
    return f"p50 {statistics.median(xs) * 1e3:.3f} ms, p99 {q[98] * 1e3:.3f} ms"


async def measure(url: str, n: int, blocks: int) -> dict[str, list[float]]:
    local = SessionStore(block_size=32, max_sessions=n + 1)
    writer = SessionSync(
        RedisSessionStore(url, "bench:"),
        local,
        RouterMetrics([]),
        read_timeout_s=1.0,
        write_timeout_s=1.0,
        ttl_s=600.0,
    )
    reader_sessions = SessionStore(block_size=32, max_sessions=n + 1)
    reader = SessionSync(
        RedisSessionStore(url, "bench:"),
        reader_sessions,
        RouterMetrics([]),
        read_timeout_s=1.0,
        write_timeout_s=1.0,
        ttl_s=600.0,
    )
    params = {"do_remote_decode": True, "remote_block_ids": [list(range(blocks))], "remote_engine_id": "decode-0"}
    out: dict[str, list[float]] = {"read": [], "write": []}
    for i in range(n):
        key = SessionId(f"s{i}")
        state = local.get(key)
        state.steps, state.last_worker, state.last_prefill = 1, WorkerId("decode-0"), WorkerId("prefill-0")
        state.offer = SessionOffer(WorkerId("decode-0"), params, time.time() + 480)
        started = time.perf_counter()
        await writer.push(key)
        out["write"].append(time.perf_counter() - started)
        started = time.perf_counter()
        assert await reader.pull(key)
        out["read"].append(time.perf_counter() - started)
    await writer.close()
    await reader.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir, running_redis(PORT, Path(workdir)) as url:
        times = asyncio.run(measure(url, args.n, args.blocks))
    print(f"session store, {args.n} sessions, offer of {args.blocks} blocks, redis-server on 127.0.0.1:")
    print(f"  read before routing:                   {_ms(times['read'])}")
    print(f"  write after serving, before answering: {_ms(times['write'])}")
    total = [r + w for r, w in zip(times["read"], times["write"], strict=True)]
    print(f"  added per step (read + write):         {_ms(total)}")


if __name__ == "__main__":
    main()
