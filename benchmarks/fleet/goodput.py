"""Goodput as DistServe defines it, from a rate sweep: the highest request rate at which
at least :data:`ATTAINMENT` of the requests meet both the TTFT and the ITL SLO. Pure.

A request meets the SLOs when it completed, its TTFT is at most ``ttft_s`` and its ITL
(:attr:`fleet_results.Outcome.itl`; none for a one-token answer) at most ``itl_s``; a
failed request misses them. Rates are offered rates (requests over the arrival span),
not achieved ones, so an arm that falls behind is not credited with the rate it was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleet.results import Outcome

ATTAINMENT = 0.9
"""DistServe's SLO attainment target: 90% of requests within both SLOs."""


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One arm's run at one offered rate."""

    offered_rps: float
    attainment: float


def attainment(outcomes: Sequence[Outcome], slo: Slo) -> float:
    """The fraction of ``outcomes`` that met both SLOs (0 without outcomes)."""
    if not outcomes:
        return 0.0
    met = 0
    for o in outcomes:
        ttft, itl = o.ttft, o.itl
        if o.ok and ttft is not None and ttft <= slo.ttft_s and (itl is None or itl <= slo.itl_s):
            met += 1
    return met / len(outcomes)


def goodput(points: Sequence[SweepPoint]) -> float:
    """The highest offered rate whose run, and every slower one, met :data:`ATTAINMENT`;
    0.0 when the slowest did not. A rate that passes above one that failed is not counted
    (a sweep's noise, not capacity)."""
    best = 0.0
    for point in sorted(points, key=lambda p: p.offered_rps):
        if point.attainment < ATTAINMENT:
            break
        best = point.offered_rps
    return best
