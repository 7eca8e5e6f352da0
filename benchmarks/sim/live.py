"""The simulator's prediction of a live fleet run, arm by arm: the same trace, prompts scaled
as ``bench_fleet.py`` scaled them (``--tokens-per-hash``), the same arrivals (``--rate-scale``),
the mockers' block size and speed, against what the run measured (its ``--json``).

Each live arm is predicted by its counterpart in virtual time:

- ``kvpilot``: kvpilot's router (with the run's ``kvpilot_cost``) in the simulator;
- ``dynamo_kv``: Dynamo's replay with its KV router at its defaults;
- ``dynamo_kv_tuned``: the live arm's options have Dynamo's hard session affinity, which its
  replay lacks; on a trace with sessions it is predicted by Dynamo's cost with that affinity
  and the arm's request weight in the simulator (:data:`sim.goodput.DYNAMO_PINNED_COST`'s
  form), else by Dynamo's replay with the arm's options;
- ``dynamo_round_robin``: round robin in the simulator.

Requests arrive at their timestamps, a session's steps too (the live client's open loop, not
the replay's closed one). The live figures are the client's (HTTP, the frontend and, for kvpilot, Envoy and the
picker included) and the frontend's own TTFT; the simulator has no network or process
costs, so its TTFT is compared with both::

    python benchmarks/sim_live.py /tmp/kvpilot-bench-fleet-agent.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from fleet.arms import SESSION_REQUEST_WEIGHT
from fleet.trace import PromptShape, TraceRequest, load_trace
from provenance import describe, provenance

from sim.compare import DYNAMO_WEIGHTS, replay_rows
from sim.engine import EngineSpec
from sim.fleet import Placement, RoundRobin, simulate
from sim.kvpilot import KvpilotPlacement


def _argv_value(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def _summary(ttft_ms: list[float], itl_ms: list[float]) -> dict[str, float]:
    return {"mean_ttft_ms": statistics.fmean(ttft_ms), "mean_itl_ms": statistics.fmean(itl_ms) if itl_ms else 0.0}


def _simulated(
    trace: list[TraceRequest], workers: int, placement: Placement, spec: EngineSpec, rate: float, tph: int
) -> dict[str, float]:
    report = simulate(
        trace, workers, placement, spec, arrival_speedup=rate, tokens_per_hash=tph, closed_loop_sessions=False
    )
    summary = report.summary()
    return {key: summary[key] for key in ("mean_ttft_ms", "mean_itl_ms")}


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
    scaled = (
        scratch / "scaled-trace.jsonl"
    )  # no session ids: Dynamo's replay sends each at its timestamp, as the live client did
    scaled.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": e.timestamp_ms,
                    "input_length": shape.input_tokens(e),
                    "output_length": e.output_length,
                    "hash_ids": list(e.hash_ids),
                }
            )
            + "\n"
            for e in trace
        )
    )
    sessions = any(e.session_id for e in trace)
    rows = []
    for arm, measured in results.items():
        if arm in ("run", "provenance"):
            continue
        if arm in ("kvpilot", "kvpilot_relay"):
            cost = run.get("kvpilot_cost") or {}
            placement: Placement = KvpilotPlacement(workers, spec, cost, tokens_per_hash=tph)
            predicted, how = _simulated(trace, workers, placement, spec, rate, tph), "kvpilot's router, simulated"
        elif arm == "dynamo_round_robin":
            predicted, how = _simulated(trace, workers, RoundRobin(), spec, rate, tph), "round robin, simulated"
        elif arm == "dynamo_kv_tuned" and sessions:
            cost = {
                **DYNAMO_WEIGHTS,
                "session_affinity_credit": 1e9,
                "decode_active_request_weight": SESSION_REQUEST_WEIGHT,
            }
            placement = KvpilotPlacement(workers, spec, cost, tokens_per_hash=tph)
            predicted, how = _simulated(trace, workers, placement, spec, rate, tph), "Dynamo's cost, pinned, simulated"
        else:
            replayed = replay_rows(
                scaled, workers, block_size, "kv_router", rate, trace_block_size=tph, speedup_ratio=spec.speedup_ratio
            )
            predicted = _summary(
                [r["ttft_ms"] for r in replayed], [r["itl_ms"] for r in replayed if r["output_length"] > 1]
            )
            how = "Dynamo's replay, KV router defaults" + (" (the live arm was tuned)" if arm != "dynamo_kv" else "")
        live = {
            "mean_ttft_ms": measured["ttft_mean_s"] * 1e3,
            "frontend_ttft_ms": (measured.get("frontend_ttft_mean_s") or float("nan")) * 1e3,
            "mean_itl_ms": measured["itl_mean_s"] * 1e3,
        }
        rows.append({"arm": arm, "predicted_by": how, "predicted": predicted, "live": live})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| live arm | predicted by | TTFT ms: simulated / live client / live frontend | ITL ms: simulated / live |",
        "|---|---|---|---|",
    ]
    for row in rows:
        p, live = row["predicted"], row["live"]
        lines.append(
            f"| {row['arm']} | {row['predicted_by']} | {p['mean_ttft_ms']:.1f} / {live['mean_ttft_ms']:.1f} "
            f"({p['mean_ttft_ms'] / live['mean_ttft_ms']:.2f}x) / {live['frontend_ttft_ms']:.1f} "
            f"({p['mean_ttft_ms'] / live['frontend_ttft_ms']:.2f}x) | {p['mean_itl_ms']:.2f} / "
            f"{live['mean_itl_ms']:.2f} ({p['mean_itl_ms'] / live['mean_itl_ms']:.2f}x) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a bench_fleet.py --json file")
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-sim-live.json"))
    args = parser.parse_args(argv)
    rows = predict(json.loads(args.results.read_text()), args.json.parent)
    run = provenance()
    args.json.write_text(json.dumps({"live_rows": rows, "run": {"argv": sys.argv}, "provenance": run}, indent=2))
    print(describe(run))
    print(table(rows))
    return 0
