"""Starting and stopping fleets from tests, and the one fleet that modules share."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.fleet_spec import FleetSpec

START_TIMEOUT_S = 600.0


@contextmanager
def running_fleet(spec: FleetSpec) -> Iterator[fleet_io.Fleet]:
    started = fleet_io.up(spec, timeout=START_TIMEOUT_S)
    try:
        yield started
    finally:
        fleet_io.down(spec.run_dir)


def _where(spec: FleetSpec) -> dict[str, object]:
    """The fields that say where a fleet runs, not what it runs."""
    return {
        "run_dir": spec.run_dir,
        "engine_port": spec.engine_port,
        "side_channel_port": spec.side_channel_port,
        "events_port": spec.events_port,
        "router_port": spec.router_port,
    }


class SharedFleet:
    """At most one fleet at a time, kept up across the modules that ask for the same one.

    :meth:`get` returns the running fleet when it runs what ``spec`` asks for (wherever it
    runs: its run directory and ports are those of the module that started it) and every
    process of it answers its health check, else stops it and starts ``spec``. A module
    that shares must leave the fleet as it found it (a module that stops an engine runs
    last in its group) and use its own prompts; a module that starts its own fleet calls
    :meth:`stop` first (``tests/e2e/conftest.py`` does).
    """

    def __init__(self) -> None:
        self._spec: FleetSpec | None = None
        self._fleet: fleet_io.Fleet | None = None

    def get(self, spec: FleetSpec) -> tuple[FleetSpec, fleet_io.Fleet]:
        """The running fleet and the spec it was started from (for restarts)."""
        current, running = self._spec, self._fleet
        if (
            current is not None
            and running is not None
            and dataclasses.replace(spec, **_where(current)) == current
            and all(fleet_io.is_healthy(p.url, path=p.health) for p in running.processes)
        ):
            return current, running
        self.stop()
        self._fleet = fleet_io.up(spec, timeout=START_TIMEOUT_S)
        self._spec = spec
        return spec, self._fleet

    def stop(self) -> None:
        if self._spec is not None:
            fleet_io.down(self._spec.run_dir)
        self._spec, self._fleet = None, None
