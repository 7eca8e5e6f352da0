"""The pool planner (section 10.1): pools per regime and the four lessons."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvpilot.policies.planner import REGIMES, Workload, plan, render
from kvpilot.policies.presets import hardware_preset, link_preset, model_preset
from kvpilot.policies.specs import SpecError

M = model_preset("llama-70b")
HW = hardware_preset("b200x2")
PCIE = link_preset("pcie")
PLAN = plan(M, HW, PCIE)


@pytest.mark.parametrize(
    ("key", "d_memory", "d_tpot", "d"),
    [
        ("none", 5, 2, 5),
        ("prefix", 5, 2, 5),
        ("session", 5, 2, 5),  # residency, not compute, sizes D
        ("fp8", 3, 1, 3),  # FP8 roughly halves D
        ("offload", 3, 2, 3),  # so does offloading idle sessions
        ("dedup", 2, 2, 2),  # dedup cuts it by nearly two-thirds
        ("consolidated", 1, 2, 2),  # fits in one, but misses TPOT there
        ("cascade", 1, 1, 1),  # a cascade kernel fixes the bandwidth
        ("nvfp4", 1, 1, 1),
    ],
)
def test_d_pool_per_regime(key: str, d_memory: int, d_tpot: int, d: int) -> None:
    row = PLAN.row(key)
    assert (row.d_by_memory, row.d_by_tpot, row.d_instances) == (d_memory, d_tpot, d)


def test_p_pool_depends_on_caching_not_on_kv_format() -> None:
    assert PLAN.row("session").p_instances == PLAN.row("fp8").p_instances == PLAN.row("dedup").p_instances
    assert PLAN.row("prefix").p_instances / PLAN.row("session").p_instances == pytest.approx(9.5, rel=0.05)


def test_all_four_lessons_hold_and_are_rendered() -> None:
    assert [lesson.holds for lesson in PLAN.lessons] == [True] * 4
    text = render(PLAN)
    for i, lesson in enumerate(PLAN.lessons, 1):
        assert f"{i}. {lesson.title} [holds]" in text
    for regime in REGIMES:
        assert regime.label in text
    assert "23.5x and 9.5x less" in text


@pytest.mark.parametrize(
    ("change", "lesson", "holds"),
    [
        # short chats: little to cache, so caching cannot move P by 10x
        ({"shared_prefix_tokens": 500, "tool_output_tokens": 3_000, "steps": 2}, 0, False),
        # a few sessions and no tool wait: residency no longer exceeds the decode limit
        ({"sessions": 8, "tool_seconds": 0.0}, 1, False),
        # a TPOT target below the weight pass cannot be met by any number of instances
        ({"tpot_target_s": 0.008}, 1, False),
        # a near-instant tool: P's short prefill cannot hide a full-session restore
        ({"tool_output_tokens": 100, "output_tokens": 50}, 2, False),
    ],
)
def test_lessons_can_fail_for_other_workloads(change: dict[str, float], lesson: int, holds: bool) -> None:
    other = plan(M, HW, PCIE, dataclasses.replace(Workload(), **change))
    assert other.lessons[lesson].holds is holds
    assert "DOES NOT HOLD here" in render(other)


def test_json_round_trips() -> None:
    data = json.loads(json.dumps(PLAN.to_dict()))
    assert [r["key"] for r in data["rows"]] == [r.key for r in REGIMES]
    assert data["rows"][2]["d_instances"] == 5
    assert len(data["lessons"]) == 4
    assert data["steps_per_s"] == pytest.approx(7.6, rel=0.05)


def test_subset_of_regimes_has_no_lessons() -> None:
    assert plan(M, HW, PCIE, regimes=REGIMES[:2]).lessons == ()


@pytest.mark.parametrize(
    ("field", "value"), [("sessions", 0), ("steps", -1), ("tool_seconds", -1.0), ("tpot_target_s", 0.0)]
)
def test_bad_workload_names_the_field(field: str, value: float) -> None:
    with pytest.raises(SpecError) as err:
        Workload(**{field: value})
    assert err.value.key == field


def test_session_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        plan(M, HW, PCIE, Workload(shared_prefix_tokens=1_000_000))
