"""Starting and stopping fleets from tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from deploy import fleet as fleet_io
from deploy.fleet_spec import FleetSpec


@contextmanager
def running_fleet(spec: FleetSpec) -> Iterator[fleet_io.Fleet]:
    started = fleet_io.up(spec, timeout=600)
    try:
        yield started
    finally:
        fleet_io.down(spec.run_dir)
