"""The agent benchmark's run order, and the median and spread of its repeats. Pure.

Each repeat starts every fleet it needs afresh, one fleet at a time, and runs that
fleet's arms one after the other: no arm shares the box with another arm, and no
repeat inherits another's cache. Within a repeat the order of the fleets and the
order of the arms on each fleet are shuffled, from ``random.Random(seed)`` drawn in
repeat order, so no arm always runs first on a fresh fleet, or last on a tired box.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FleetRun:
    """One start of a fleet within a repeat and the arms it serves, in order."""

    fleet: str
    arms: tuple[str, ...]


@dataclass(frozen=True)
class Repeat:
    """One repeat: the fleets in the order they start."""

    index: int
    """1-based."""
    fleets: tuple[FleetRun, ...]

    def order(self) -> list[str]:
        """The repeat's arms in the order they run."""
        return [arm for run in self.fleets for arm in run.arms]


def plan(arms_by_fleet: Mapping[str, Sequence[str]], repeats: int, seed: int) -> list[Repeat]:
    """``repeats`` repeats of every arm of ``arms_by_fleet`` (fleet -> its arms; a
    fleet with none is not started), each repeat's fleet order and per-fleet arm
    order shuffled by ``seed``. Raises ``ValueError`` for ``repeats`` < 1."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rng = random.Random(seed)
    fleets = [name for name, arms in arms_by_fleet.items() if arms]
    out: list[Repeat] = []
    for index in range(1, repeats + 1):
        order = list(fleets)
        rng.shuffle(order)
        runs = []
        for name in order:
            arms = list(arms_by_fleet[name])
            rng.shuffle(arms)
            runs.append(FleetRun(name, tuple(arms)))
        out.append(Repeat(index, tuple(runs)))
    return out


def describe(repeats: Iterable[Repeat]) -> str:
    """The plan in one line, as the run prints it: ``1: N[b a] K[e]; 2: ...``."""
    return "; ".join(
        f"{r.index}: " + " ".join(f"{run.fleet}[{' '.join(run.arms)}]" for run in r.fleets) for r in repeats
    )


@dataclass(frozen=True)
class Spread:
    """One figure over an arm's repeats: the median and its range."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]
    """Per repeat, in repeat order."""

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values``; a NaN (a repeat without that figure, e.g. no
        request of a step completed) is kept in :attr:`values` but left out of the
        median and range, which are NaN when no value is left."""
        known = [v for v in values if not math.isnan(v)]
        if not known:
            return cls(math.nan, math.nan, math.nan, tuple(values))
        return cls(statistics.median(known), min(known), max(known), tuple(values))

    def as_json(self) -> dict[str, object]:
        return {"median": self.median, "min": self.low, "max": self.high, "values": list(self.values)}
