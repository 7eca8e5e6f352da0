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
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.agent.trace import AgentShape, agent_trace, to_jsonl
from benchmarks.fleet.goodput import ATTAINMENT, ITL_SLO_X, TTFT_SLO_X, GoodputBounds, SweepPoint, at_least, bounds
from benchmarks.fleet.trace import TRACE_BLOCK_TOKENS, PromptShape, TraceRequest, load_trace
from benchmarks.provenance import describe, provenance, recorded_argv
from benchmarks.sim.compare import DYNAMO_WEIGHTS, RouterMode, replay_rows
from benchmarks.sim.engine import (
    EngineSpec,
    SimRequest,
    decode_ms,
    prefill_ms,
    recompute_ms_per_block,
    restore_ms_per_block,
)
from benchmarks.sim.fleet import DEFAULT_SPEC, KvTransfer, Pools, percentile, simulate
from benchmarks.sim.kvpilot import KvpilotPlacement
from kvpilot.policies.tier_credit import restore_credit

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


UNTIERED = "kvpilot_without_tiers"
"""The arm of kvpilot on workers without host tiers, which a tiered run's kvpilot is also held against."""


class Tiers(str, enum.Enum):
    """What a simulated kvpilot arm makes of a fleet with host tiers (``--host-blocks``)."""

    HEARD = "heard"
    """The workers keep their host tiers and the router hears their events (as from vLLM's
    offloading connector or Dynamo's KVBM), crediting a host block by what its restore saves."""
    BLIND = "blind"
    """The workers keep their host tiers; the router hears GPU events only (as from 1.6.1's
    mocker, which Dynamo's replay arms run): what hearing the tier is worth."""
    NONE = "none"
    """The workers have no host tier: kvpilot as it was."""


@dataclass(frozen=True, slots=True)
class Floor:
    """Per request (in trace order): the TTFT and ITL it would have alone on an idle worker."""

    ttft_ms: list[float]
    itl_ms: list[float]


def floor(
    trace: Sequence[TraceRequest],
    spec: EngineSpec = DEFAULT_SPEC,
    handoff: KvTransfer | None = None,
    tokens_per_hash: int = TRACE_BLOCK_TOKENS,
) -> Floor:
    """Each request's floor (module doc): reusable blocks are those of its hash-id prefix that
    an earlier request of the trace already had, at most its last token's block. With a
    ``handoff`` (a disaggregated fleet), plus its KV's move to D and D's first step.
    ``tokens_per_hash``: the tokens each hash id stands for, every prompt scaled as the live
    fleet benchmark scales it (:class:`benchmarks.fleet.trace.PromptShape`)."""
    seen: set[tuple[int, ...]] = set()
    ttft, itl = [], []
    capacity = spec.num_gpu_blocks * spec.block_size
    shape = PromptShape(tokens_per_hash, spec.block_size)
    for entry in trace:
        input_length = shape.input_tokens(entry)
        reused_ids = 0
        for k in range(len(entry.hash_ids)):
            if entry.hash_ids[: k + 1] in seen:
                reused_ids = k + 1
            else:
                break
        for k in range(len(entry.hash_ids)):
            seen.add(entry.hash_ids[: k + 1])
        cap = (input_length - 1) // spec.block_size * spec.block_size
        cached = min(cap, reused_ids * tokens_per_hash)
        step_ms = decode_ms(input_length / capacity) / spec.speedup_ratio
        alone_ms = prefill_ms(input_length - cached) / spec.speedup_ratio
        if handoff is not None:
            alone_ms += handoff.delay_ms(input_length) + step_ms
        ttft.append(alone_ms)
        itl.append(step_ms)
    return Floor(ttft, itl)


def attainment(ttft_ms: Sequence[float], itl_ms: Sequence[float | None], base: Floor) -> float:
    """The share of requests meeting both SLOs (a request of one output token has no ITL to miss)."""
    met = sum(
        1
        for t, i, ft, fi in zip(ttft_ms, itl_ms, base.ttft_ms, base.itl_ms, strict=True)
        if t <= TTFT_SLO_X * ft and (i is None or i <= ITL_SLO_X * fi)
    )
    return met / len(ttft_ms)


def arrival_order(trace: Sequence[TraceRequest], lengths: Sequence[int] | None = None) -> list[int]:
    """The trace's indices by (arrival, prompt, output length): how both sides' requests are
    paired with their floors (Dynamo's replay reports its requests under random ids).
    ``lengths``: the prompts' lengths where they were scaled (else each ``input_length``)."""
    prompt = [e.input_length for e in trace] if lengths is None else lengths
    return sorted(range(len(trace)), key=lambda i: (trace[i].timestamp_ms, prompt[i], trace[i].output_length))


def request_times(requests: Sequence[SimRequest]) -> tuple[list[float], list[float | None]]:
    """Each simulated request's TTFT (ms; infinite if it never started) and mean ITL (ms;
    ``None`` for one token), in the order given."""
    ttft = [r.first_token_ms - r.arrival_ms if r.first_token_ms is not None else float("inf") for r in requests]
    itl: list[float | None] = [
        (r.token_ms[-1] - r.token_ms[0]) / (len(r.token_ms) - 1) if len(r.token_ms) > 1 else None for r in requests
    ]
    return ttft, itl


@dataclass(frozen=True, slots=True)
class Point:
    """One offered rate: the trace both sides run (``path``: as Dynamo's replay reads it) and
    the arrival compression both apply."""

    label: str
    load: float
    """What sets the rate: sessions per worker (the agent) or the arrivals' compression."""
    trace: list[TraceRequest]
    path: Path
    speedup: float

    @property
    def rate_rps(self) -> float:
        span_s = (self.trace[-1].timestamp_ms - self.trace[0].timestamp_ms) / 1e3
        return len(self.trace) / (span_s / self.speedup)


@dataclass(frozen=True, slots=True)
class Served:
    """Per request in :func:`arrival_order`: TTFT (ms), mean ITL (ms; ``None`` for one
    token) and the worker that decoded it."""

    ttft_ms: list[float]
    itl_ms: list[float | None]
    workers: list[int]
    computed_tokens: int
    """Prompt tokens prefilled (the rest were reused from a GPU or host tier)."""
    host_reused_tokens: int
    """Prompt tokens restored from the workers' host tiers."""


Arm = Callable[[Point, Pools], Served]


def turns(trace: Sequence[TraceRequest]) -> list[tuple[str | None, int]]:
    """Each request's session and its place in it (0 first; every request of no session is 0)."""
    seen: Counter[str | None] = Counter()
    out = []
    for entry in trace:
        out.append((entry.session_id, seen[entry.session_id] if entry.session_id is not None else 0))
        if entry.session_id is not None:
            seen[entry.session_id] += 1
    return out


def simulated_arm(cost: dict[str, Any] | None = None, tiers: Tiers = Tiers.HEARD, pressure: bool = True) -> Arm:
    """kvpilot's router in the simulator, its ``cost`` section ``cost`` (its defaults:
    ``None``), on workers whose host tiers (where the fleet has them) are as ``tiers`` says;
    ``pressure`` False: with the mocker's default GPU blocks instead of the fleet's."""

    def run(point: Point, pools: Pools) -> Served:
        requests: list[SimRequest] = []
        spec = pools.spec if tiers is not Tiers.NONE else replace(pools.spec, num_host_blocks=0)
        if not pressure:
            spec = replace(spec, num_gpu_blocks=DEFAULT_SPEC.num_gpu_blocks)
        placement = KvpilotPlacement(
            pools.workers, spec, cost, prefill_workers=pools.prefill_workers, hears_host_tier=tiers is Tiers.HEARD
        )
        simulate(
            point.trace,
            pools.workers,
            placement,
            spec,
            arrival_speedup=point.speedup,
            requests_out=requests,
            prefill_workers=pools.prefill_workers,
            transfer=pools.handoff,
        )
        ordered = [requests[i] for i in arrival_order(point.trace)]
        ttft, itl = request_times(ordered)
        return Served(
            ttft,
            itl,
            [placement.placed[r.rid] for r in ordered],
            sum(r.prompt_len - r.reused_tokens for r in requests),
            sum(r.host_reused_tokens for r in requests),
        )

    return run


def host_credit(spec: EngineSpec) -> dict[str, float]:
    """kvpilot's cost section on workers with ``spec``'s host tier: a host block credited by
    the share of its prefill a restore saves (:func:`kvpilot.policies.tier_credit.restore_credit`),
    not Dynamo's preset 0.75."""
    return {"host_cache_hit_weight": restore_credit(restore_ms_per_block(spec), recompute_ms_per_block(spec))}


def dynamo_arm(mode: RouterMode, router_config: dict[str, Any] | None = None) -> Arm:
    """Dynamo's replay with ``router_mode`` ``mode`` (and KV router options ``router_config``).
    Its records are paired with the trace's requests by session and turn (its arrivals of a
    session's later turns are its own), else by arrival, prompt and output length."""

    def run(point: Point, pools: Pools) -> Served:
        rows = replay_rows(
            point.path,
            pools.workers,
            pools.spec.block_size,
            mode,
            point.speedup,
            router_config,
            prefill_workers=pools.prefill_workers,
            transfer=pools.handoff,
            spec=pools.spec,
        )
        order = arrival_order(point.trace)
        if any(e.session_id for e in point.trace):
            by_turn = {(r["session_id"], r["turn_index"]): r for r in rows}
            keys = turns(point.trace)
            ordered = [by_turn[keys[i]] for i in order]
        else:
            ordered = sorted(
                rows, key=lambda r: (r["arrival_time_ms"], r["input_length"], r["requested_output_length"])
            )
        return Served(
            [r["ttft_ms"] for r in ordered],
            [r["itl_ms"] if r["output_length"] > 1 else None for r in ordered],
            [r["decode_worker_idx"] for r in ordered],
            sum(r["input_length"] - r["reused_input_tokens"] for r in rows),
            sum(r.get("first_admission_host_reused_input_tokens") or 0 for r in rows),
        )

    return run


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


def arm_bounds(rows: Sequence[dict[str, Any]]) -> GoodputBounds:
    """The goodput bracket of one arm's rows (:func:`benchmarks.fleet.goodput.bounds`)."""
    return bounds([SweepPoint(r["rate_rps"], r["attainment"]) for r in rows])


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


def best_dynamo_arm(found: dict[str, GoodputBounds], tuned: bool) -> str:
    """The arm kvpilot is held against: of the arms other than kvpilot's own (``kvpilot``
    and its variants, ``kvpilot_*``), the one whose goodput may be highest (the highest
    upper end of its bracket, then lower end), a tie going to Dynamo's tuned KV router,
    then to its default."""
    preference = ["dynamo_kv_tuned"] if tuned else []
    preference += ["dynamo_kv", *sorted(found)]
    others = [arm for arm in dict.fromkeys(preference) if arm in found and not arm.startswith("kvpilot")]
    return max(others, key=lambda arm: (found[arm].upper, found[arm].lower, -others.index(arm)))


def ratios(points: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, Any]:
    """kvpilot's goodput against ``baseline``'s as the brackets allow
    (:func:`benchmarks.fleet.goodput.at_least`: ``None`` when the baseline never missed), and kvpilot's
    mean TTFT over the baseline's at the baseline's goodput rate (at its slowest rate when
    the baseline has no goodput)."""
    ours, theirs = points["kvpilot"], points[baseline]
    ours_bounds, theirs_bounds = arm_bounds(ours), arm_bounds(theirs)
    shared = {p["rate_rps"] for p in ours} & {p["rate_rps"] for p in theirs}
    at = max(
        (r for r in shared if r <= theirs_bounds.lower),
        default=min(shared),
    )
    mean = {p["rate_rps"]: p["mean_ttft_ms"] for p in ours}, {p["rate_rps"]: p["mean_ttft_ms"] for p in theirs}
    return {
        "goodput_at_least": at_least(ours_bounds, theirs_bounds),
        "mean_ttft_at_baseline_goodput": mean[0][at] / mean[1][at],
        "at_rate_rps": at,
    }


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


def table(result: dict[str, Any]) -> str:
    """Goodput per arm, and each arm's attainment and mean TTFT at each offered rate (and,
    on a trace with sessions, where they went: :func:`placement_stats`)."""
    placed = any("moved_steps" in p for points in result["points"].values() for p in points)
    what = "mean TTFT ms; steps moved, most sessions on one worker" if placed else "mean TTFT ms"
    lines = [f"| arm | goodput req/s | offered req/s: SLO attainment ({what}) |", "|---|---:|---|"]
    for arm, points in result["points"].items():
        cells = "; ".join(
            f"{p['rate_rps']:.1f}: {p['attainment']:.3f} ({p['mean_ttft_ms']:.0f}"
            + (f"; {p['moved_steps']}, {p['most_sessions_on_one_worker']}" if "moved_steps" in p else "")
            + ")"
            for p in points
        )
        lines.append(f"| {arm} | {_bracket(arm_bounds(points))} | {cells} |")
    compared = ""
    found = {arm: arm_bounds(points) for arm, points in result["points"].items()}
    if "kvpilot" in found and len(found) > 1 and any(not arm.startswith("kvpilot") for arm in found):
        baseline = best_dynamo_arm(found, result.get("dynamo_router_config") is not None)
        r = ratios(result["points"], baseline)
        claim = (
            f"goodput at least {r['goodput_at_least']:.2f}x (our lower end over its upper)"
            if r["goodput_at_least"] is not None
            else "no goodput ratio (it never missed)"
        )
        compared = (
            f" kvpilot against {baseline}: {claim}; mean TTFT at {r['at_rate_rps']:.1f} "
            f"req/s {r['mean_ttft_at_baseline_goodput']:.2f}x."
        )
    if any("computed_tokens" in p for points in result["points"].values() for p in points):
        lines += ["", "| arm | at each offered req/s: prompt tokens prefilled, M (restored from host, M) |"]
        lines.append("|---|---|")
        for arm, points in result["points"].items():
            cells = "; ".join(
                f"{p['rate_rps']:.1f}: {p['computed_tokens'] / 1e6:.1f} ({p['host_reused_tokens'] / 1e6:.1f})"
                for p in points
            )
            lines.append(f"| {arm} | {cells} |")
    if {"kvpilot", UNTIERED} <= set(found):
        untiered = at_least(found["kvpilot"], found[UNTIERED])
        compared += " kvpilot against kvpilot_without_tiers: " + (
            f"goodput at least {untiered:.2f}x." if untiered is not None else "no goodput ratio (it never missed)."
        )
    resolution = result.get("resolution")
    bisected = f" Brackets bisected to {resolution:.0%} where closed." if resolution else " Brackets from the grid."
    return (
        f"{result['workload']}{_shapes(result)}, {_pools(result)}; SLOs: TTFT at most "
        f"{result['slo']['ttft_x_floor']:g}x the floor, ITL at most {result['slo']['itl_x_idle']:g}x an idle "
        f"worker's, met by {result['slo']['attainment']:.0%} of requests.{compared}{bisected} "
        "Goodput lies in [lower, upper); * marks an arm that met the SLOs again above its first miss.\n\n"
        + "\n".join(lines)
    )


def _bracket(found: GoodputBounds) -> str:
    """A goodput bracket as the table shows it: ``[lower, upper)``, ``at least lower`` when
    open above; ``*`` where the arm met the SLOs again above its first miss."""
    text = f"at least {found.lower:.1f}" if found.upper == float("inf") else f"[{found.lower:.1f}, {found.upper:.1f})"
    return text + ("" if found.monotone else " *")


def _shapes(result: dict[str, Any]) -> str:
    """A results file's human turns and host tiers, where it has them (none before tiers)."""
    agent, engine = result.get("agent") or {}, result.get("engine") or {}
    out = ""
    if agent.get("steps_per_turn"):
        out += f" (a human turn every {agent['steps_per_turn']} steps, mean gap {agent['human_gap_s']:g} s)"
    if engine.get("num_host_blocks"):
        out += (
            f", {engine['num_gpu_blocks']:,} GPU and {engine['num_host_blocks']:,} host blocks a worker at "
            f"{engine['host_gb_s']:g} GB/s ({engine['kv_bytes_per_token']:,} B a token; host credit "
            f"{engine['host_credit']:.2f})"
        )
    return out


def _pools(result: dict[str, Any]) -> str:
    """A results file's fleet, as :class:`Pools` names it (files before disaggregation: co-located)."""
    return str(Pools(result["workers"], result.get("prefill_workers", 0)))


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """One column per results file (a fleet size): mean TTFT (log) and SLO attainment
    against the offered rate, one line per arm, the attainment target drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(4.2 * len(results), 6.4), squeeze=False, sharex="col")
    for column, result in enumerate(results):
        top, bottom = axes[0][column], axes[1][column]
        for arm, points in result["points"].items():
            rates = [p["rate_rps"] for p in points]
            (line,) = top.plot(rates, [p["mean_ttft_ms"] for p in points], marker="o", ms=3, label=arm)
            bottom.plot(rates, [p["attainment"] for p in points], marker="o", ms=3, color=line.get_color())
        top.set_title(f"{result['workload']}, {_pools(result)}", fontsize=9)
        top.set_yscale("log")
        top.grid(alpha=0.3)
        bottom.axhline(result["slo"]["attainment"], color="grey", lw=0.8, ls=":")
        bottom.set_ylim(0, 1.02)
        bottom.set_xlabel("offered requests/s")
        bottom.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean TTFT ms")
    axes[1][0].set_ylabel("requests meeting both SLOs")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
