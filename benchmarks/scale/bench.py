"""Scale benchmark (issue 19, part 4): kvpilot's router beside Dynamo's frontend KV
router on the same Dynamo mocker fleet, at 16, 64 and 256 workers.

Per worker count, one fleet (:func:`kvpilot.deploy.dynamo_fleet.up_one_process`): every worker
in ONE ``dynamo.mocker`` process (``--num-workers``; one process per worker does not fit
256 on this box), Dynamo's frontend in direct mode, a second frontend running Dynamo's
KV router (``--router-mode kv``, defaults) on the same workers, and kvpilot's router in
front of the direct frontend (the fleet of ``kvpilot fleet up --dynamo``). Then:

1. Warm: every worker is sent ``--warm-prompts`` distinct prompts of ``--prompt-tokens``
   tokens straight through the direct frontend (``x-worker-instance-id``), so that both
   routers' indexes hold ``workers x warm-prompts x prompt-tokens / 32`` (block, worker)
   entries from the workers' own KV events.
2. Decision time: ``--decisions`` requests one at a time through each router, each a
   warm prompt of a random worker plus 64 new tokens. kvpilot: its
   ``kvpilot_router_decision_seconds`` histogram (the decision alone: chain, index match,
   every candidate's cost; :mod:`kvpilot.routing.metrics.router_metrics`). Dynamo: its frontend's
   ``dynamo_router_overhead_total_ms`` (block hashing, ``find_matches``, scheduling, as
   Dynamo itself times them). Both are Prometheus histograms: mean exact (sum / count),
   p50 and p99 interpolated inside the bucket that holds them (Dynamo's buckets grow by
   3x: 0.09, 0.27, 0.81 ms), each with its bucket's bounds.
3. Added latency against the request rate: at each rate of ``--rates``, ``--per-rate``
   requests at even spacing (open loop), each a warm prompt plus new tokens, sent each
   way one after another: straight to the worker holding it (direct frontend,
   ``x-worker-instance-id``: the baseline), through kvpilot's router, through Envoy with
   its Python picker, through a second Envoy deciding with the compiled picker
   (``routing/native``, its own index from the workers' KV events), through Dynamo's
   KV frontend. Every request asks for ONE token, not streamed: its latency is its TTFT.
   (Streamed, Dynamo 1.6.1's frontend held the first chunk of a one-token answer
   ~40 ms before an aiohttp client read it, measured here: 43.9 ms streamed against
   1.3 ms not streamed, the same request straight to a worker; a TCP write-and-ACK
   stall, not routing, that would swamp the milliseconds measured here.) Added latency
   = a way's latency p50 minus the baseline's at the same rate. An arm is out once its added p50 passes
   ``--limit-ms`` (5) or a request fails; its sustained rate is the highest rate before.
4. Where kvpilot's router spends its CPU at the last rate it was run at: a py-spy profile
   (``--profile-s`` seconds, its top entries by own time), when py-spy is installed.

Index memory per (block, worker) entry (:mod:`scale_memory`, one process per backend,
shape and way of measuring), against Dynamo's figure (dynamo#11225: about 17 B at its
floor, 31 B in RSS).

    python -m benchmarks.bench_router_scale --workers 16,64,256 --json /tmp/kvpilot-bench-scale.json
    python -m benchmarks.bench_router_scale --workers 256 --backend dynamo --memory-blocks 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.agent.output import finite
from benchmarks.provenance import ROOT, describe, provenance, recorded_argv
from benchmarks.scale.results import histogram_delta
from kvpilot.deploy import dynamo_fleet
from kvpilot.deploy.dynamo_spec import DynamoFleetSpec
from kvpilot.deploy.fleet import Fleet, down, start_gateway, stop_group
from kvpilot.deploy.fleet_spec import HOST
from kvpilot.deploy.metrics import Samples, parse, scrape
from kvpilot.deploy.tiny_model import TINY_MODEL_SPEC, ensure_tiny_model
from kvpilot.routing import native
from kvpilot.routing.config import IndexBackend

PORTS = {"worker_port": 28000, "port_stride": 500, "frontend_port": 27990, "router_port": 27980}
"""This benchmark's ports: the mocker 28000-29499 (its request plane, its workers' KV
events from 28500, its system server 29000), the frontends 27990 and KV_FRONTEND_PORT,
the router 27980 (no e2e test or other benchmark uses 27980-29499)."""
KV_FRONTEND_PORT = 27991
KVPILOT_DECISION = "kvpilot_router_decision_seconds"
NATIVE_DECISION = native.ENVOY_STATS_PREFIX + native.DECISION_HISTOGRAM
"""The compiled picker's own decision time (microseconds), in its Envoy's stats."""
ENVOY_STATS_FLUSH_S = 6.0
"""Longer than Envoy's stats flush (5 s), after which its histograms hold every worker's values."""
ARMS = ("kvpilot", "kvpilot_envoy", "kvpilot_native", "dynamo_kv")
"""The rate sweep's ways through a router: kvpilot's router relaying, Envoy with kvpilot's
picker (the fleet's client URL), a second Envoy deciding with the compiled picker
(:data:`NATIVE_GATEWAY_PORT`), Dynamo's KV frontend."""
NATIVE_GATEWAY_PORT = 27970
"""The compiled picker's Envoy, beside the fleet's own; its admin port is the next (no e2e test
or other benchmark uses them)."""
DYNAMO_DECISION = "dynamo_router_overhead_total_ms"
BLOCK_SIZE = 32
NEW_TOKENS = 64
JSON_HEADERS = {"Content-Type": "application/json"}


def envoy_stats(admin_url: str) -> Samples:
    """Envoy's stats (its admin ``/stats/prometheus``)."""
    with urllib.request.urlopen(f"{admin_url}/stats/prometheus", timeout=30) as resp:
        return parse(resp.read().decode())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the workload -----------------------------------------------------------


@dataclass(frozen=True)
class Warm:
    """A prompt a worker holds: its instance id and tokens."""

    instance: int
    tokens: list[int]


def warm_prompts(instances: list[int], per_worker: int, tokens: int, seed: int) -> list[Warm]:
    rng = random.Random(seed)
    vocab = TINY_MODEL_SPEC.vocab_size
    return [Warm(i, [rng.randrange(7, vocab) for _ in range(tokens)]) for i in instances for _ in range(per_worker)]


def extended(warm: Warm, rng: random.Random) -> list[int]:
    """``warm``'s prompt plus :data:`NEW_TOKENS` new ones: a partly cached request."""
    return warm.tokens + [rng.randrange(7, TINY_MODEL_SPEC.vocab_size) for _ in range(NEW_TOKENS)]


def body(prompt: list[int]) -> bytes:
    """A completion of one token, not streamed (see the module doc)."""
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0}).encode()


@dataclass(frozen=True)
class Answer:
    """One completion's seconds to its answer, the router's decode worker header (where it
    sets one) and the cached prompt tokens the serving worker reports."""

    latency_s: float
    worker: str | None
    cached_tokens: int


async def one(http: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str]) -> Answer:
    """One completion of one token; raises on a failure."""
    started = time.perf_counter()
    async with http.post(f"{url}/v1/completions", data=data, headers={**JSON_HEADERS, **headers}) as resp:
        payload = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {payload[:200]!r}")
        answer = json.loads(payload)
        if not answer.get("choices"):
            raise RuntimeError("no choice in the answer")
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        return Answer(time.perf_counter() - started, resp.headers.get("X-KVPilot-Decode-Worker"), cached)


async def warm_up(frontend: str, prompts: list[Warm], concurrency: int = 16) -> None:
    """Send every warm prompt to its worker through the direct frontend."""
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as http:

        async def send(w: Warm) -> None:
            async with limit:
                await one(http, frontend, body(w.tokens), {"x-worker-instance-id": str(w.instance)})

        await asyncio.gather(*(send(w) for w in prompts))


async def sequential(url: str, requests: list[tuple[bytes, str]]) -> list[Answer]:
    """Each request alone, one after another."""
    async with aiohttp.ClientSession() as http:
        return [await one(http, url, data, {}) for data, _ in requests]


async def at_rate(url: str, requests: list[tuple[bytes, dict[str, str]]], rate: float) -> dict[str, Any]:
    """``requests`` at ``rate`` per second, evenly spaced, open loop: latency p50 / p99,
    failures and the rate achieved (completed over first send to last first token)."""
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        t0 = time.perf_counter()

        async def timed(k: int, data: bytes, headers: dict[str, str]) -> tuple[float, float] | str:
            await asyncio.sleep(max(0.0, k / rate - (time.perf_counter() - t0)))
            try:
                latency = (await one(http, url, data, headers)).latency_s
            except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                return f"{type(exc).__name__}: {exc}"
            return latency, time.perf_counter() - t0

        results = await asyncio.gather(*(timed(k, d, h) for k, (d, h) in enumerate(requests)))
    ok = [r for r in results if isinstance(r, tuple)]
    errors = [r for r in results if isinstance(r, str)]
    latencies = sorted(t for t, _ in ok)
    span = max((end for _, end in ok), default=0.0)
    return {
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:3],
        "latency_p50_s": statistics.median(latencies) if latencies else float("nan"),
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan"),
        "achieved_rps": len(ok) / span if span else 0.0,
    }


# ---- one fleet --------------------------------------------------------------


IDLE_FRAMES = ("select (selectors.py", "Poller.poll (", "wait (threading.py")
"""Innermost frames of a thread waiting (the event loop's selector, the KV-event thread's
ZMQ poll, a lock or queue wait): idle, not work."""


def profile(pid: int, seconds: float, out: Path) -> dict[str, Any]:
    """py-spy's record of ``pid`` for ``seconds`` (raw stacks, every thread), summarized:
    the share of samples in which a thread waits (:data:`IDLE_FRAMES`) and, of the
    others, each innermost function's share (own time), top 12, and each kvpilot function's
    share with what it calls (inclusive), top 12."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {"error": "py-spy is not installed"}
    cmd = [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200"]
    cmd += ["--format", "raw", "--output", str(out), "--nonblocking"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if proc.returncode != 0 or not out.exists():
        return {"error": proc.stderr[-500:]}
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    idle = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if any(f in frames[-1] for f in IDLE_FRAMES):
            idle += int(count)
            continue
        own[frames[-1]] += int(count)
        # a function, not a line; not the entry point, which is in every stack
        for frame in {f.split(":")[0] + ")" for f in frames if "(routing/" in f and "(routing/cli.py" not in f}:
            inclusive[frame] += int(count)
    busy = sum(own.values())
    return {
        "samples": busy + idle,
        "idle_share": idle / (busy + idle) if busy + idle else float("nan"),
        "top_own_of_busy": [(frame, n / busy) for frame, n in own.most_common(12)] if busy else [],
        "top_kvpilot_inclusive_of_busy": [(f, n / busy) for f, n in inclusive.most_common(12)] if busy else [],
    }


def _start_native_gateway(spec: DynamoFleetSpec, router: str) -> tuple[subprocess.Popen[bytes], str] | None:
    """A second Envoy in front of the direct frontend, deciding with the compiled picker (its
    index fed by the workers' KV events from now on: it replays nothing, so it starts before
    the warm-up); None when the fleet has no Envoy."""
    if spec.gateway is None:
        return None
    ports = replace(spec.gateway, gateway_port=NATIVE_GATEWAY_PORT, admin_port=NATIVE_GATEWAY_PORT + 1)
    gateway = dynamo_fleet.with_native_picker(spec, ports, router)
    run_dir = spec.run_dir / "native-gateway"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    proc, _ = start_gateway(gateway, run_dir, time.monotonic() + 120, lambda m: log(m.strip()))
    return proc, f"http://{HOST}:{gateway.gateway_port}"


def run_fleet(n: int, base: DynamoFleetSpec, args: argparse.Namespace) -> dict[str, Any]:
    spec = replace(base, workers=n, run_dir=base.run_dir / f"w{n}")
    log(f"{n} workers: starting")
    started = time.perf_counter()
    fleet = dynamo_fleet.up_one_process(
        spec,
        kv_frontend_port=KV_FRONTEND_PORT,
        router_overrides={"index": {"backend": args.backend}},
        timeout=600,
        progress=lambda m: log(m.strip()),
    )
    try:
        native = _start_native_gateway(spec, fleet.router.url)  # before the warm-up: its index hears it
        try:
            return measure(spec, fleet, n, args, time.perf_counter() - started, native)
        finally:
            if native is not None:
                stop_group(native[0].pid)
    finally:
        down(spec.run_dir)


def measure(
    spec: DynamoFleetSpec,
    fleet: Fleet,
    n: int,
    args: argparse.Namespace,
    up_s: float,
    native: tuple[subprocess.Popen[bytes], str] | None,
) -> dict[str, Any]:
    direct, router, kv = spec.frontend_url, fleet.router.url, f"http://{HOST}:{KV_FRONTEND_PORT}"
    instances = dynamo_fleet.generate_instances(spec.discovery_dir)
    rng = random.Random(args.seed + n)
    warm = warm_prompts(instances, args.warm_prompts, args.prompt_tokens, args.seed + n)
    t = time.perf_counter()
    asyncio.run(warm_up(direct, warm))
    time.sleep(2.0)  # the last prompts' KV events reach both indexes
    entries = len(warm) * (args.prompt_tokens // BLOCK_SIZE)
    log(f"  warmed {len(warm)} prompts ({entries} (block, worker) entries) in {time.perf_counter() - t:.1f} s")
    out: dict[str, Any] = {"workers": n, "fleet_up_s": up_s, "warm_entries": entries}

    # 2. decision time, one request at a time
    picks = [rng.choice(warm) for _ in range(args.decisions)]
    reqs = [(body(extended(w, rng)), f"decode-{w.instance:x}") for w in picks]
    before_k, before_d = scrape(router), scrape(kv)
    by_k = asyncio.run(sequential(router, reqs))
    by_d = asyncio.run(sequential(kv, reqs))
    after_k, after_d = scrape(router), scrape(kv)
    out["decision"] = {
        "kvpilot": histogram_delta(after_k, before_k, KVPILOT_DECISION),
        "dynamo_kv": histogram_delta(after_d, before_d, DYNAMO_DECISION, scale=1e-3),
    }
    by_n = []
    if native is not None:
        admin = f"http://{HOST}:{NATIVE_GATEWAY_PORT + 1}"
        before_n = envoy_stats(admin)
        by_n = asyncio.run(sequential(native[1], reqs))
        time.sleep(ENVOY_STATS_FLUSH_S)  # Envoy merges its workers' histograms at each stats flush
        out["decision"]["kvpilot_native"] = histogram_delta(envoy_stats(admin), before_n, NATIVE_DECISION, scale=1e-6)
    chosen = [a.worker for a in by_k]
    out["decision"]["kvpilot"]["chose_holder"] = sum(c == h for c, (_, h) in zip(chosen, reqs, strict=True)) / len(reqs)
    if by_n:  # no header of the module's own: the holder alone caches the warm prompt
        held = args.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
        out["native_chose_holder"] = sum(a.cached_tokens >= held for a in by_n) / len(by_n)
        log(f"  the compiled picker chose the prompt's holder in {out['native_chose_holder']:.0%}")
    out["sequential_latency_p50_s"] = {
        "kvpilot": statistics.median(a.latency_s for a in by_k),
        "dynamo_kv": statistics.median(a.latency_s for a in by_d),
        **({"kvpilot_native": statistics.median(a.latency_s for a in by_n)} if by_n else {}),
    }
    out["index_blocks_kvpilot"] = sum(v for (name, _), v in after_k.items() if name == "kvpilot_router_index_blocks")
    for key, d in out["decision"].items():
        log(
            f"  decision {key}: mean {d['mean_s'] * 1e3:.3f} ms, p50 {d['p50_s'] * 1e3:.3f} ms, "
            f"p99 {d['p99_s'] * 1e3:.3f} ms ({d['count']:.0f})"
        )
    log(f"  kvpilot chose the prompt's holder in {out['decision']['kvpilot']['chose_holder']:.0%}")

    # 3. the rate sweep
    sweep: list[dict[str, Any]] = []
    alive = {
        "kvpilot": router,
        **({"kvpilot_envoy": fleet.client_url} if fleet.gateway else {}),
        **({"kvpilot_native": native[1]} if native is not None else {}),
        "dynamo_kv": kv,
    }
    sustained: dict[str, float] = {}
    last_rate = 0.0
    for rate in args.rates:
        if not alive:
            break
        picks = [rng.choice(warm) for _ in range(args.per_rate)]
        prompts = [(body(extended(w, rng)), w.instance) for w in picks]
        row: dict[str, Any] = {"rate": rate}
        row["direct"] = asyncio.run(at_rate(direct, [(d, {"x-worker-instance-id": str(i)}) for d, i in prompts], rate))
        base = row["direct"]["latency_p50_s"]
        for key, url in list(alive.items()):
            # the same prompts again would be cached to the last token: new ones, same shape
            fresh: list[tuple[bytes, dict[str, str]]] = [(body(extended(w, rng)), {}) for w in picks]
            res = asyncio.run(at_rate(url, fresh, rate))
            res["added_p50_s"] = res["latency_p50_s"] - base
            res["added_p99_s"] = res["latency_p99_s"] - row["direct"]["latency_p99_s"]
            row[key] = res
            if res["failed"] or not res["added_p50_s"] <= args.limit_ms / 1e3:
                del alive[key]
            else:
                sustained[key] = rate
        last_rate = rate
        log(
            f"  rate {rate:g}/s: direct p50 {base * 1e3:.2f} ms (achieved {row['direct']['achieved_rps']:.0f}/s); "
            + "; ".join(
                f"{k} +{row[k]['added_p50_s'] * 1e3:.2f} ms p50, +{row[k]['added_p99_s'] * 1e3:.2f} ms p99, "
                f"{row[k]['failed']} failed, achieved {row[k]['achieved_rps']:.0f}/s"
                for k in ARMS
                if k in row
            )
        )
        sweep.append(row)
    out["sweep"] = sweep
    out["sustained_rps"] = {k: sustained.get(k, 0.0) for k in ARMS}

    # 4. where the router's CPU goes, at the last rate swept
    if args.profile_s > 0 and last_rate:
        picks = [rng.choice(warm) for _ in range(int(last_rate * args.profile_s))]
        fresh = [(body(extended(w, rng)), dict[str, str]()) for w in picks]
        raw = spec.run_dir / "router-profile.txt"
        with ThreadedProfile(fleet.router.pid, args.profile_s, raw) as prof:
            asyncio.run(at_rate(router, fresh, last_rate))
        out["router_profile"] = {"rate": last_rate, **prof.result}
        log(f"  profile: {out['router_profile'].get('idle_share', float('nan')):.0%} of samples idle; of the rest:")
        for frame, share in out["router_profile"].get("top_own_of_busy", [])[:8]:
            log(f"  profile own {share:6.1%} {frame}")
        for frame, share in out["router_profile"].get("top_kvpilot_inclusive_of_busy", [])[:8]:
            log(f"  profile inclusive {share:6.1%} {frame}")
    return out


class ThreadedProfile:
    """Runs :func:`profile` on a thread for the duration of a ``with`` block."""

    def __init__(self, pid: int, seconds: float, out: Path) -> None:
        self.result: dict[str, Any] = {}
        self._thread = threading.Thread(target=lambda: self.result.update(profile(pid, seconds, out)), daemon=True)

    def __enter__(self) -> ThreadedProfile:
        self._thread.start()
        time.sleep(0.5)  # py-spy attaches
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()


# ---- index memory -----------------------------------------------------------


def index_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    log("index memory per (block, worker) entry")
    rows = []
    for backend in (*(b.value for b in IndexBackend), "radix-tree"):
        for shape in ("distinct", "shared"):
            for how in ("rss", "tracemalloc"):
                cmd = [sys.executable, "-m", "benchmarks.scale.memory", "--backend", backend, "--shape", shape]
                cmd += ["--measure", how, "--workers", str(args.memory_workers), "--blocks", str(args.memory_blocks)]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, timeout=600)
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                log(f"  memory {backend} {shape} {how}: {r['bytes_per_entry']:.1f} B per entry ({r['entries']})")
    return rows


# ---- output -----------------------------------------------------------------


def ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def tables(results: list[dict[str, Any]], memory: list[dict[str, Any]], limit_ms: float) -> str:
    lines = [
        (
            "| workers | entries | kvpilot decision mean / p50 / p99 ms "
            "| kvpilot compiled decision mean / p50 / p99 ms | Dynamo KV decision mean / p50 / p99 ms "
            "| kvpilot sustained req/s | kvpilot via Envoy sustained req/s "
            "| kvpilot compiled in Envoy sustained req/s | Dynamo KV sustained req/s |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def times(d: dict[str, Any] | None) -> str:
        return "-" if d is None else f"{ms(d['mean_s'])} / {ms(d['p50_s'])} / {ms(d['p99_s'])}"

    for r in results:
        decision = r["decision"]
        lines.append(
            f"| {r['workers']} | {r['warm_entries']} | {times(decision['kvpilot'])} "
            f"| {times(decision.get('kvpilot_native'))} | {times(decision['dynamo_kv'])} "
            + "".join(f"| {r['sustained_rps'].get(arm, 0.0):g} " for arm in ARMS)
            + "|"
        )
    lines += ["", f"Added latency (one token: TTFT) p50 / p99 ms over direct (limit {limit_ms:g} ms on p50):", ""]
    lines += [
        (
            "| workers | rate req/s | direct p50 ms | kvpilot added | kvpilot via Envoy added "
            "| kvpilot compiled in Envoy added | Dynamo KV added |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for row in r["sweep"]:
            cells = []
            for key in ARMS:
                a = row.get(key)
                cells.append(
                    "-"
                    if a is None
                    else f"{ms(a['added_p50_s'])} / {ms(a['added_p99_s'])}"
                    + (f" ({a['failed']} failed)" if a["failed"] else "")
                )
            lines.append(
                f"| {r['workers']} | {row['rate']:g} | {ms(row['direct']['latency_p50_s'])} | "
                + " | ".join(cells)
                + " |"
            )
    lines += ["", "| index backend | shape | measure | entries | B per entry |", "|---|---|---|---:|---:|"]
    lines += [
        f"| {m['backend']} | {m['shape']} | {m['measure']} | {m['entries']} | {m['bytes_per_entry']:.1f} |"
        for m in memory
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64,256", help="comma-separated worker counts ('': none)")
    parser.add_argument("--speedup", type=float, default=1000.0, help="the mockers' --speedup-ratio")
    parser.add_argument("--backend", choices=[b.value for b in IndexBackend], default=IndexBackend.KVPILOT.value)
    parser.add_argument("--warm-prompts", type=int, default=4, help="prompts per worker before measuring")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decisions", type=int, default=200)
    parser.add_argument("--rates", default="25,50,100,200,400,800", help="comma-separated request rates")
    parser.add_argument("--per-rate", type=int, default=150, help="requests per arm and rate")
    parser.add_argument("--limit-ms", type=float, default=5.0)
    parser.add_argument("--profile-s", type=float, default=8.0, help="py-spy seconds (0: no profile)")
    parser.add_argument("--memory-workers", type=int, default=64)
    parser.add_argument("--memory-blocks", type=int, default=8192, help="blocks per worker (x32; 0: no memory runs)")
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-bench-scale.json"))
    parser.add_argument("--seed", type=int, default=20261201)
    args = parser.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",") if w]
    args.rates = [float(r) for r in args.rates.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = DynamoFleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=Path(tempfile.mkdtemp(prefix="kvpilot-bench-scale-")),
        workers=1,
        block_size=BLOCK_SIZE,
        speedup_ratio=args.speedup,
        **PORTS,  # type: ignore[arg-type]
    )
    memory = index_memory(args) if args.memory_blocks else []
    results = [run_fleet(n, base, args) for n in args.workers]
    run = provenance()
    out = {
        "fleets": results,
        "index_memory": memory,
        "run": {"argv": recorded_argv(), "speedup": args.speedup, "limit_ms": args.limit_ms},
        "provenance": run,
    }
    args.json.write_text(json.dumps(finite(out), indent=2))
    print()
    print(describe(run))
    print(tables(results, memory, args.limit_ms))
    print(f"\nJSON: {args.json}")
    return 0
