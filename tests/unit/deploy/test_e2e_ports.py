"""tests.fakes.ports: the e2e modules' fleets, planned as kvpilot.deploy.fleet_spec plans
them, never share a port, and none lies where unit tests or the kernel pick theirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.deploy.fleet_spec import FleetSpec, ProcessPlan, plan_fleet
from kvpilot.deploy.observe import ObserveSpec, plan_observe
from tests.fakes.ports import (
    E2E_BLOCK_SIZE,
    E2E_MODULES,
    ENGINES_PER_FLEET,
    FLEETS_PER_BLOCK,
    SPARE_PORTS,
    UNIT_PORTS,
    block_of,
)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return 32768  # Linux's default


def _fleet_plans(spec: FleetSpec) -> list[ProcessPlan]:
    engines, router, _ = plan_fleet(spec)
    return [*engines, router]


def _largest_fleet(module: str, slot: int) -> FleetSpec:
    half = ENGINES_PER_FLEET // 2
    return FleetSpec(
        model_dir=Path("/m"), run_dir=Path("/r"), prefill=half, decode=half, **block_of(module).fleet(slot)
    )


def _listening(plans: list[ProcessPlan]) -> list[int]:
    return [port for plan in plans for port in (plan.port, *plan.side_ports)]


def test_every_e2e_module_owns_a_block() -> None:
    assert "tests.e2e.conftest" in E2E_MODULES and "tests.e2e.test_lifecycle" in E2E_MODULES
    assert not {"tests.e2e.fleets", "tests.e2e.scenarios", "tests.e2e.sessions", "tests.e2e.__init__"} & set(
        E2E_MODULES
    )
    with pytest.raises(ValueError, match="owns no port block"):
        block_of("tests.e2e.fleets")


def test_no_two_ports_of_all_modules_fleets_and_spares_meet() -> None:
    owner: dict[int, str] = {}
    for module in E2E_MODULES:
        block = block_of(module)
        mine = {
            f"fleet {slot}": _listening(_fleet_plans(_largest_fleet(module, slot))) for slot in range(FLEETS_PER_BLOCK)
        }
        mine["spare"] = [block.spare(i) for i in range(SPARE_PORTS)]
        for what, ports in mine.items():
            for port in ports:
                assert block.first <= port < block.first + E2E_BLOCK_SIZE, (module, what, port)
                assert port not in owner, f"{module} {what} and {owner[port]} both use {port}"
                owner[port] = f"{module} {what}"
    assert max(owner) < UNIT_PORTS.start and UNIT_PORTS.stop <= _ephemeral_start()


def test_prometheus_on_the_first_spare_port_keeps_its_exporters_on_spare_ports() -> None:
    block = block_of(E2E_MODULES[-1])
    spec = _largest_fleet(E2E_MODULES[-1], FLEETS_PER_BLOCK - 1)
    engines, router, _ = plan_fleet(spec)
    observed, prometheus, _ = plan_observe(ObserveSpec(port=block.spare(0)), spec.run_dir, engines, router)
    added = set(_listening([*observed, prometheus])) - set(_listening(engines))
    assert len(added) == 1 + len(engines)
    assert added <= {block.spare(i) for i in range(SPARE_PORTS)}


def test_slots_and_spares_outside_a_block_are_refused() -> None:
    block = block_of(E2E_MODULES[0])
    with pytest.raises(ValueError, match="fleets 0 to"):
        block.fleet(FLEETS_PER_BLOCK)
    with pytest.raises(ValueError, match="spare ports 0 to"):
        block.spare(SPARE_PORTS)
