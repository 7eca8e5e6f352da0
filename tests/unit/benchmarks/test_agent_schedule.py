"""The agent benchmark's run order: every arm once per repeat, each fleet started once
per repeat with only its own arms, shuffled by the seed; and the spread of a figure."""

from __future__ import annotations

import math

import pytest

from benchmarks.agent.schedule import Spread, describe, plan

ARMS = {"N": ["a", "b", "c", "d"], "K": ["e"], "B": ["f"]}


def test_every_repeat_runs_every_arm_once_each_on_its_own_fleet_started_once() -> None:
    repeats = plan(ARMS, 5, seed=7)
    assert [r.index for r in repeats] == [1, 2, 3, 4, 5]
    for r in repeats:
        assert sorted(run.fleet for run in r.fleets) == ["B", "K", "N"]
        assert sorted(r.order()) == ["a", "b", "c", "d", "e", "f"]
        for run in r.fleets:
            assert sorted(run.arms) == sorted(ARMS[run.fleet])


def test_a_fleet_without_arms_is_not_started() -> None:
    repeats = plan({"N": ["b"], "K": ["e"], "B": []}, 2, seed=1)
    assert all(sorted(run.fleet for run in r.fleets) == ["K", "N"] for r in repeats)


def test_the_order_is_the_seeds_and_the_seed_shuffles_it() -> None:
    assert plan(ARMS, 3, seed=11) == plan(ARMS, 3, seed=11)
    orders = {tuple(tuple(r.order()) for r in plan(ARMS, 3, seed=seed)) for seed in range(20)}
    assert len(orders) > 10
    firsts = {r.order()[0] for seed in range(20) for r in plan(ARMS, 3, seed=seed)}
    assert firsts == {"a", "b", "c", "d", "e", "f"}  # no arm always runs first


def test_at_least_one_repeat() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan(ARMS, 0, seed=1)


def test_describe_names_each_fleet_start_and_its_arms_in_order() -> None:
    line = describe(plan({"N": ["a", "b"], "K": ["e"]}, 2, seed=3))
    assert line.startswith("1: ") and "; 2: " in line
    for part in line.split("; "):
        assert "N[" in part and "K[e]" in part


def test_spread_is_the_median_and_range_of_the_known_values() -> None:
    s = Spread.of([3.0, 1.0, 10.0, 2.0])
    assert (s.median, s.low, s.high, s.values) == (2.5, 1.0, 10.0, (3.0, 1.0, 10.0, 2.0))
    with_nan = Spread.of([math.nan, 4.0, 2.0])
    assert (with_nan.median, with_nan.low, with_nan.high) == (3.0, 2.0, 4.0)
    assert len(with_nan.values) == 3
    assert all(math.isnan(x) for x in (Spread.of([]).median, Spread.of([math.nan]).high))
    assert Spread.of([5.0]).as_json() == {"median": 5.0, "min": 5.0, "max": 5.0, "values": [5.0]}
