"""A sweep's goodput as :mod:`benchmarks.sim.goodput` reads it from its rows: each arm's
bracket (:func:`arm_bounds`), the arm kvpilot is held against (:func:`best_dynamo_arm`) and
kvpilot's ratios to it (:func:`ratios`). Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.fleet.goodput import GoodputBounds, SweepPoint, at_least, bounds


def arm_bounds(rows: Sequence[dict[str, Any]]) -> GoodputBounds:
    """The goodput bracket of one arm's rows (:func:`benchmarks.fleet.goodput.bounds`)."""
    return bounds([SweepPoint(r["rate_rps"], r["attainment"]) for r in rows])


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
