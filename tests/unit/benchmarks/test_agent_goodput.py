"""Goodput on the closed-loop agent benchmark: each load's rate and attainment, and the highest passing rate."""

from __future__ import annotations

import pytest

from benchmarks.agent.goodput import LoadPoint, goodput, load_point, table
from benchmarks.agent.results import ArmResult, Outcome, StepCounters


def _result(requests_per_step: int, walls: list[float]) -> ArmResult:
    result = ArmResult("e", "kvpilot")
    for step, wall in enumerate(walls, 1):
        result.steps[step] = StepCounters({}, 0.0, 0.0, 0.0, 0.0, None, wall=wall)
        result.outcomes += [Outcome(s, step, wall, None) for s in range(requests_per_step)]
    return result


def test_a_point_s_rate_is_its_requests_over_its_steps_wall_time_median_over_repeats() -> None:
    repeats = [_result(2, [1.0, 1.0]), _result(2, [0.5, 0.5]), _result(2, [2.0, 2.0])]  # 2, 4 and 1 req/s
    point = load_point(2, repeats, slo_met=[4, 2, 3])
    assert point.rate_rps == pytest.approx(2.0)
    assert point.attainment == pytest.approx(0.75)
    with pytest.raises(ValueError, match="SLO-met counts"):
        load_point(2, repeats, slo_met=[4])


def test_goodput_stops_at_the_first_load_that_missed() -> None:
    points = [LoadPoint(1, 1.0, 1.0), LoadPoint(2, 1.8, 0.95), LoadPoint(4, 2.5, 0.5), LoadPoint(8, 3.0, 0.92)]
    assert goodput(points) == 1.8
    assert goodput(list(reversed(points))) == 1.8  # ordered by load, not as given
    assert goodput([LoadPoint(1, 1.0, 0.89)]) == 0.0
    # a heavier load that passes at a lower rate does not lower what a lighter one showed
    assert goodput([LoadPoint(1, 2.0, 1.0), LoadPoint(2, 1.5, 0.9)]) == 2.0


def test_the_table_has_a_cell_per_load_and_the_goodput() -> None:
    text = table(
        {"e": [LoadPoint(1, 1.0, 1.0), LoadPoint(2, 1.8, 0.5)], "c": [LoadPoint(1, 0.5, 0.5)]}, {"e": "(e) kv"}
    )
    assert "| (e) kv | 1.00 | 1.00, 1.00 | 1.80, 0.50 |" in text
    assert "| c | 0.00 | 0.50, 0.50 | - |" in text
