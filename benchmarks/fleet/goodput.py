"""Goodput as DistServe defines it, from a rate sweep: the highest request rate at which
at least :data:`ATTAINMENT` of the requests meet both the TTFT and the ITL SLO. Pure.

A request meets the SLOs when it completed, its TTFT is at most its limit and its ITL
(:attr:`fleet_results.Outcome.itl`; none for a one-token answer) at most ``itl_s``; a
failed request misses them. The limits are absolute (one TTFT for every request) or
scale-free (:meth:`Slo.scale_free`: :data:`TTFT_SLO_X` times each request's floor, its TTFT
alone on an idle worker holding every block it could reuse, and :data:`ITL_SLO_X` times an
idle worker's), so that fleets of any speed, simulated or live, are judged alike. Rates are
offered rates (requests over the arrival span), not achieved ones, so an arm that falls
behind is not credited with the rate it was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleet.results import Outcome

ATTAINMENT = 0.9
"""DistServe's SLO attainment target: 90% of requests within both SLOs."""
TTFT_SLO_X = 5.0
"""A scale-free TTFT SLO: this many times the request's floor."""
ITL_SLO_X = 2.0
"""A scale-free ITL SLO: this many times an idle worker's."""


@dataclass(frozen=True, slots=True)
class Slo:
    """Both SLOs: one TTFT limit for every request, or one per request (by its index), and
    one ITL limit, in seconds."""

    ttft_s: float | tuple[float, ...]
    itl_s: float

    @classmethod
    def scale_free(cls, floor_ttft_s: Sequence[float], idle_itl_s: float) -> Slo:
        """:data:`TTFT_SLO_X` times each request's floor (by index) and :data:`ITL_SLO_X`
        times ``idle_itl_s``."""
        return cls(tuple(TTFT_SLO_X * f for f in floor_ttft_s), ITL_SLO_X * idle_itl_s)

    @property
    def per_request(self) -> bool:
        """Whether each request has a TTFT limit of its own (:meth:`scale_free`)."""
        return isinstance(self.ttft_s, tuple)

    def ttft_limit(self, index: int) -> float:
        """Request ``index``'s TTFT limit."""
        return self.ttft_s[index] if isinstance(self.ttft_s, tuple) else self.ttft_s


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
        if o.ok and ttft is not None and ttft <= slo.ttft_limit(o.index) and (itl is None or itl <= slo.itl_s):
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
