from __future__ import annotations

from pathlib import Path

from benchmarks.fleet.arms import SESSION_FLAGS, TUNED_DISAGG_FLAGS, TUNED_FLAGS, ArmName, arms
from kvpilot.deploy.dynamo_spec import DynamoFleetSpec, FrontendRouting


def test_the_arms_in_order_each_on_the_same_fleet_with_its_own_routing():
    base = DynamoFleetSpec(Path("/m"), Path("/r"), workers=4, speedup_ratio=3.0)
    chosen = arms(disaggregated=False)
    assert [a.name for a in chosen] == list(ArmName)
    specs = {a.name: a.spec(base) for a in chosen}
    assert {n: s.frontend_routing for n, s in specs.items()} == {
        ArmName.DYNAMO_ROUND_ROBIN: FrontendRouting.ROUND_ROBIN,
        ArmName.DYNAMO_KV: FrontendRouting.KV,
        ArmName.DYNAMO_KV_TUNED: FrontendRouting.KV,
        ArmName.DYNAMO_KV_ENVOY: FrontendRouting.KV,
        ArmName.KVPILOT: FrontendRouting.DIRECT,
        ArmName.KVPILOT_NATIVE: FrontendRouting.DIRECT,
        ArmName.KVPILOT_RELAY: FrontendRouting.DIRECT,
    }
    assert all((s.workers, s.speedup_ratio) == (4, 3.0) for s in specs.values())  # the same workers
    assert specs[ArmName.DYNAMO_KV].frontend_flags == ()  # Dynamo's defaults
    assert specs[ArmName.DYNAMO_KV_TUNED].frontend_flags == TUNED_FLAGS
    envoy_tuned = specs[ArmName.DYNAMO_KV_ENVOY]  # the tuned router behind the same Envoy, a fixed route
    assert envoy_tuned.frontend_flags == TUNED_FLAGS and envoy_tuned.gateway is not None
    assert envoy_tuned.gateway.fixed_upstream == f"127.0.0.1:{base.frontend_port}"
    assert envoy_tuned.client_url.endswith(f":{base.gateway_port}")
    assert [n for n, s in specs.items() if s.kvpilot_routes] == [
        ArmName.KVPILOT,
        ArmName.KVPILOT_NATIVE,
        ArmName.KVPILOT_RELAY,
    ]
    assert [n for n, s in specs.items() if s.native_picker] == [ArmName.KVPILOT_NATIVE]
    assert specs[ArmName.KVPILOT].gateway is not None and specs[ArmName.KVPILOT_RELAY].gateway is None
    assert specs[ArmName.KVPILOT].client_url.endswith(f":{base.gateway_port}")  # clients talk to Envoy
    assert specs[ArmName.KVPILOT_RELAY].client_url.endswith(f":{base.router_port}")


def test_the_tuned_arm_has_the_flags_of_its_fleet_or_those_it_is_given():
    def tuned(disaggregated: bool, flags: tuple[str, ...] | None = None) -> tuple[str, ...]:
        return next(a for a in arms(disaggregated, flags) if a.name is ArmName.DYNAMO_KV_TUNED).frontend_flags

    assert tuned(True) == TUNED_DISAGG_FLAGS and "--router-track-output-blocks" not in tuned(True)
    assert tuned(False) == TUNED_FLAGS
    assert tuned(True, ("--router-temperature", "0.1")) == ("--router-temperature", "0.1")


def test_on_a_trace_that_names_sessions_dynamo_s_tuned_arm_spreads_and_pins_and_kvpilot_runs_its_defaults():
    chosen = {a.name: a for a in arms(disaggregated=False, sessions=True)}
    assert chosen[ArmName.DYNAMO_KV_TUNED].frontend_flags == TUNED_FLAGS + SESSION_FLAGS
    assert chosen[ArmName.KVPILOT].router_cost == ()  # its own session terms
    assert chosen[ArmName.DYNAMO_KV].frontend_flags == () and chosen[ArmName.KVPILOT].frontend_flags == ()
    given = ("--router-temperature", "0.1")
    assert next(a for a in arms(False, given, True) if a.name is ArmName.DYNAMO_KV_TUNED).frontend_flags == given
    cost = (("objective", "predicted_ttft"),)
    assert (
        next(a for a in arms(False, None, True, cost) if a.name is ArmName.KVPILOT)
        .spec(DynamoFleetSpec(Path("/m"), Path("/r"), workers=2))
        .router_cost
        == cost
    )
    assert all(not a.router_cost for a in arms(disaggregated=False))  # no sessions: defaults
