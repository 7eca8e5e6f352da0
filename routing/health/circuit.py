"""Per-worker circuit breaker: stop routing to a worker that keeps failing. Pure;
the caller passes the clock.

``failures_to_open`` consecutive failures open a worker's circuit: it is not routed
to for ``open_s`` seconds. Then it is half-open: one request at a time goes to it
(the probe, booked by :meth:`CircuitBreaker.dispatched`); the probe's success closes
the circuit, its failure opens it for another ``open_s``, and a probe that ends
neither way (the client's 4xx, the client left) lets the next request probe. A probe
that never reports frees the slot after ``open_s``. A failure is the engine's fault
only (no answer, a timeout, a 5xx); a 4xx is the client's and is not counted.
``failures_to_open == 0`` disables it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.routing.ids import WorkerId


@dataclass
class _Circuit:
    consecutive_failures: int = 0
    open_until: float | None = None
    probe_until: float | None = None
    """While half-open: the probe in flight holds the worker until then."""


class CircuitBreaker:
    def __init__(self, failures_to_open: int = 3, open_s: float = 10.0) -> None:
        if failures_to_open < 0 or open_s <= 0:
            raise ValueError("failures_to_open must be >= 0 and open_s > 0")
        self.failures_to_open, self.open_s = failures_to_open, open_s
        self._circuits: dict[WorkerId, _Circuit] = {}

    def allows(self, worker: WorkerId, now: float) -> bool:
        """Whether ``worker`` may be routed to at ``now``: closed, or half-open with no probe in flight."""
        circuit = self._circuits.get(worker)
        if circuit is None or circuit.open_until is None:
            return True
        if now < circuit.open_until:
            return False
        return circuit.probe_until is None or now >= circuit.probe_until

    def barred(self, now: float) -> frozenset[WorkerId]:
        """Every worker :meth:`allows` refuses at ``now``. Reads only the workers with a
        recorded failure (a healthy fleet's are none), so a router asks once per request,
        not once per worker."""
        return frozenset(worker for worker in self._circuits if not self.allows(worker, now))

    def dispatched(self, worker: WorkerId, now: float) -> bool:
        """A request was sent to ``worker``; True if it is the half-open circuit's probe
        (no other request goes to ``worker`` until the probe reports, see the module doc)."""
        circuit = self._circuits.get(worker)
        if circuit is None or circuit.open_until is None or not self.allows(worker, now):
            return False
        circuit.probe_until = now + self.open_s
        return True

    def released(self, worker: WorkerId) -> None:
        """The probe on ``worker`` ended neither answered nor failed by the engine: the next request probes."""
        circuit = self._circuits.get(worker)
        if circuit is not None:
            circuit.probe_until = None

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
        circuit.probe_until = None
        half_open = circuit.open_until is not None
        if half_open or circuit.consecutive_failures >= self.failures_to_open:
            circuit.open_until = now + self.open_s
            return True
        return False
