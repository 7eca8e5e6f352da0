"""What the router does when a request's prefill on P failed (:func:`recover`; article
section 8.6, from the router's side).

D can take the prefill itself, but a prefill on an instance tuned for decode delays
every other stream on it; kvpilot's ``budgeted`` mode lets D do so only while the delay
it inflicts fits a jitter budget (per window, in stream-seconds, tracked by
:class:`JitterWindow`) and no single stream stalls longer than ``max_stall_s``.

A KV load that fails on D itself is not decided here: vLLM's scheduler applies the
engine's ``kv_load_failure_policy`` (``fail`` or ``recompute``) to every failed load,
with no connector hook between the failure and that choice.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Literal

FailureMode = Literal["fail", "recompute", "budgeted"]
JITTER_WINDOW_S = 10.0
"""The window over which a decode worker's jitter budget (``jitter_budget_s``) is spent."""


@dataclass(frozen=True, slots=True)
class FailurePolicyConfig:
    """``mode``: whether D may prefill a failed handoff itself (``recompute``: always,
    ``fail``: never, ``budgeted``: within the two bounds below); ``jitter_budget_s``:
    stream-seconds of delay D's local prefills may inflict per window; ``max_stall_s``:
    the longest step any one stream may see."""

    mode: FailureMode = "budgeted"
    jitter_budget_s: float = 2.0
    max_stall_s: float = 0.05


KVPILOT_DEFAULT = FailurePolicyConfig()


class Recovery(enum.Enum):
    """What the router does with a request whose prefill on P failed (an error, a
    timeout, a stalled or expired transfer)."""

    OTHER_PREFILL = "other_prefill"  # another prefill worker prefills it, D pulls from there
    LOCAL = "local"  # D prefills it itself
    FAIL = "fail"  # answered at once with an error naming why


@dataclass(frozen=True, slots=True)
class RecoveryCosts:
    """A failed prefill's ways on: D prefilling it (``local_s``, its TTFT from now, and
    ``stall_s``, the pause it adds to each of D's ``running_streams``), another prefill
    worker doing it (``other_prefill_s``; ``None``: no other is available), and the
    stream-seconds of jitter D's local prefills already imposed in the budget's window."""

    local_s: float
    stall_s: float
    running_streams: int
    other_prefill_s: float | None
    jitter_spent_s: float = 0.0

    @property
    def jitter_s(self) -> float:
        """The stream-seconds of delay D's local prefill would impose."""
        return self.stall_s * self.running_streams


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    action: Recovery
    reason: str


def recover(costs: RecoveryCosts, config: FailurePolicyConfig = KVPILOT_DEFAULT) -> RecoveryDecision:
    """Decide, live on measured costs, how a request whose prefill failed is served
    (article section 8.6, from the router's side):

    - D may prefill it when the mode allows (``recompute`` always, ``fail`` never,
      ``budgeted`` while no stream stalls past ``max_stall_s`` and the jitter stays within
      ``jitter_budget_s``; an idle D stalls nothing);
    - another prefill worker takes it when one is available and it is predicted sooner than
      D's local prefill priced with its stall on every running stream (or D may not);
    - else the request fails at once with the reason: no engine is left to wait on.
    """
    c = config
    priced_local_s = costs.local_s + costs.jitter_s
    if c.mode == "fail":
        local_ok, why = False, "mode is fail: D never prefills a failed handoff"
    elif not costs.jitter_s or c.mode == "recompute":
        local_ok, why = True, "mode is recompute" if costs.jitter_s else "D stalls no stream"
    elif costs.stall_s > c.max_stall_s:
        local_ok, why = (
            False,
            (
                f"a local prefill would stall D's {costs.running_streams} streams "
                f"{costs.stall_s * 1e3:.1f} ms > {c.max_stall_s * 1e3:.0f} ms"
            ),
        )
    elif costs.jitter_spent_s + costs.jitter_s > c.jitter_budget_s:
        local_ok, why = (
            False,
            (
                f"D's jitter {costs.jitter_spent_s:.2f} + {costs.jitter_s:.2f} stream-s exceeds "
                f"the budget {c.jitter_budget_s:.2f}"
            ),
        )
    else:
        local_ok, why = (
            True,
            f"within D's budget ({costs.jitter_spent_s + costs.jitter_s:.2f} of {c.jitter_budget_s:.2f} stream-s)",
        )
    other = costs.other_prefill_s
    if other is not None and (not local_ok or other <= priced_local_s):
        return RecoveryDecision(
            Recovery.OTHER_PREFILL,
            f"another prefill worker: {other * 1e3:.1f} ms vs local {priced_local_s * 1e3:.1f} ms "
            f"with its stall ({why})",
        )
    if local_ok:
        return RecoveryDecision(Recovery.LOCAL, f"local prefill on D: {priced_local_s * 1e3:.1f} ms ({why})")
    return RecoveryDecision(Recovery.FAIL, f"no other prefill worker, and {why}")


class JitterWindow:
    """The stream-seconds of delay each decode worker's local prefills imposed on its
    running streams within the last ``window_s`` seconds. No I/O and no clock of its own:
    the caller passes ``now``. Not pure: :meth:`charge` records a charge, and :meth:`spent`
    drops the charges older than the window before it sums the rest."""

    def __init__(self, window_s: float = JITTER_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._charges: dict[str, deque[tuple[float, float]]] = {}

    def charge(self, worker: str, stream_seconds: float, now: float) -> None:
        if stream_seconds > 0:
            self._charges.setdefault(worker, deque()).append((now, stream_seconds))

    def spent(self, worker: str, now: float) -> float:
        """``worker``'s stream-seconds charged within ``window_s`` before ``now`` (0 for a
        worker never charged); forgets its charges older than that."""
        charges = self._charges.get(worker)
        if not charges:
            return 0.0
        while charges and charges[0][0] <= now - self.window_s:
            charges.popleft()
        return sum(seconds for _, seconds in charges)
