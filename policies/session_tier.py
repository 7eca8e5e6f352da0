"""Where a session's KV waits between turns (article section 5.3).

Each tier has a restore path (none for HBM), a hold horizon (the longest idle
gap the tier keeps a session under current pressure) and free space. Among
tiers that fit and will still hold the session when it returns, choose the one
with the least *exposed* restore time (restore beyond what hides behind P's
prefill of the new tokens); on a tie take the later, cheaper tier, freeing the
faster memory. If nothing beats recomputing the session, drop its KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.policies.specs import LinkSpec

RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class Tier:
    """``link`` restores to HBM (None: already in HBM); list tiers fastest first."""

    name: str
    link: LinkSpec | None
    hold_s: float
    free_bytes: float = math.inf

    def restore_seconds(self, nbytes: float) -> float:
        return self.link.transfer_seconds(nbytes) if self.link else 0.0


def default_tiers(pcie: LinkSpec, nvme: LinkSpec, shared: LinkSpec) -> tuple[Tier, ...]:
    """HBM (holds a few seconds), host over ``pcie`` (minutes), local disk over
    ``nvme`` (a day), a shared tier over ``shared`` (a month): hold horizons are
    assumptions to be replaced by measured eviction ages."""
    return (
        Tier("hbm", None, hold_s=5.0),
        Tier("host", pcie, hold_s=600.0),
        Tier("disk", nvme, hold_s=86_400.0),
        Tier("shared", shared, hold_s=30 * 86_400.0),
    )


@dataclass(frozen=True, slots=True)
class TierDecision:
    tier: str
    restore_s: dict[str, float]
    exposed_s: dict[str, float]
    recompute_s: float
    expected_gap_s: float
    skipped: tuple[str, ...]

    def explain(self) -> str:
        options = ", ".join(
            f"{name} {self.restore_s[name] * 1e3:.0f} ms (exposed {self.exposed_s[name] * 1e3:.0f})"
            for name in self.restore_s
        )
        skipped = f"; skipped: {', '.join(self.skipped)}" if self.skipped else ""
        return (
            f"{self.tier}: gap {self.expected_gap_s:g} s; restore {options or 'none eligible'}; "
            f"recompute {self.recompute_s * 1e3:.0f} ms{skipped}"
        )


def choose_tier(
    session_bytes: float, expected_gap_s: float, recompute_s: float, tiers: tuple[Tier, ...], overlap_s: float = 0.0
) -> TierDecision:
    """Pick the tier for a session of ``session_bytes`` that returns in
    ``expected_gap_s``; ``overlap_s`` is work the restore can hide behind.
    Returns tier ``"recompute"`` when no eligible tier's exposed restore beats
    ``recompute_s``."""
    restore: dict[str, float] = {}
    exposed: dict[str, float] = {}
    skipped: list[str] = []
    for tier in tiers:
        if session_bytes > tier.free_bytes:
            skipped.append(f"{tier.name} (full)")
        elif expected_gap_s > tier.hold_s:
            skipped.append(f"{tier.name} (holds {tier.hold_s:g} s)")
        else:
            restore[tier.name] = tier.restore_seconds(session_bytes)
            exposed[tier.name] = max(0.0, restore[tier.name] - overlap_s)
    best = RECOMPUTE
    for name, cost in exposed.items():  # later (cheaper) tiers win ties
        if best == RECOMPUTE or cost <= exposed[best]:
            best = name
    if best != RECOMPUTE and exposed[best] >= recompute_s:
        best = RECOMPUTE
    return TierDecision(best, restore, exposed, recompute_s, expected_gap_s, tuple(skipped))
