"""Starting and stopping fleets from tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from deploy import fleet as fleet_io
from deploy.fleet_spec import FleetSpec

# Away from the demo's defaults (8000/8100/5600), so a running demo does not collide.
E2E_PORTS = {"engine_port": 8310, "side_channel_port": 5710, "events_port": 6310, "router_port": 8300}


@contextmanager
def running_fleet(spec: FleetSpec) -> Iterator[fleet_io.Fleet]:
    started = fleet_io.up(spec, timeout=600)
    try:
        yield started
    finally:
        fleet_io.down(spec.run_dir)
