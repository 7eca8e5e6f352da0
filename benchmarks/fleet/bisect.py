"""Each arm's live goodput bracketed, then bisected, on the article's agent
(``live_goodput.py``)::

    python -m benchmarks.live_goodput --workers 16 --sessions 16,32,64 --out-dir /tmp/live

The load is the number of agent sessions starting within :data:`START_WINDOW_S` (as
``make bench``'s live sweep sets it: a session's steps then follow each other, so the sessions
live at once set the rate). Every arm runs at each grid load, one ``bench_fleet.py`` run per
load (the arms one after another on the same fleet and requests). Then each arm alone, at
loads chosen by :func:`next_load`, until its bracket (:class:`benchmarks.fleet.goodput.GoodputBounds`)
is as narrow as ``--resolution`` or its runs are spent: an open bracket is widened (twice the
highest load when the arm never missed, half the lowest when it missed from the start), a
closed one split at its loads' geometric middle. A ratio is printed only as the brackets
support it (:func:`benchmarks.fleet.goodput.at_least`).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.agent.trace import AgentShape, agent_trace, to_jsonl
from benchmarks.fleet.goodput import GoodputBounds, SweepPoint, at_least, bounds
from benchmarks.provenance import ROOT, describe, provenance, recorded_argv

START_WINDOW_S = 20.0
"""The sessions start at exponential gaps within about this long (``make bench``'s live sweep)."""


def next_load(loads: dict[float, int], found: GoodputBounds, resolution: float, most: int) -> int | None:
    """The number of sessions to run an arm at next, given its runs (``loads``: offered rate
    to sessions) and their bracket ``found``; ``None`` when the bracket is narrow enough,
    or the next load would repeat one run already (the load's own resolution) or exceed
    ``most`` sessions."""
    if found.upper == math.inf:
        load = 2 * max(loads.values())
    elif found.lower == 0:
        load = min(loads.values()) // 2
    elif found.resolution <= resolution:
        return None
    else:
        load = round(math.sqrt(loads[found.lower] * loads[found.upper]))
    if load < 1 or load > most or load in loads.values():
        return None
    return load


def run_load(args: argparse.Namespace, sessions: int, arms: list[str]) -> Path:
    """One ``bench_fleet.py`` run of ``arms`` with ``sessions`` agent sessions; its results file."""
    shape = replace(AgentShape(), sessions=sessions, steps=args.steps, session_gap_s=START_WINDOW_S / sessions)
    trace = args.out_dir / f"agent-s{sessions}.jsonl"
    trace.write_text(to_jsonl(agent_trace(shape)))
    out: Path = args.out_dir / f"fleet-agent-{args.workers}-s{sessions}-{'+'.join(arms)}.json"
    command = [
        sys.executable,
        *("-m", "benchmarks.bench_fleet"),
        *("--trace", str(trace), "--workers", str(args.workers), "--max-requests", "100000"),
        *("--tokens-per-hash", "128", "--speedup", "1", "--arms", ",".join(arms), "--json", str(out)),
    ]
    print(f"[live_goodput] {sessions} sessions: {', '.join(arms)}", flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    return out


def points_of(runs: list[dict[str, Any]], arm: str) -> list[dict[str, Any]]:
    """``arm``'s points over ``runs`` (each ``{"sessions", "file"}`` with its results), by rate."""
    found = []
    for run in runs:
        row = run["results"].get(arm)
        if row is not None:
            found.append(
                {
                    "sessions": run["sessions"],
                    "offered_rps": row["offered_rps"],
                    "attainment": row["slo_attainment"],
                    "mean_ttft_ms": row["ttft_mean_s"] * 1e3,
                    "file": run["file"],
                }
            )
    return sorted(found, key=lambda p: p["offered_rps"])


def arm_bounds(points: list[dict[str, Any]]) -> GoodputBounds:
    return bounds([SweepPoint(p["offered_rps"], p["attainment"]) for p in points])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16, help="mocker workers")
    parser.add_argument("--sessions", default="16,32,64", help="the grid: agent sessions per run")
    parser.add_argument("--steps", type=int, default=20, help="steps a session")
    parser.add_argument("--arms", default="dynamo_kv,dynamo_kv_tuned,kvpilot", help="bench_fleet.py arms")
    parser.add_argument("--resolution", type=float, default=0.05, help="a bracket's width over its lower end")
    parser.add_argument("--max-runs", type=int, default=5, help="runs an arm alone may add to the grid")
    parser.add_argument("--most-sessions", type=int, default=512, help="never run more sessions than this")
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/kvpilot-live-goodput"))
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-live-goodput.json"))
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    if "kvpilot" not in arms or len(arms) < 2:
        parser.error("--arms: kvpilot and at least one arm to hold it against")

    def record(sessions: int, path: Path) -> dict[str, Any]:
        return {"sessions": sessions, "file": path.name, "results": json.loads(path.read_text())}

    runs = [record(s, run_load(args, s, arms)) for s in sorted(int(s) for s in args.sessions.split(","))]
    for arm in arms:
        for _ in range(args.max_runs):
            points = points_of(runs, arm)
            load = next_load(
                {p["offered_rps"]: p["sessions"] for p in points},
                arm_bounds(points),
                args.resolution,
                args.most_sessions,
            )
            if load is None:
                break
            runs.append(record(load, run_load(args, load, [arm])))
    found = {arm: arm_bounds(points_of(runs, arm)) for arm in arms}
    others = [a for a in arms if a != "kvpilot"]
    result = {
        "live_goodput": {arm: {**found[arm].as_dict(), "points": points_of(runs, arm)} for arm in arms},
        "at_least": {a: at_least(found["kvpilot"], found[a]) for a in others},
        "resolution": args.resolution,
        "workers": args.workers,
        "run": {"argv": recorded_argv()},
        "provenance": provenance(),
    }
    args.json.write_text(json.dumps(result, indent=2))
    print(describe(result["provenance"]))
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    """Each arm's goodput bracket and its points; kvpilot's ratio against each arm as the
    brackets support it."""
    lines = [
        "| arm | goodput req/s | sessions: offered req/s, SLO attainment (mean TTFT ms) |",
        "|---|---:|---|",
    ]
    for arm, found in result["live_goodput"].items():
        upper = found["upper"]
        bracket = f"at least {found['lower']:.1f}" if upper is None else f"[{found['lower']:.1f}, {upper:.1f})"
        bracket += "" if found["monotone"] else " *"
        cells = "; ".join(
            f"{p['sessions']}: {p['offered_rps']:.1f}, {p['attainment']:.3f} ({p['mean_ttft_ms']:.0f})"
            for p in found["points"]
        )
        lines.append(f"| {arm} | {bracket} | {cells} |")
    ratios = "; ".join(
        f"against {arm}: " + (f"at least {r:.2f}x" if r is not None else "no ratio (it never missed)")
        for arm, r in result["at_least"].items()
    )
    return (
        f"The agent on {result['workers']} mocker workers, judged at the client; brackets bisected to "
        f"{result['resolution']:.0%} where closed; * marks an arm that met the SLOs again above its first miss. "
        f"kvpilot's goodput {ratios}.\n\n" + "\n".join(lines)
    )
