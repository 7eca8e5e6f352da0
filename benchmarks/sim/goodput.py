"""Goodput in virtual time, as DistServe defines it: the highest arrival rate at which 90% of
requests meet both SLOs, each rate and every slower one. The SLOs are scale-free:

- TTFT at most ``TTFT_SLO_X`` times the request's floor: its prefill alone on an idle worker that
  holds every block any earlier request of the trace computed (the new tokens' polynomial
  prefill, :func:`sim.engine.prefill_ms`);
- mean inter-token latency at most ``ITL_SLO_X`` times an idle worker's decode step at the
  request's context (:func:`sim.engine.decode_ms`).

The rate is swept by compressing the trace's arrival times (``arrival_speedup``); each point
runs the simulator with kvpilot's router and Dynamo's replay with its KV router and with round
robin, on the same trace and engine parameters (Dynamo's replay is the baseline)::

    python benchmarks/sim_goodput.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl --workers 64
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.goodput import ATTAINMENT, SweepPoint, goodput
from fleet.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace
from provenance import describe, provenance

from sim.compare import RouterMode, replay_rows
from sim.engine import EngineSpec, SimRequest, decode_ms, prefill_ms
from sim.fleet import DEFAULT_SPEC, simulate
from sim.kvpilot import KvpilotPlacement

TTFT_SLO_X = 5.0
ITL_SLO_X = 2.0
SPEEDUPS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
ARMS = ("kvpilot", "dynamo_kv", "dynamo_round_robin")


@dataclass(frozen=True, slots=True)
class Floor:
    """Per request (in trace order): the TTFT and ITL it would have alone on an idle worker."""

    ttft_ms: list[float]
    itl_ms: list[float]


def floor(trace: Sequence[TraceRequest], spec: EngineSpec = DEFAULT_SPEC) -> Floor:
    """Each request's floor (module doc): reusable blocks are those of its hash-id prefix that
    an earlier request of the trace already had, at most its last token's block."""
    seen: set[tuple[int, ...]] = set()
    ttft, itl = [], []
    capacity = spec.num_gpu_blocks * spec.block_size
    for entry in trace:
        reused_ids = 0
        for k in range(len(entry.hash_ids)):
            if entry.hash_ids[: k + 1] in seen:
                reused_ids = k + 1
            else:
                break
        for k in range(len(entry.hash_ids)):
            seen.add(entry.hash_ids[: k + 1])
        cap = (entry.input_length - 1) // spec.block_size * spec.block_size
        cached = min(cap, reused_ids * TRACE_BLOCK_TOKENS)
        ttft.append(prefill_ms(entry.input_length - cached) / spec.speedup_ratio)
        itl.append(decode_ms(entry.input_length / capacity) / spec.speedup_ratio)
    return Floor(ttft, itl)


def attainment(ttft_ms: Sequence[float], itl_ms: Sequence[float | None], base: Floor) -> float:
    """The share of requests meeting both SLOs (a request of one output token has no ITL to miss)."""
    met = sum(
        1
        for t, i, ft, fi in zip(ttft_ms, itl_ms, base.ttft_ms, base.itl_ms, strict=True)
        if t <= TTFT_SLO_X * ft and (i is None or i <= ITL_SLO_X * fi)
    )
    return met / len(ttft_ms)


def arrival_order(trace: Sequence[TraceRequest]) -> list[int]:
    """The trace's indices by (arrival, prompt, output length): how both sides' requests are
    paired with their floors (Dynamo's replay reports its requests under random ids)."""
    return sorted(
        range(len(trace)), key=lambda i: (trace[i].timestamp_ms, trace[i].input_length, trace[i].output_length)
    )


def _ours(trace: list[TraceRequest], workers: int, speedup: float) -> tuple[list[float], list[float | None]]:
    requests: list[SimRequest] = []
    simulate(trace, workers, KvpilotPlacement(workers, DEFAULT_SPEC), arrival_speedup=speedup, requests_out=requests)
    ordered = [requests[i] for i in arrival_order(trace)]
    ttft = [r.first_token_ms - r.arrival_ms if r.first_token_ms is not None else float("inf") for r in ordered]
    itl: list[float | None] = [
        (r.token_ms[-1] - r.token_ms[0]) / (len(r.token_ms) - 1) if len(r.token_ms) > 1 else None for r in ordered
    ]
    return ttft, itl


def _dynamo(path: Path, workers: int, speedup: float, mode: RouterMode) -> tuple[list[float], list[float | None]]:
    rows = replay_rows(path, workers, DEFAULT_SPEC.block_size, mode, speedup)
    by_order = sorted(rows, key=lambda r: (r["arrival_time_ms"], r["input_length"], r["requested_output_length"]))
    return [r["ttft_ms"] for r in by_order], [r["itl_ms"] if r["output_length"] > 1 else None for r in by_order]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="a Mooncake trace without sessions")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--max-requests", type=int)
    parser.add_argument("--speedups", default=",".join(f"{s:g}" for s in SPEEDUPS), help="arrival compressions")
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-sim-goodput.json"))
    args = parser.parse_args(argv)
    trace = load_trace(args.trace, args.max_requests)
    if any(e.session_id for e in trace):
        parser.error("a trace with sessions: its arrivals depend on the run (use a trace without session_id)")
    sliced = args.json.with_suffix(".trace.jsonl")
    with args.trace.open() as lines, sliced.open("w") as out:
        for n, line in enumerate(lines):
            if args.max_requests is not None and n >= args.max_requests:
                break
            out.write(line)
    unordered = floor(trace)
    order = arrival_order(trace)
    base = Floor([unordered.ttft_ms[i] for i in order], [unordered.itl_ms[i] for i in order])
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1e3
    points: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for speedup in (float(s) for s in args.speedups.split(",")):
        rate = len(trace) / (span_s / speedup)
        runs = {
            "kvpilot": _ours(trace, args.workers, speedup),
            "dynamo_kv": _dynamo(sliced, args.workers, speedup, "kv_router"),
            "dynamo_round_robin": _dynamo(sliced, args.workers, speedup, "round_robin"),
        }
        for arm, (ttft, itl) in runs.items():
            points[arm].append({"speedup": speedup, "rate_rps": rate, "attainment": attainment(ttft, itl, base)})
        print(f"x{speedup:g} ({rate:.1f} req/s): " + ", ".join(f"{a} {points[a][-1]['attainment']:.3f}" for a in ARMS))
    result: dict[str, Any] = {
        "goodput_rps": {
            arm: goodput([SweepPoint(p["rate_rps"], p["attainment"]) for p in ps]) for arm, ps in points.items()
        },
        "points": points,
        "slo": {"ttft_x_floor": TTFT_SLO_X, "itl_x_idle": ITL_SLO_X, "attainment": ATTAINMENT},
        "workers": args.workers,
        "trace": args.trace.name,
        "run": {"argv": sys.argv},
        "provenance": provenance(),
    }
    args.json.write_text(json.dumps(result, indent=2))
    print(describe(result["provenance"]))
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    """Goodput per arm, and each arm's attainment at each offered rate."""
    lines = ["| arm | goodput req/s | offered req/s: SLO attainment |", "|---|---:|---|"]
    for arm, points in result["points"].items():
        cells = "; ".join(f"{p['rate_rps']:.1f}: {p['attainment']:.3f}" for p in points)
        lines.append(f"| {arm} | {result['goodput_rps'][arm]:.1f} | {cells} |")
    return (
        f"{result['trace']}, {result['workers']} workers; SLOs: TTFT at most {result['slo']['ttft_x_floor']:g}x the "
        f"floor, ITL at most {result['slo']['itl_x_idle']:g}x an idle worker's, met by "
        f"{result['slo']['attainment']:.0%} of requests.\n\n" + "\n".join(lines)
    )
