"""Whether D holds a finished step's KV for the session's next step (the reference article's
sections 5.3 and 9.2): pure.

In vLLM's bidirectional mode D pins every finished request's blocks for a fixed
``decoder_kv_blocks_ttl`` (480 s by default) so that the next step's P may pull them back
(option 2). A pinned block can be neither evicted nor reused: for a session that comes back
after the hold ends (a human's turn, minutes later), the hold bought nothing and cost GPU
memory the whole time. Released, the blocks stay in D's prefix cache, evictable (and in its
host tier where an offloading connector copied them), and the next step finds them there or
is prefilled by the option the router prices then.

So D holds a step's blocks only when the session is expected back within the hold and D's
memory is not under pressure. The expected gap is the median of the session's measured
gaps (a step's arrival minus the previous step's end): an agent's tool calls come back in
seconds, a human's turns in tens of seconds to minutes, and the median follows the mix the
session has shown. The horizon is the shorter of what D holds (its offers state it, less
the margin P's pull needs) and how long the router counts a session as living on its worker.
A session's first step, with no gap measured yet, is held as vLLM holds it.

vLLM reads ``decoder_kv_blocks_ttl`` once per engine (``NixlConnectorScheduler.__init__``)
and stamps it on every hold (``request_finished``), so the hold's length cannot differ per
session; whether there is one can (:data:`kvpilot.kvconnectors.pull_params.HOLD_KEY`).
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


class HoldReason(str, enum.Enum):
    """Why D holds a step's blocks or releases them (the ``reason`` label of the router's metric)."""

    FIRST_STEP = "first_step"
    """No gap measured yet: held, as vLLM holds every step."""
    RETURNS_WITHIN_HOLD = "returns_within_hold"
    """The session's expected gap ends within the horizon: held."""
    OUTLASTS_HOLD = "outlasts_hold"
    """The expected gap outlasts the horizon: released (the hold would end unused)."""
    MEMORY_PRESSURE = "memory_pressure"
    """D's KV usage is at the release threshold: released, so that its blocks stay evictable."""

    @property
    def holds(self) -> bool:
        """Whether D holds the step's blocks for this reason."""
        return self in (HoldReason.FIRST_STEP, HoldReason.RETURNS_WITHIN_HOLD)

    @property
    def verdict(self) -> str:
        """``"hold"`` or ``"release"`` (the ``decision`` label of the router's metric)."""
        return "hold" if self.holds else "release"


@dataclass(frozen=True, slots=True)
class HoldDecision:
    """Hold or release, why, and the figures it was decided on."""

    reason: HoldReason
    expected_gap_s: float | None
    horizon_s: float
    kv_usage: float

    @property
    def hold(self) -> bool:
        """Whether D holds the step's blocks."""
        return self.reason.holds

    def explain(self) -> str:
        gap = "none measured" if self.expected_gap_s is None else f"{self.expected_gap_s:.1f} s"
        return (
            f"{self.reason.verdict} ({self.reason.value}): expected gap {gap}, horizon {self.horizon_s:.1f} s, "
            f"D's KV usage {self.kv_usage:.0%}"
        )


def expected_gap_s(gaps_s: Sequence[float]) -> float | None:
    """The median of a session's measured gaps (``None`` for none)."""
    return statistics.median(gaps_s) if gaps_s else None


def decide_hold(
    gaps_s: Sequence[float], horizon_s: float, kv_usage: float, release_kv_usage: float | None
) -> HoldDecision:
    """Whether D holds the step's blocks: released when D's ``kv_usage`` (fraction of its KV
    blocks in use) is at least ``release_kv_usage`` (``None``: never for pressure), held for
    a session with no gap measured, else held iff the expected gap ends within ``horizon_s``.

    >>> decide_hold([2.0, 3.0, 60.0], horizon_s=25.0, kv_usage=0.4, release_kv_usage=0.9).reason.value
    'returns_within_hold'
    >>> decide_hold([2.0, 60.0, 75.0], horizon_s=25.0, kv_usage=0.4, release_kv_usage=0.9).hold
    False
    """
    expected = expected_gap_s(gaps_s)
    if release_kv_usage is not None and kv_usage >= release_kv_usage:
        reason = HoldReason.MEMORY_PRESSURE
    elif expected is None:
        reason = HoldReason.FIRST_STEP
    elif expected <= horizon_s:
        reason = HoldReason.RETURNS_WITHIN_HOLD
    else:
        reason = HoldReason.OUTLASTS_HOLD
    return HoldDecision(reason, expected, horizon_s, kv_usage)
