"""The bound on one read of a peer's KV: past it the read is abandoned and its blocks
are recomputed (:mod:`kvpilot.kvconnectors.worker`). Pure: no clock, no vLLM.

::

    bound = max(floor_s, nbytes / rate * factor)

``rate`` is this engine's measured link rate (bytes over seconds of its recent whole
pulls, each timed from the request's wait to the worker's report, so a handshake is
in it), or none before the first: the floor alone then. ``factor`` leaves room for a
link slower than its recent past; ``floor_s`` covers a first handshake and a step's
wait for the worker's report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.policies.recompute_vs_transfer import TransferSample

READ_DEADLINE_FLOOR_S = 10.0
"""The least time a read is given (a NIXL handshake with a new peer is in it)."""
READ_DEADLINE_FACTOR = 8.0
"""How many times its measured duration a read may take before it is abandoned."""


@dataclass(frozen=True, slots=True)
class DeadlineRule:
    """``floor_s`` and ``factor`` of the bound; both positive (``ValueError`` otherwise)."""

    floor_s: float = READ_DEADLINE_FLOOR_S
    factor: float = READ_DEADLINE_FACTOR

    def __post_init__(self) -> None:
        if not (self.floor_s > 0 and self.factor > 0):
            raise ValueError(f"a read deadline needs floor_s > 0 and factor > 0, got {self.floor_s}, {self.factor}")

    def bound_s(self, nbytes: float, rate_bytes_per_s: float | None) -> float:
        """Seconds a read of ``nbytes`` may take at ``rate_bytes_per_s`` (``None`` or 0:
        unmeasured, the floor)."""
        if not rate_bytes_per_s or rate_bytes_per_s <= 0:
            return self.floor_s
        return max(self.floor_s, nbytes / rate_bytes_per_s * self.factor)


def measured_rate(pulls: Iterable[TransferSample]) -> float | None:
    """Bytes per second over ``pulls`` taken together (their bytes over their seconds);
    ``None`` for none."""
    nbytes = seconds = 0.0
    for sample in pulls:
        nbytes += sample.nbytes
        seconds += sample.seconds
    return nbytes / seconds if seconds > 0 and nbytes > 0 else None
