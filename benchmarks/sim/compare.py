"""The simulator against Dynamo's own offline replay on the same trace and engine parameters
(Dynamo 1.6.1: ``dynamo.replay.run_trace_replay``), two ways: round robin on both sides (the
engine model), and kvpilot's router (``cost.objective: blocks``, Dynamo's weights, kvpilot's
session terms off: :data:`DYNAMO_WEIGHTS`) against
Dynamo's KV router (the router). Both routers break ties among equally cheap workers at
random, and where sessions meet idle workers one draw decides a session's whole run, so the
routers are compared on their means over ``--repeats`` runs: Dynamo's replay that many times,
kvpilot's router with that many seeds (``cost.router_seed`` 0, 1, ...). Mean and p99 TTFT,
mean inter-token latency and prefix reuse, with their ratios. ``--host-blocks`` gives every
worker the mocker's host (G2) tier on both sides (with ``--num-gpu-blocks`` small enough that
the GPU evicts, so the host's hits matter); reuse then counts GPU and host hits, and each side's
host-reused tokens are reported beside it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from benchmarks.fleet.trace import load_trace
from benchmarks.provenance import describe, provenance, recorded_argv
from benchmarks.sim.engine import EngineSpec
from benchmarks.sim.fleet import DEFAULT_SPEC, INSTANT, KvTransfer, Placement, Pools, RoundRobin, percentile, simulate
from benchmarks.sim.kvpilot import KvpilotPlacement

KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "reuse")
DYNAMO_WEIGHTS = {"session_affinity_credit": 0.0, "session_residency_weight": 0.0, "session_stays_unless_sooner": False}
"""kvpilot's cost with its own session terms off: Dynamo's KV router's cost, term for term."""
REPEATS = 3
"""Runs of each router per row (round robin draws nothing: one run each)."""
RouterMode = Literal["round_robin", "kv_router"]
MODES: tuple[RouterMode, ...] = ("round_robin", "kv_router")


def replay_rows(
    trace: Path,
    workers: int,
    block_size: int,
    mode: RouterMode,
    arrival_speedup: float = 1.0,
    router_config: dict[str, Any] | None = None,
    trace_block_size: int | None = None,
    speedup_ratio: float = 1.0,
    prefill_workers: int = 0,
    transfer: KvTransfer = INSTANT,
    kv_event_lag_ms: float = 0.0,
    spec: EngineSpec | None = None,
) -> list[dict[str, Any]]:
    """Dynamo's replay of ``trace`` with ``router_mode`` ``mode`` (and, for its KV router, the
    options ``router_config``: ``KvRouterConfig``'s names; ``trace_block_size``: the tokens a
    hash id stands for, when not the Mooncake 512; ``speedup_ratio``: the mockers'): its
    per-request records. With ``prefill_workers``, disaggregated: ``workers`` decode workers
    behind them, each handoff priced by ``transfer`` (the replay's prefill router weighs KV
    overlap on P's events; its decode router, load alone). ``kv_event_lag_ms``: how late its
    router's index sees the workers' KV events (its KV router only). ``spec``: the engines'
    ``num_gpu_blocks`` and host tier (:meth:`EngineSpec.host_engine_args`), the mocker's
    defaults when ``None``."""
    os.environ.setdefault("DYN_LOG", "warn")  # its KV router logs every decision at info
    from dynamo._core import KvRouterConfig
    from dynamo.replay import run_trace_replay

    engine: dict[str, Any] = {"block_size": block_size, "speedup_ratio": speedup_ratio}
    if spec is not None:
        engine.update(num_gpu_blocks=spec.num_gpu_blocks, **spec.host_engine_args())
    if prefill_workers:
        pools: dict[str, Any] = {
            "prefill_engine_args": {"engine": {**engine, "worker_type": "prefill", **transfer.engine_args()}},
            "decode_engine_args": {"engine": {**engine, "worker_type": "decode"}},
            "num_prefill_workers": prefill_workers,
            "num_decode_workers": workers,
        }
    else:
        pools = {"extra_engine_args": {"engine": engine}, "num_workers": workers}
    report = run_trace_replay(
        str(trace),
        **pools,
        router_mode=mode,
        router_config=KvRouterConfig.from_json(json.dumps(router_config)) if router_config else None,
        arrival_speedup_ratio=arrival_speedup,
        trace_block_size=trace_block_size,
        kv_event_lag_ms=(kv_event_lag_ms or None) if mode == "kv_router" else None,  # round robin hears none
        capture_per_request=True,
    )
    rows: list[dict[str, Any]] | None = report.per_request
    assert rows is not None  # capture_per_request=True
    return rows


def dynamo_replay(
    trace: Path,
    workers: int,
    block_size: int,
    mode: RouterMode,
    prefill_workers: int = 0,
    kv_event_lag_ms: float = 0.0,
    spec: EngineSpec | None = None,
) -> dict[str, float]:
    """:func:`replay_rows` summarized as :meth:`benchmarks.sim.fleet.Report.summary` is."""
    rows = replay_rows(
        trace, workers, block_size, mode, prefill_workers=prefill_workers, kv_event_lag_ms=kv_event_lag_ms, spec=spec
    )
    return summarize(rows)


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Replay's per-request records summarized as :meth:`benchmarks.sim.fleet.Report.summary` is (its
    host-reused tokens: each request's at its first admission, as the simulator counts them)."""
    ttft = [r["ttft_ms"] for r in rows]
    return {
        "requests": float(len(rows)),
        "mean_ttft_ms": statistics.fmean(ttft),
        "p99_ttft_ms": percentile(ttft, 0.99),
        "mean_itl_ms": statistics.fmean(r["itl_ms"] for r in rows if r["output_length"] > 1),
        "reuse": sum(r["reused_input_tokens"] for r in rows) / sum(r["input_length"] for r in rows),
        "host_reused_tokens": float(sum(r.get("first_admission_host_reused_input_tokens") or 0 for r in rows)),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Each row: the simulator's figure, Dynamo's, and their ratio (host-reused tokens too
    where Dynamo's replay restored any)."""
    keys = KEYS + (("host_reused_tokens",) if any(r["dynamo_replay"].get("host_reused_tokens") for r in rows) else ())
    lines = ["| trace | fleet | routing | " + " | ".join(f"{k} (sim / Dynamo)" for k in keys) + " |"]
    lines.append("|---|---:|---|" + "---|" * len(keys))
    for row in rows:
        ours, theirs = row["kvpilot_sim"], row["dynamo_replay"]
        cells = [
            f"{ours[k]:.3f} / {theirs[k]:.3f} ({ours[k] / theirs[k] if theirs[k] else float('nan'):.4f}x)" for k in keys
        ]
        pools = Pools(row["workers"], row.get("prefill_workers", 0))
        lines.append(f"| {row['trace']} | {pools} | {row['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, action="append", required=True, help="Mooncake trace(s)")
    parser.add_argument("--workers", default="16,64", help="comma-separated worker counts")
    parser.add_argument("--max-requests", type=int, help="the first N requests of each trace")
    parser.add_argument(
        "--prefill-workers",
        default="0",
        help="comma-separated prefill pool sizes, each beside the --workers entry at its place (0: aggregated; "
        "one value: beside every entry)",
    )
    parser.add_argument(
        "--kv-event-lag-ms", type=float, default=0.0, help="how late the routers' indexes see KV events, both sides"
    )
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs of each router (its seeds, its replays)")
    parser.add_argument(
        "--num-gpu-blocks", type=int, default=DEFAULT_SPEC.num_gpu_blocks, help="each worker's GPU blocks, both sides"
    )
    parser.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        help="each worker's host (G2) tier in blocks, both sides (0: none); the simulator then keeps generated "
        "blocks cached as the mocker does",
    )
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072, help="KV bytes a token (llama-8b, bf16)")
    parser.add_argument("--host-gb-s", type=float, default=32.0, help="the host tier's H2D and D2H bandwidth, GB/s")
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-sim-vs-dynamo.json"))
    args = parser.parse_args(argv)
    spec = EngineSpec(
        num_gpu_blocks=args.num_gpu_blocks,
        cache_generated_blocks=bool(args.host_blocks),
        num_host_blocks=args.host_blocks,
        kv_bytes_per_token=args.kv_bytes_per_token if args.host_blocks else 0,
        h2d_gb_s=args.host_gb_s,
        d2h_gb_s=args.host_gb_s,
    )
    rows: list[dict[str, Any]] = []
    for trace in args.trace:
        entries = load_trace(trace, args.max_requests)
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as sliced, trace.open() as lines:
            for n, line in enumerate(lines):
                if args.max_requests is not None and n >= args.max_requests:
                    break
                sliced.write(line)
        decode = [int(w) for w in args.workers.split(",")]
        prefill = [int(p) for p in args.prefill_workers.split(",")]
        if len(prefill) == 1:
            prefill *= len(decode)
        if len(prefill) != len(decode):
            parser.error("--prefill-workers: one value, or one per --workers entry")
        pools = list(zip(prefill, decode, strict=True))
        for prefill_workers, workers in pools:
            for mode in MODES:
                repeats = 1 if mode == "round_robin" else args.repeats
                started = time.perf_counter()
                runs = []
                for seed in range(repeats):
                    placement: Placement = (
                        RoundRobin()
                        if mode == "round_robin"
                        else KvpilotPlacement(workers, spec, DYNAMO_WEIGHTS, seed=seed, prefill_workers=prefill_workers)
                    )
                    runs.append(
                        simulate(
                            entries,
                            workers,
                            placement,
                            spec,
                            kv_event_lag_ms=args.kv_event_lag_ms,
                            prefill_workers=prefill_workers,
                        ).summary()
                    )
                ours = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
                ours_s = (time.perf_counter() - started) / repeats
                started = time.perf_counter()
                replays = [
                    dynamo_replay(
                        Path(sliced.name),
                        workers,
                        spec.block_size,
                        mode,
                        prefill_workers,
                        args.kv_event_lag_ms,
                        spec if spec != DEFAULT_SPEC else None,
                    )
                    for _ in range(repeats)
                ]
                theirs = {k: statistics.fmean(r[k] for r in replays) for k in replays[0]}
                theirs_s = (time.perf_counter() - started) / repeats
                rows.append(
                    {
                        "trace": trace.name,
                        "workers": workers,
                        "prefill_workers": prefill_workers,
                        "mode": mode,
                        "kvpilot_sim": ours,
                        "dynamo_replay": theirs,
                        "repeats": repeats,
                        "seconds": {"kvpilot_sim": ours_s, "dynamo_replay": theirs_s},
                    }
                )
    run = provenance()
    print(describe(run))
    print(table(rows))
    args.json.write_text(json.dumps({"rows": rows, "run": {"argv": recorded_argv()}, "provenance": run}, indent=2))
    return 0
