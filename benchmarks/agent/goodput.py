"""Goodput on the agent workload, as DistServe defines it (the highest request rate at
which :data:`fleet_goodput.ATTAINMENT` of requests meet both the TTFT and the TPOT SLO),
from a sweep of the load: ``bench_agent.py --sessions-sweep 1,2,4``. Pure.

The agent benchmark is closed-loop: its sessions step in lockstep, each step's requests
sent together, the next step once all are answered. Its load is the number of sessions,
and the request rate at a load is what the arm achieved there: its requests over the
summed wall time of its steps (the scrapes and the settle between steps left out, the
same harness time for every arm). A point meets the SLOs when the share of its requests
that were correct, within the TTFT SLO and on a step whose D TPOT was within the TPOT
SLO (``agent_results``' SLO-met requests) is at least the attainment target. An arm's
goodput is the highest rate among its points at loads up to the first one that missed:
a rate that passes above a load that failed is noise, not capacity (as
:func:`fleet_goodput.goodput`). Where the sweep repeats an arm, each point is the
median over its repeats.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.agent.results import ArmResult
from benchmarks.fleet.goodput import ATTAINMENT


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One arm at one load."""

    sessions: int
    rate_rps: float
    """Requests per second of the steps' wall time (median over repeats)."""
    attainment: float
    """SLO-met requests over requests (median over repeats)."""

    def meets(self) -> bool:
        return self.attainment >= ATTAINMENT


def load_point(sessions: int, repeats: Sequence[ArmResult], slo_met: Sequence[int]) -> LoadPoint:
    """An arm's point at ``sessions`` from its repeats' results and each repeat's SLO-met
    count, in the same order. Raises ValueError for no repeats or a count per repeat missing."""
    if not repeats or len(repeats) != len(slo_met):
        raise ValueError(f"{len(repeats)} repeats and {len(slo_met)} SLO-met counts")
    rates, shares = [], []
    for result, met in zip(repeats, slo_met, strict=True):
        wall = sum(step.wall for step in result.steps.values())
        requests = len(result.outcomes)
        rates.append(requests / wall if wall > 0 else 0.0)
        shares.append(met / requests if requests else 0.0)
    return LoadPoint(sessions, statistics.median(rates), statistics.median(shares))


def goodput(points: Sequence[LoadPoint]) -> float:
    """The highest rate among the points at loads below the first that missed the
    attainment target (by sessions); 0.0 when the lightest missed."""
    best = 0.0
    for point in sorted(points, key=lambda p: p.sessions):
        if not point.meets():
            break
        best = max(best, point.rate_rps)
    return best


def table(points_by_arm: Mapping[str, Sequence[LoadPoint]], titles: Mapping[str, str]) -> str:
    """Per arm (by its title, else its key), each load's rate and attainment, and the goodput (markdown)."""
    loads = sorted({p.sessions for points in points_by_arm.values() for p in points})
    head = "| arm | goodput req/s | " + " | ".join(f"{s} sessions: req/s, SLO met" for s in loads) + " |"
    lines = [head, "|---|---:|" + "---|" * len(loads)]
    for key, points in points_by_arm.items():
        by_load = {p.sessions: p for p in points}
        cells = [f"{by_load[s].rate_rps:.2f}, {by_load[s].attainment:.2f}" if s in by_load else "-" for s in loads]
        lines.append(f"| {titles.get(key, key)} | {goodput(points):.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
