"""The simulator's prediction of a live fleet run, arm by arm: the same trace, prompts scaled
as ``bench_fleet.py`` scaled them (``--tokens-per-hash``), the same arrivals (``--rate-scale``),
the mockers' block size and speed, against what the run measured (its ``--json``).

Each live arm is predicted by its counterpart in virtual time:

- ``kvpilot``: kvpilot's router (with the run's ``kvpilot_cost``) in the simulator;
- ``dynamo_kv``: Dynamo's replay with its KV router at its defaults;
- ``dynamo_kv_tuned``: the live arm's options have Dynamo's hard session affinity, which its
  replay lacks; on a trace with sessions it is predicted by Dynamo's cost with that affinity
  and the arm's request weight in the simulator (:data:`benchmarks.sim.goodput.DYNAMO_PINNED_COST`'s
  form), else by Dynamo's replay with the arm's options;
- ``dynamo_round_robin``: round robin in the simulator.

Requests arrive at their timestamps, a session's steps too (the live client's open loop, not
the replay's closed one). The live figures are the client's (HTTP, the frontend and, for kvpilot, Envoy and the
picker included) and the frontend's own TTFT; the simulator has no network or process
costs, so its TTFT is compared with both.

Where the run judged its arms by scale-free SLOs (``bench_fleet.py``'s default: each
request's measured floor), each arm's SLO attainment is predicted too, on the simulator's
own floor (:func:`benchmarks.sim.goodput.floor`): scale-free on both sides, so a fleet of any speed is
judged alike. Given the runs of a sweep (one per offered load, e.g. the agent trace with 1, 2
and 4 sessions per worker), each arm's goodput, live and predicted::

    python -m benchmarks.sim_live /tmp/kvpilot-bench-fleet-agent.json
    python -m benchmarks.sim_live /tmp/live/agent-16-s1.json /tmp/live/agent-16-s2.json /tmp/live/agent-16-s4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.fleet.arms import SESSION_REQUEST_WEIGHT
from benchmarks.fleet.goodput import SweepPoint, goodput
from benchmarks.fleet.trace import PromptShape, TraceRequest, load_trace
from benchmarks.provenance import describe, provenance, recorded_argv
from benchmarks.sim.compare import DYNAMO_WEIGHTS, replay_rows
from benchmarks.sim.engine import EngineSpec, SimRequest
from benchmarks.sim.fleet import Placement, RoundRobin, simulate
from benchmarks.sim.goodput import arrival_order, attainment, floor, request_times
from benchmarks.sim.kvpilot import KvpilotPlacement


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """Per request, in trace order: TTFT and mean ITL (ms; ``None`` for one token)."""

    ttft_ms: list[float]
    itl_ms: list[float | None]


def _argv_value(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def _simulated(
    trace: list[TraceRequest], workers: int, placement: Placement, spec: EngineSpec, rate: float, tph: int
) -> Served:
    requests: list[SimRequest] = []
    simulate(
        trace,
        workers,
        placement,
        spec,
        arrival_speedup=rate,
        tokens_per_hash=tph,
        closed_loop_sessions=False,
        requests_out=requests,
    )
    return Served(*request_times(requests))


def _replayed(
    trace: list[TraceRequest], lengths: list[int], path: Path, workers: int, spec: EngineSpec, rate: float, tph: int
) -> Served:
    """Dynamo's replay (KV router, defaults) of the scaled trace at ``path`` (``trace`` with
    prompts of ``lengths``), its records paired with the trace's requests by arrival, prompt
    and output length (it reports random ids)."""
    rows = replay_rows(
        path, workers, spec.block_size, "kv_router", rate, trace_block_size=tph, speedup_ratio=spec.speedup_ratio
    )
    rows.sort(key=lambda r: (r["arrival_time_ms"], r["input_length"], r["requested_output_length"]))
    ttft: list[float] = [0.0] * len(trace)
    itl: list[float | None] = [None] * len(trace)
    for index, row in zip(arrival_order(trace, lengths), rows, strict=True):
        ttft[index] = row["ttft_ms"]
        itl[index] = row["itl_ms"] if row["output_length"] > 1 else None
    return Served(ttft, itl)


def _figures(served: Served, trace: list[TraceRequest], spec: EngineSpec, tph: int, scale_free: bool) -> dict[str, Any]:
    itls = [i for i in served.itl_ms if i is not None]
    return {
        "mean_ttft_ms": statistics.fmean(served.ttft_ms),
        "mean_itl_ms": statistics.fmean(itls) if itls else 0.0,
        "attainment": attainment(served.ttft_ms, served.itl_ms, floor(trace, spec, tokens_per_hash=tph))
        if scale_free
        else None,
    }


def predict(results: dict[str, Any], scratch: Path) -> list[dict[str, Any]]:
    """Per live arm of ``results`` (a ``bench_fleet.py --json`` file): predicted and measured."""
    run = results["run"]
    workload = run["workload"]
    argv = run["argv"]
    tph, block_size = int(workload["tokens_per_hash"]), int(workload["block_size"])
    workers, rate = int(run["fleet"]["workers"]), float(_argv_value(argv, "--rate-scale", "1"))
    shape = PromptShape(tokens_per_hash=tph, block_size=block_size)
    trace = load_trace(Path(workload["trace"]), int(workload["requests"]))
    spec = EngineSpec(block_size=block_size, speedup_ratio=float(run["speedup"]))
    lengths = [shape.input_tokens(e) for e in trace]
    path = (
        scratch / "scaled-trace.jsonl"
    )  # no session ids: the replay sends each at its timestamp, as the live client did
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": e.timestamp_ms,
                    "input_length": n,
                    "output_length": e.output_length,
                    "hash_ids": list(e.hash_ids),
                }
            )
            + "\n"
            for e, n in zip(trace, lengths, strict=True)
        )
    )
    sessions = any(e.session_id for e in trace)
    scale_free = bool((run.get("slo") or {}).get("ttft_x_floor"))
    rows = []
    for arm, measured in results.items():
        if arm in ("run", "provenance"):
            continue
        if arm in ("kvpilot", "kvpilot_relay"):
            cost = run.get("kvpilot_cost") or {}
            placement: Placement = KvpilotPlacement(workers, spec, cost, tokens_per_hash=tph)
            served, how = _simulated(trace, workers, placement, spec, rate, tph), "kvpilot's router, simulated"
        elif arm == "dynamo_round_robin":
            served, how = _simulated(trace, workers, RoundRobin(), spec, rate, tph), "round robin, simulated"
        elif arm == "dynamo_kv_tuned" and sessions:
            cost = {
                **DYNAMO_WEIGHTS,
                "session_affinity_credit": 1e9,
                "decode_active_request_weight": SESSION_REQUEST_WEIGHT,
            }
            placement = KvpilotPlacement(workers, spec, cost, tokens_per_hash=tph)
            served, how = _simulated(trace, workers, placement, spec, rate, tph), "Dynamo's cost, pinned, simulated"
        else:
            served = _replayed(trace, lengths, path, workers, spec, rate, tph)
            how = "Dynamo's replay, KV router defaults" + (" (the live arm was tuned)" if arm != "dynamo_kv" else "")
        live = {
            "mean_ttft_ms": measured["ttft_mean_s"] * 1e3,
            "frontend_ttft_ms": (measured.get("frontend_ttft_mean_s") or float("nan")) * 1e3,
            "mean_itl_ms": measured["itl_mean_s"] * 1e3,
            "attainment": measured.get("slo_attainment") if scale_free else None,
            "offered_rps": measured.get("offered_rps"),
        }
        predicted = _figures(served, trace, spec, tph, scale_free)
        rows.append({"arm": arm, "predicted_by": how, "predicted": predicted, "live": live})
    return rows


def _ratio(predicted: float, live: float) -> str:
    return f"{predicted / live:.2f}x" if live else "-"


def table(rows: list[dict[str, Any]]) -> str:
    """One run's arms: simulated against live TTFT, ITL and (scale-free SLOs) attainment."""
    lines = [
        (
            "| live arm | predicted by | TTFT ms: simulated / live client / live frontend | ITL ms: simulated / live "
            "| SLO attainment: simulated / live |"
        ),
        "|---|---|---|---|---|",
    ]
    for row in rows:
        p, live = row["predicted"], row["live"]
        met = (
            f"{p['attainment']:.3f} / {live['attainment']:.3f}"
            if p.get("attainment") is not None and live.get("attainment") is not None
            else "-"
        )
        lines.append(
            f"| {row['arm']} | {row['predicted_by']} | {p['mean_ttft_ms']:.1f} / {live['mean_ttft_ms']:.1f} "
            f"({_ratio(p['mean_ttft_ms'], live['mean_ttft_ms'])}) / {live['frontend_ttft_ms']:.1f} "
            f"({_ratio(p['mean_ttft_ms'], live['frontend_ttft_ms'])}) | {p['mean_itl_ms']:.2f} / "
            f"{live['mean_itl_ms']:.2f} ({_ratio(p['mean_itl_ms'], live['mean_itl_ms'])}) | {met} |"
        )
    return "\n".join(lines)


def goodputs(runs: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each arm's goodput over the runs of a sweep (:func:`benchmarks.fleet.goodput.goodput`, at each
    run's offered rate), live and predicted; arms without attainment in every run are left out."""
    out: dict[str, dict[str, float]] = {}
    arms = {row["arm"] for rows in runs for row in rows}
    for arm in sorted(arms):
        rows = [row for rows in runs for row in rows if row["arm"] == arm]
        if len(rows) < len(runs) or any(r["live"].get("attainment") is None for r in rows):
            continue
        out[arm] = {
            side: goodput([SweepPoint(r["live"]["offered_rps"], r[side]["attainment"]) for r in rows])
            for side in ("live", "predicted")
        }
    return out


def goodput_table(runs: list[dict[str, Any]], found: dict[str, dict[str, float]]) -> str:
    """Each arm's attainment at each offered rate, and its goodput, simulated against live."""
    rates = [f"{run['offered_rps']:.1f}" for run in runs]
    lines = [
        "| live arm | goodput req/s: simulated / live | " + " | ".join(f"{r} req/s" for r in rates) + " |",
        "|---|---:|" + "---|" * len(rates),
    ]
    for arm, g in found.items():
        cells = []
        for run in runs:
            row = next(r for r in run["live_rows"] if r["arm"] == arm)
            cells.append(f"{row['predicted']['attainment']:.3f} / {row['live']['attainment']:.3f}")
        lines.append(f"| {arm} | {g['predicted']:.1f} / {g['live']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(results: dict[str, Any]) -> str:
    """A ``sim_live.py`` results file as markdown: each run's table, then the sweep's goodput."""
    parts = [
        f"{run['results']} ({run['offered_rps']:.1f} req/s offered):\n\n{table(run['live_rows'])}"
        for run in results["runs"]
    ]
    if results.get("goodput"):
        parts.append(
            "SLO attainment (simulated / live) and goodput:\n\n" + goodput_table(results["runs"], results["goodput"])
        )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="bench_fleet.py --json files (a sweep: one per load)")
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-sim-live.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvpilot-sim-live-") as scratch:  # the scaled traces
        predicted = [predict(json.loads(path.read_text()), Path(scratch)) for path in args.results]
    runs = [
        {
            "results": str(path),
            "offered_rps": next((r["live"]["offered_rps"] for r in rows if r["live"]["offered_rps"]), float("nan")),
            "live_rows": rows,
        }
        for path, rows in zip(args.results, predicted, strict=True)
    ]
    found = goodputs(predicted) if len(predicted) > 1 else {}
    run = provenance()
    out = {"runs": runs, "goodput": found, "run": {"argv": recorded_argv()}, "provenance": run}
    args.json.write_text(json.dumps(out, indent=2))
    print(describe(run))
    print(tables(out))
    return 0
