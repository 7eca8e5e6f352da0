"""Goodput in virtual time, as DistServe defines it: the highest offered rate at which 90% of
requests meet both SLOs, at that rate and every slower one. The SLOs are scale-free:

- TTFT at most ``TTFT_SLO_X`` (:mod:`benchmarks.fleet.goodput`) times the request's floor: its
  prefill alone on an idle worker that holds every block any earlier request of the trace
  computed (the new tokens' polynomial prefill, :func:`benchmarks.sim.engine.prefill_ms`);
- mean inter-token latency at most ``ITL_SLO_X`` times an idle worker's decode step at the
  request's context (:func:`benchmarks.sim.engine.decode_ms`).

Two workloads, each swept over offered rates (requests over the trace's arrival span):

- a Mooncake trace (no sessions), its arrivals compressed (``--speedups``) on both sides;
- the article's agent (``--agent``, :mod:`benchmarks.agent.trace`: sessions of 20 steps over a 32,000-token
  prefix), ``--sessions-per-worker`` sessions per worker starting within
  :data:`AGENT_START_WINDOW_S` (a session's next step is sent when its previous one ended, plus
  the tool's 2 s), so the load is the number of sessions live at once.

Each point runs every arm on the same trace and engine parameters, one after another:
kvpilot's router in the simulator (its defaults: the session terms on), and Dynamo 1.6.1's own
replay with its KV router at its defaults, with ``--dynamo-router-config`` (its best
options for the workload, measured: ``docs/benchmarks/simulator.md``), and round robin. On
the agent workload one more arm, ``dynamo_cost_pinned``: Dynamo's cost with its live
session options, which its replay lacks (:data:`DYNAMO_PINNED_COST`). ``--ablate`` runs
kvpilot alone with each of its session terms off instead (:data:`ABLATIONS`)::

    python -m benchmarks.sim_goodput --trace benchmarks/traces/mooncake_synthetic_trace.jsonl --workers 64
    python -m benchmarks.sim_goodput --agent --workers 64 --sessions-per-worker 2,3,4,5,6
    python -m benchmarks.sim_goodput --agent --workers 64 --ablate
    python -m benchmarks.sim_goodput --agent --workers 64 --sessions-per-worker 4 --search-dynamo '[{}, ...]'
    python -m benchmarks.sim_goodput --agent --workers 64 --prefill-workers 32

With ``--prefill-workers`` the fleet is disaggregated (``--workers`` decode workers behind
that many prefill workers, :mod:`benchmarks.sim.fleet`), on both sides: every request is prefilled on
P, its KV handed to D (instant unless ``--kv-transfer-gb-s`` and ``--kv-bytes-per-token``
are given, as in Dynamo's replay), and a request's floor adds the handoff and D's first step.

The SLOs' floors are :mod:`benchmarks.sim.slo`'s, the arms :mod:`benchmarks.sim.arms`'s, the
brackets and ratios :mod:`benchmarks.sim.brackets`'s, the table and figure
:mod:`benchmarks.sim.goodput_table`'s (all imported here too); this module sweeps and bisects.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.agent.trace import AgentShape, agent_trace, to_jsonl
from benchmarks.fleet.goodput import ATTAINMENT, ITL_SLO_X, TTFT_SLO_X
from benchmarks.fleet.trace import TraceRequest, load_trace
from benchmarks.provenance import describe, provenance, recorded_argv
from benchmarks.sim.arms import UNTIERED, Arm, Point, Served, Tiers, dynamo_arm, host_credit, simulated_arm, turns
from benchmarks.sim.brackets import arm_bounds, best_dynamo_arm, ratios
from benchmarks.sim.compare import DYNAMO_WEIGHTS
from benchmarks.sim.fleet import DEFAULT_SPEC, KvTransfer, Pools, percentile
from benchmarks.sim.goodput_table import plot, table
from benchmarks.sim.slo import Floor, arrival_order, attainment, floor, request_times

__all__ = [
    "UNTIERED",
    "Arm",
    "Floor",
    "Point",
    "Served",
    "Tiers",
    "arm_bounds",
    "arrival_order",
    "attainment",
    "best_dynamo_arm",
    "dynamo_arm",
    "floor",
    "host_credit",
    "plot",
    "ratios",
    "request_times",
    "simulated_arm",
    "table",
    "turns",
]

SPEEDUPS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
SESSIONS_PER_WORKER = (0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
AGENT_START_WINDOW_S = 20.0
"""The agent workload's sessions start at exponential gaps within about this long: a session
lasts about 40 s (20 steps 2 s apart), so most of them are live at once."""
DYNAMO_AGENT_ROUTER_CONFIG = {"decode_active_request_weight": 50}
"""Dynamo's KV router options that served the agent workload best in its own replay (64
workers, 4 sessions per worker; the search is in ``docs/benchmarks/simulator.md``)."""
DYNAMO_PINNED_COST: dict[str, Any] = {
    **DYNAMO_WEIGHTS,
    "session_affinity_credit": 1e9,
    "decode_active_request_weight": 800.0,
}
"""Dynamo's cost with its live frontend's session options, which its 1.6.1 replay lacks:
hard session affinity (``--router-session-affinity-ttl-secs``: every later step on the
first step's worker, here an affinity credit no cost outweighs) and a request weight that
spreads the sessions (``--router-decode-active-request-weight``; 800 blocks: 200, 2,000 and
5,000 measured alike or worse). Run by kvpilot's router in the simulator with kvpilot's own
session terms off, the arm ``dynamo_cost_pinned``."""


ABLATIONS: dict[str, dict[str, Any]] = {
    "residency": {"session_residency_weight": 0.0},
    "stay_rule": {"session_stays_unless_sooner": False},
}
"""kvpilot's cost with one session term off: a first step priced without the sessions living
on each worker; a later step left to Dynamo's cost and the affinity credit."""


def placement_stats(trace: Sequence[TraceRequest], workers: Sequence[int]) -> dict[str, int]:
    """Of ``workers`` (per request in :func:`arrival_order`): the later steps of a session sent
    to another worker than its previous step (each one prefills the history again), and the
    most sessions whose first step went to one worker."""
    keys = turns(trace)
    last: dict[str, int] = {}
    firsts: Counter[int] = Counter()
    moved = 0
    for i, worker in zip(arrival_order(trace), workers, strict=True):
        session, turn = keys[i]
        if session is None:
            continue
        if turn == 0:
            firsts[worker] += 1
        elif last.get(session, worker) != worker:
            moved += 1
        last[session] = worker
    return {"moved_steps": moved, "most_sessions_on_one_worker": max(firsts.values(), default=0)}


def mooncake_points(path: Path, max_requests: int | None, speedups: Sequence[float], out: Path) -> Iterator[Point]:
    """The trace at ``path`` (its first ``max_requests``), its arrivals compressed by each speedup."""
    trace = load_trace(path, max_requests)
    if any(e.session_id for e in trace):
        raise ValueError(f"{path}: a trace with sessions (use --agent for the agent workload)")
    sliced = out.with_suffix(".trace.jsonl")
    with path.open() as lines, sliced.open("w") as written:
        for n, line in enumerate(lines):
            if max_requests is not None and n >= max_requests:
                break
            written.write(line)
    for speedup in speedups:
        yield Point(f"x{speedup:g}", speedup, trace, sliced, speedup)


def agent_points(
    workers: int, sessions_per_worker: Sequence[float], out: Path, shape: AgentShape | None = None
) -> Iterator[Point]:
    """The agent workload (sessions shaped as ``shape``) with each number of sessions per
    worker (at least one session), starting within :data:`AGENT_START_WINDOW_S`."""
    for per_worker in sessions_per_worker:
        sessions = max(1, round(per_worker * workers))
        gap_s = AGENT_START_WINDOW_S / sessions
        trace = agent_trace(replace(shape or AgentShape(), sessions=sessions, session_gap_s=gap_s))
        path = out.with_suffix(f".agent-{per_worker:g}.jsonl")
        path.write_text(to_jsonl(trace))
        yield Point(f"{per_worker:g} sessions/worker", per_worker, trace, path, 1.0)


def measure(point: Point, pools: Pools, arms: dict[str, Arm]) -> dict[str, dict[str, Any]]:
    """Each of ``arms`` at ``point``, one run at a time: attainment, mean and p99 TTFT, mean
    ITL, and, on a trace with sessions, where they went (:func:`placement_stats`)."""
    sessions = any(e.session_id for e in point.trace)
    unordered = floor(point.trace, pools.spec, handoff=pools.handoff if pools.prefill_workers else None)
    order = arrival_order(point.trace)
    base = Floor([unordered.ttft_ms[i] for i in order], [unordered.itl_ms[i] for i in order])
    rows = {}
    for name, arm in arms.items():
        served = arm(point, pools)
        ttft, itl = served.ttft_ms, served.itl_ms
        rows[name] = {
            "label": point.label,
            "load": point.load,
            "rate_rps": point.rate_rps,
            "attainment": attainment(ttft, itl, base),
            "mean_ttft_ms": statistics.fmean(ttft),
            "p99_ttft_ms": percentile(ttft, 0.99),
            "mean_itl_ms": statistics.fmean(i for i in itl if i is not None),
            "floor_mean_ttft_ms": statistics.fmean(base.ttft_ms),
            "computed_tokens": served.computed_tokens,
            "host_reused_tokens": served.host_reused_tokens,
            **(placement_stats(point.trace, served.workers) if sessions else {}),
        }
    print(
        f"{point.label} ({point.rate_rps:.1f} req/s): " + ", ".join(f"{n} {rows[n]['attainment']:.3f}" for n in rows),
        flush=True,
    )
    return rows


def sweep(points: Sequence[Point], pools: Pools, arms: dict[str, Arm]) -> dict[str, list[dict[str, Any]]]:
    """Every arm at every point (:func:`measure`)."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for point in points:
        for name, row in measure(point, pools, arms).items():
            results[name].append(row)
    return results


def bisect(
    rows: list[dict[str, Any]],
    name: str,
    arm: Arm,
    point_at: Callable[[float], Point],
    pools: Pools,
    resolution: float,
    max_runs: int = 8,
) -> None:
    """Narrow arm ``name``'s goodput bracket to ``resolution`` (its width over its lower
    end) by running it alone at the geometric middle of the loads that bracket it, at most
    ``max_runs`` times; ``rows`` gains each run, in rate order. A bracket open above (the
    arm never missed) or at zero (it missed at the slowest load) is left as it is, and so
    is one whose middle load makes the same trace as an end (the load's own resolution)."""
    for _ in range(max_runs):
        found = arm_bounds(rows)
        if found.upper == float("inf") or found.lower == 0 or found.resolution <= resolution:
            return
        by_rate = {r["rate_rps"]: r["load"] for r in rows}
        point = point_at(math.sqrt(by_rate[found.lower] * by_rate[found.upper]))
        if point.rate_rps in by_rate:
            return
        rows.append(measure(point, pools, {name: arm})[name])
        rows.sort(key=lambda r: r["rate_rps"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload = parser.add_mutually_exclusive_group(required=True)
    workload.add_argument("--trace", type=Path, help="a Mooncake trace without sessions")
    workload.add_argument("--agent", action="store_true", help="the article's agent workload")
    parser.add_argument("--workers", type=int, default=64, help="co-located workers, or decode workers")
    parser.add_argument("--prefill-workers", type=int, default=0, help="a disaggregated fleet: its prefill workers")
    parser.add_argument("--kv-transfer-gb-s", type=float, help="with --prefill-workers: the handoff's GB/s")
    parser.add_argument("--kv-bytes-per-token", type=int, help="KV bytes a token (handoff, host tier)")
    parser.add_argument("--max-requests", type=int, help="with --trace: its first N requests")
    parser.add_argument("--speedups", default=",".join(f"{s:g}" for s in SPEEDUPS), help="--trace: compressions")
    parser.add_argument(
        "--sessions-per-worker",
        default=",".join(f"{n:g}" for n in SESSIONS_PER_WORKER),
        help="--agent: the load points",
    )
    parser.add_argument(
        "--dynamo-router-config",
        type=json.loads,
        help="Dynamo's KV router options for its tuned arm (JSON; default with --agent: "
        f"{json.dumps(DYNAMO_AGENT_ROUTER_CONFIG)}; none with --trace: no tuned arm)",
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="also kvpilot with each session term off (where its margin comes from); no Dynamo arms",
    )
    parser.add_argument(
        "--search-dynamo",
        type=json.loads,
        help="instead of the arms: Dynamo's replay with its KV router under each of these option sets "
        "(a JSON list of KvRouterConfig dicts, e.g. '[{}, {\"decode_active_request_weight\": 50}]')",
    )
    parser.add_argument("--steps-per-turn", type=int, default=0, help="--agent: steps between human turns")
    parser.add_argument("--human-gap-s", type=float, default=0.0, help="--agent: a human turn's mean gap")
    parser.add_argument("--num-gpu-blocks", type=int, default=DEFAULT_SPEC.num_gpu_blocks, help="each worker's")
    parser.add_argument("--host-blocks", type=int, default=0, help="each worker's host tier (0: none)")
    parser.add_argument("--host-gb-s", type=float, default=DEFAULT_SPEC.h2d_gb_s, help="host tier GB/s, each way")
    parser.add_argument("--arms", help="only these arms, comma-separated (kvpilot among them); default: every arm")
    parser.add_argument(
        "--resolution",
        type=float,
        default=0.05,
        help="bisect each arm's goodput bracket to this width over its lower end (0: the grid only)",
    )
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-sim-goodput.json"))
    args = parser.parse_args(argv)
    spec = replace(
        DEFAULT_SPEC,
        num_gpu_blocks=args.num_gpu_blocks,
        num_host_blocks=args.host_blocks,
        kv_bytes_per_token=(args.kv_bytes_per_token or 0) if args.host_blocks else 0,
        h2d_gb_s=args.host_gb_s,
        d2h_gb_s=args.host_gb_s,
        cache_generated_blocks=bool(args.host_blocks),
    )
    tiered = bool(args.host_blocks)
    tuned = args.dynamo_router_config or (DYNAMO_AGENT_ROUTER_CONFIG if args.agent else None)
    credit = host_credit(spec) if tiered else None
    arms: dict[str, Arm] = {"kvpilot": simulated_arm(credit)}
    if tiered:
        arms["kvpilot_tier_blind"] = simulated_arm(credit, Tiers.BLIND)
        arms[UNTIERED] = simulated_arm(None, Tiers.NONE)
        arms["kvpilot_without_pressure"] = simulated_arm(None, Tiers.NONE, pressure=False)
    if args.search_dynamo is not None:
        arms = {json.dumps(options): dynamo_arm("kv_router", options) for options in args.search_dynamo}
        tuned = None
    elif args.ablate:
        arms.update({f"kvpilot_without_{term}": simulated_arm(cost) for term, cost in ABLATIONS.items()})
        tuned = None
    else:
        arms["dynamo_kv"] = dynamo_arm("kv_router")
        if tuned:
            arms["dynamo_kv_tuned"] = dynamo_arm("kv_router", tuned)
        if args.agent:
            arms["dynamo_cost_pinned"] = simulated_arm(DYNAMO_PINNED_COST)
        arms["dynamo_round_robin"] = dynamo_arm("round_robin")
    if args.arms:
        unknown = set(args.arms.split(",")) - set(arms)
        if unknown:
            parser.error(f"--arms: no arm {', '.join(sorted(unknown))} here (these run: {', '.join(arms)})")
        arms = {name: arm for name, arm in arms.items() if name in args.arms.split(",")}
    scratch = Path(tempfile.mkdtemp(prefix="kvpilot-sim-goodput-")) / args.json.name  # the traces Dynamo reads
    shape = AgentShape(steps_per_turn=args.steps_per_turn, human_gap_s=args.human_gap_s)
    if args.agent:
        per_worker = [float(n) for n in args.sessions_per_worker.split(",")]
        points = list(agent_points(args.workers, per_worker, scratch, shape))
    else:
        speedups = [float(s) for s in args.speedups.split(",")]
        points = list(mooncake_points(args.trace, args.max_requests, speedups, scratch))
    pools = Pools(args.workers, args.prefill_workers, KvTransfer(args.kv_transfer_gb_s, args.kv_bytes_per_token), spec)
    results = sweep(points, pools, arms)

    def point_at(load: float) -> Point:
        if args.agent:
            return next(agent_points(args.workers, [load], scratch, shape))
        return next(mooncake_points(args.trace, args.max_requests, [load], scratch))

    if args.resolution > 0:
        for name, arm in arms.items():
            bisect(results[name], name, arm, point_at, pools, args.resolution)
    found = {arm: arm_bounds(rows) for arm, rows in results.items()}
    compared = "kvpilot" in arms and len(arms) > 1
    baseline = best_dynamo_arm(found, tuned is not None) if compared else None
    result: dict[str, Any] = {
        "goodput_rps": {arm: b.lower for arm, b in found.items()},
        "goodput_bounds": {arm: b.as_dict() for arm, b in found.items()},
        "resolution": args.resolution,
        "ratios": {"baseline": baseline, **ratios(results, baseline)} if baseline else None,
        "ratios_without_tiers": ratios(results, UNTIERED) if {"kvpilot", UNTIERED} <= set(arms) else None,
        "points": results,
        "slo": {"ttft_x_floor": TTFT_SLO_X, "itl_x_idle": ITL_SLO_X, "attainment": ATTAINMENT},
        "workers": args.workers,
        "prefill_workers": args.prefill_workers,
        "kv_transfer": {"gb_s": args.kv_transfer_gb_s, "bytes_per_token": args.kv_bytes_per_token},
        "workload": "agent" if args.agent else args.trace.name,
        "engine": {
            "num_gpu_blocks": spec.num_gpu_blocks,
            "num_host_blocks": spec.num_host_blocks,
            "kv_bytes_per_token": spec.kv_bytes_per_token,
            "host_gb_s": spec.h2d_gb_s,
            "host_credit": credit and credit["host_cache_hit_weight"],
        },
        "agent": {"steps_per_turn": args.steps_per_turn, "human_gap_s": args.human_gap_s} if args.agent else None,
        "dynamo_router_config": tuned,
        "run": {"argv": recorded_argv()},
        "provenance": provenance(),
    }
    args.json.write_text(json.dumps(result, indent=2))
    print(describe(result["provenance"]))
    print(table(result))
    return 0
