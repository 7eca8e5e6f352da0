"""Goodput from a sweep: SLO attainment per run, and the highest rate that met it."""

from __future__ import annotations

from benchmarks.fleet.goodput import ITL_SLO_X, TTFT_SLO_X, Slo, SweepPoint, attainment, goodput
from benchmarks.fleet.results import Outcome

SLO = Slo(ttft_s=0.1, itl_s=0.01)


def test_a_request_meets_the_slos_only_when_both_hold_and_it_completed() -> None:
    fast = Outcome(0, sent=0.0, first_token=0.05, last_token=0.15, output_tokens=11)  # itl 0.01
    slow_first = Outcome(1, sent=0.0, first_token=0.2, last_token=0.3, output_tokens=11)
    slow_decode = Outcome(2, sent=0.0, first_token=0.05, last_token=1.05, output_tokens=11)
    one_token = Outcome(3, sent=0.0, first_token=0.05, last_token=0.05, output_tokens=1)
    failed = Outcome(4, sent=0.0, first_token=None, last_token=None, output_tokens=0, error="503")
    assert attainment([fast, slow_first, slow_decode, one_token, failed], SLO) == 2 / 5
    assert attainment([], SLO) == 0.0


def test_goodput_is_the_highest_rate_below_the_first_that_failed() -> None:
    points = [SweepPoint(4.0, 0.95), SweepPoint(1.0, 1.0), SweepPoint(8.0, 0.5), SweepPoint(16.0, 0.92)]
    assert goodput(points) == 4.0
    assert goodput([SweepPoint(1.0, 0.89)]) == 0.0


def test_scale_free_slos_judge_each_request_by_its_own_floor() -> None:
    slo = Slo.scale_free(floor_ttft_s=[0.01, 0.1], idle_itl_s=0.004)
    assert slo.itl_s == ITL_SLO_X * 0.004
    # 0.2 s is within 5x of the second request's floor, not of the first's.
    first = Outcome(0, sent=0.0, first_token=0.2, last_token=0.26, output_tokens=11)
    second = Outcome(1, sent=0.0, first_token=0.2, last_token=0.26, output_tokens=11)
    assert TTFT_SLO_X * 0.01 < 0.2 <= TTFT_SLO_X * 0.1
    assert attainment([first, second], slo) == 1 / 2
    too_slow_decode = Outcome(1, sent=0.0, first_token=0.2, last_token=0.2 + 10 * 0.009, output_tokens=11)
    assert attainment([too_slow_decode], slo) == 0.0


def test_the_live_bisection_widens_an_open_bracket_and_splits_a_closed_one() -> None:
    from benchmarks.fleet.bisect import next_load
    from benchmarks.fleet.goodput import GoodputBounds

    loads = {5.2: 16, 10.5: 32, 22.4: 64}
    assert next_load(loads, GoodputBounds(22.4, float("inf"), True), 0.05, 512) == 128  # never missed: twice the top
    assert next_load(loads, GoodputBounds(22.4, float("inf"), True), 0.05, 100) is None  # past the most sessions
    assert next_load(loads, GoodputBounds(0.0, 5.2, False), 0.05, 512) == 8  # missed from the start: half the lowest
    assert next_load(loads, GoodputBounds(5.2, 10.5, True), 0.05, 512) == 23  # the loads' geometric middle
    assert next_load({5.2: 16, 5.4: 17}, GoodputBounds(5.2, 5.4, True), 0.05, 512) is None  # narrow enough
    assert next_load({5.2: 16, 6.0: 17}, GoodputBounds(5.2, 6.0, True), 0.05, 512) is None  # no load between
