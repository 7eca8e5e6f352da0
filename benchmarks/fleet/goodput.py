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

from benchmarks.fleet.results import Outcome

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
    (:attr:`GoodputBounds.monotone` says whether there was one)."""
    return bounds(points).lower


@dataclass(frozen=True, slots=True)
class GoodputBounds:
    """What a sweep knows of one arm's goodput: it lies in [:attr:`lower`, :attr:`upper`)."""

    lower: float
    """The highest rate that met :data:`ATTAINMENT` with every slower one (0.0: none)."""
    upper: float
    """The slowest rate that missed it (``inf``: none did, the goodput is not bounded above)."""
    monotone: bool
    """False when a rate above :attr:`upper` met it again: the arm's attainment is not
    monotone in the load, and its goodput is stated with that rate beside it."""

    @property
    def resolution(self) -> float:
        """The bracket's width over its lower end (``inf`` when open or at zero)."""
        return (self.upper - self.lower) / self.lower if self.lower > 0 else float("inf")

    def as_dict(self) -> dict[str, float | bool | None]:
        """As a results file records it (``upper`` ``None`` when open above)."""
        return {
            "lower": self.lower,
            "upper": None if self.upper == float("inf") else self.upper,
            "monotone": self.monotone,
        }


def bounds(points: Sequence[SweepPoint]) -> GoodputBounds:
    """The bracket of :func:`goodput` from a sweep's ``points`` (any order)."""
    ordered = sorted(points, key=lambda p: p.offered_rps)
    lower, upper = 0.0, float("inf")
    for point in ordered:
        if point.attainment < ATTAINMENT:
            upper = point.offered_rps
            break
        lower = point.offered_rps
    monotone = not any(p.offered_rps > upper and p.attainment >= ATTAINMENT for p in ordered)
    return GoodputBounds(lower, upper, monotone)


def at_least(ours: GoodputBounds, theirs: GoodputBounds) -> float | None:
    """The ratio of two goodputs that both brackets support: our lower end over their upper
    end; ``None`` when theirs is open above (they never missed: nothing to claim)."""
    if theirs.upper == float("inf"):
        return None
    return ours.lower / theirs.upper


def at_most(ours: GoodputBounds, theirs: GoodputBounds) -> float:
    """The largest ratio the brackets allow: our upper end over their lower end (``inf``
    when ours is open above or theirs is zero)."""
    return ours.upper / theirs.lower if theirs.lower > 0 else float("inf")
