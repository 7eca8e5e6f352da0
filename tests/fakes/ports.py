"""Loopback ports for the tests, in ranges that cannot meet.

Each e2e module (``tests/e2e/conftest.py`` and every ``tests/e2e/test_*.py``) owns a
block of :data:`E2E_BLOCK_SIZE` ports: block ``i`` of the modules in sorted order,
from :data:`E2E_FIRST_PORT` on (:func:`block_of`). A module's ports follow from its
place among those names, not from what else is collected or in which order, so no
two modules share a port, in one pytest run or across runs, and a fleet that one
module left behind can only block that module. The unit tests' own listeners (ZMQ
sockets, a router process) draw from :data:`UNIT_PORTS` (:func:`free_ports`). Both
lie below the kernel's ephemeral range, which vLLM, UCX and aiohttp's test servers
take ports from by binding port 0.

A block (offsets from its first port; ``F`` = :data:`FLEETS_PER_BLOCK` fleets of up
to ``E`` = :data:`ENGINES_PER_FLEET` engines, ``L = F * E``, ``S`` = :data:`SPARE_PORTS`)::

    [0, L)        routers, one per fleet
    [L, 2L)       engines' HTTP ports, fleet s from L + s * E
    [2L, 3L)      engines' NIXL side channels
    [3L, 4L)      engines' KV-event ports (the router binds them)
    [4L, 4L + S)  spare: the module's own listeners (Prometheus, its NIXL exporters)
    [3L + R, 4L + R)  the engines' replay ports (R: kvpilot.deploy.fleet_spec.REPLAY_PORT_OFFSET)

tests/unit/deploy/test_e2e_ports.py plans every module's fleets and checks that no
two ports meet.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

E2E_FIRST_PORT = 10_000
E2E_BLOCK_SIZE = 200
FLEETS_PER_BLOCK = 2
"""The most fleets one module runs at once (two single-engine fleets, one per model)."""
ENGINES_PER_FLEET = 8
"""The most engines one fleet of a block may have."""
SPARE_PORTS = 32
"""Ports a module may use beside its fleets' (:meth:`PortBlock.spare`)."""
UNIT_PORTS = range(20_000, 30_000)
"""Where :func:`free_ports` draws from: above every e2e block, below the ephemeral range."""

_LANE = FLEETS_PER_BLOCK * ENGINES_PER_FLEET
E2E_DIR = Path(__file__).resolve().parent.parent / "e2e"
E2E_MODULES = tuple(
    sorted(
        f"tests.e2e.{path.stem}"
        for path in E2E_DIR.glob("*.py")
        if path.stem == "conftest" or path.stem.startswith("test_")
    )
)
"""The modules that own a block, in block order."""


class FleetPorts(TypedDict):
    """The port bases of one fleet, as :class:`kvpilot.deploy.fleet_spec.FleetSpec` takes them
    (and as ``kvpilot fleet up`` takes them, as ``--engine-port`` and so on)."""

    engine_port: int
    side_channel_port: int
    events_port: int
    router_port: int


@dataclass(frozen=True, slots=True)
class PortBlock:
    """The :data:`E2E_BLOCK_SIZE` ports from ``first`` on, laid out as the module docstring shows."""

    first: int

    def fleet(self, slot: int = 0) -> FleetPorts:
        """Fleet ``slot``'s ports (``0 <= slot <`` :data:`FLEETS_PER_BLOCK`), for a fleet of up
        to :data:`ENGINES_PER_FLEET` engines. Raises ``ValueError`` for another slot."""
        if not 0 <= slot < FLEETS_PER_BLOCK:
            raise ValueError(f"a block holds fleets 0 to {FLEETS_PER_BLOCK - 1}, not {slot}")
        engines = self.first + _LANE + slot * ENGINES_PER_FLEET
        return FleetPorts(
            engine_port=engines,
            side_channel_port=engines + _LANE,
            events_port=engines + 2 * _LANE,
            router_port=self.first + slot,
        )

    def spare(self, index: int) -> int:
        """Spare port ``index`` (``0 <= index <`` :data:`SPARE_PORTS`), for a listener of the
        module's own; Prometheus on ``spare(0)`` puts its NIXL exporters on ``spare(1)`` on."""
        if not 0 <= index < SPARE_PORTS:
            raise ValueError(f"a block has spare ports 0 to {SPARE_PORTS - 1}, not {index}")
        return self.first + 4 * _LANE + index


def block_of(module: str) -> PortBlock:
    """The block of e2e module ``module`` (its ``__name__``: ``tests.e2e.test_router``).

    Raises ``ValueError`` for a module that is not in :data:`E2E_MODULES`.
    """
    if module not in E2E_MODULES:
        raise ValueError(f"{module} owns no port block: only {', '.join(E2E_MODULES)} do")
    return PortBlock(E2E_FIRST_PORT + E2E_MODULES.index(module) * E2E_BLOCK_SIZE)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports of :data:`UNIT_PORTS` that were free a moment ago (a
    connecting PUB cannot self-connect below the ephemeral range).

    Plain sockets, closed synchronously (a closed ZMQ socket frees its port later).
    """
    rng, socks, ports = random.Random(), [], []
    try:
        while len(ports) < n:
            sock = socket.socket()
            try:
                port = rng.choice(UNIT_PORTS)
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
            ports.append(port)
        return ports
    finally:
        for sock in socks:
            sock.close()
