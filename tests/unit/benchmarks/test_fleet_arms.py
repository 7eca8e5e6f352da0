from __future__ import annotations

from pathlib import Path

from fleet_arms import SESSION_AFFINITY_FLAGS, TUNED_DISAGG_FLAGS, TUNED_FLAGS, ArmName, arms

from deploy.dynamo_spec import DynamoFleetSpec, FrontendRouting


def test_the_four_arms_in_order_each_on_the_same_fleet_with_its_own_routing():
    base = DynamoFleetSpec(Path("/m"), Path("/r"), workers=4, speedup_ratio=3.0)
    chosen = arms(disaggregated=False)
    assert [a.name for a in chosen] == list(ArmName)
    specs = {a.name: a.spec(base) for a in chosen}
    assert {n: s.frontend_routing for n, s in specs.items()} == {
        ArmName.DYNAMO_ROUND_ROBIN: FrontendRouting.ROUND_ROBIN,
        ArmName.DYNAMO_KV: FrontendRouting.KV,
        ArmName.DYNAMO_KV_TUNED: FrontendRouting.KV,
        ArmName.KVPILOT: FrontendRouting.DIRECT,
    }
    assert all((s.workers, s.speedup_ratio) == (4, 3.0) for s in specs.values())  # the same workers
    assert specs[ArmName.DYNAMO_KV].frontend_flags == ()  # Dynamo's defaults
    assert specs[ArmName.DYNAMO_KV_TUNED].frontend_flags == TUNED_FLAGS
    assert [n for n, s in specs.items() if s.kvpilot_routes] == [ArmName.KVPILOT]


def test_the_tuned_arm_has_the_flags_of_its_fleet_or_those_it_is_given():
    def tuned(disaggregated: bool, flags: tuple[str, ...] | None = None) -> tuple[str, ...]:
        return next(a for a in arms(disaggregated, flags) if a.name is ArmName.DYNAMO_KV_TUNED).frontend_flags

    assert tuned(True) == TUNED_DISAGG_FLAGS and "--router-track-output-blocks" not in tuned(True)
    assert tuned(False) == TUNED_FLAGS
    assert tuned(True, ("--router-temperature", "0.1")) == ("--router-temperature", "0.1")


def test_on_a_trace_that_names_sessions_the_tuned_arm_binds_them_and_only_it():
    chosen = {a.name: a.frontend_flags for a in arms(disaggregated=False, sessions=True)}
    assert chosen[ArmName.DYNAMO_KV_TUNED] == TUNED_FLAGS + SESSION_AFFINITY_FLAGS
    assert chosen[ArmName.DYNAMO_KV] == () and chosen[ArmName.KVPILOT] == ()
    given = ("--router-temperature", "0.1")
    assert next(a for a in arms(False, given, True) if a.name is ArmName.DYNAMO_KV_TUNED).frontend_flags == given
