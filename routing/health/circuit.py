"""Per-worker circuit breaker: stop routing to a worker that keeps failing. Pure;
the caller passes the clock.

``failures_to_open`` consecutive failures open a worker's circuit: it is not routed
to for ``open_s`` seconds. Then it is half-open: traffic goes to it again, the
first success closes the circuit and the first failure opens it for another
``open_s``. A failure is the engine's fault only (no answer, a timeout, a 5xx); a
4xx is the client's and is not counted. ``failures_to_open == 0`` disables it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.routing.ids import WorkerId


@dataclass
class _Circuit:
    consecutive_failures: int = 0
    open_until: float | None = None


class CircuitBreaker:
    def __init__(self, failures_to_open: int = 3, open_s: float = 10.0) -> None:
        if failures_to_open < 0 or open_s <= 0:
            raise ValueError("failures_to_open must be >= 0 and open_s > 0")
        self.failures_to_open, self.open_s = failures_to_open, open_s
        self._circuits: dict[WorkerId, _Circuit] = {}

    def allows(self, worker: WorkerId, now: float) -> bool:
        """Whether ``worker`` may be routed to at ``now`` (closed or half-open)."""
        circuit = self._circuits.get(worker)
        return circuit is None or circuit.open_until is None or now >= circuit.open_until

    def succeeded(self, worker: WorkerId) -> bool:
        """Record a success; True if it closed an open (half-open) circuit."""
        circuit = self._circuits.pop(worker, None)
        return circuit is not None and circuit.open_until is not None

    def failed(self, worker: WorkerId, now: float) -> bool:
        """Record a failure; True if it opened the circuit."""
        if not self.failures_to_open:
            return False
        circuit = self._circuits.setdefault(worker, _Circuit())
        circuit.consecutive_failures += 1
        half_open = circuit.open_until is not None
        if half_open or circuit.consecutive_failures >= self.failures_to_open:
            circuit.open_until = now + self.open_s
            return True
        return False
