"""The TTFT floor: calibration lengths, the fit, each request's floor and the target's reach."""

from __future__ import annotations

import pytest

from benchmarks.fleet.floor import (
    REPEATS,
    Floor,
    calibration_lengths,
    calibration_prompt,
    fit,
    floor_ttfts,
    measure,
    reachable,
)
from benchmarks.fleet.trace import FIRST_ORDINARY_ID, PromptShape, PromptSynth


def _ttft(tokens: int) -> float:
    """A path of 5 ms fixed, 20 us per token and 1 ns per causal attention pair."""
    return 0.005 + 2e-5 * tokens + 1e-9 * tokens * (tokens + 1) / 2


def test_calibration_spans_the_workload_s_new_tokens_shortest_first() -> None:
    lengths = calibration_lengths([100, 200, 300, 400, 10_000])
    assert lengths == sorted(lengths)
    assert set(lengths) == {100, 200, 300, 400, 10_000}
    assert all(lengths.count(n) == REPEATS for n in set(lengths))


def test_calibration_has_a_spread_and_a_minimum_length() -> None:
    assert set(calibration_lengths([5, 5, 5])) == {32, 64}
    with pytest.raises(ValueError, match="no requests"):
        calibration_lengths([])


def test_calibration_prompts_share_no_block_with_the_trace_or_each_other() -> None:
    synth = PromptSynth(PromptShape(seed=7))
    trace_blocks = {tuple(synth.run(h)[i : i + 32]) for h in range(64) for i in range(0, 512, 32)}
    prompts = [calibration_prompt(256, i, 2048, seed=7) for i in range(4)]
    blocks = [tuple(p[i : i + 32]) for p in prompts for i in range(0, 256, 32)]
    assert len(set(blocks)) == len(blocks)
    assert not trace_blocks & set(blocks)
    assert all(FIRST_ORDINARY_ID <= t < 2048 for p in prompts for t in p)
    assert calibration_prompt(256, 3, 2048, seed=7) == prompts[3]


def test_the_fit_recovers_the_path_and_prices_new_tokens_alone() -> None:
    samples = [(n, _ttft(n)) for n in calibration_lengths([64, 512, 2048, 8192, 16384])]
    coefficients = fit(samples)
    assert coefficients == pytest.approx((0.005, 2e-5, 1e-9), rel=1e-6)
    # A request with 8,000 of its 10,000 tokens cached is priced on its 2,000 new ones.
    assert floor_ttfts(coefficients, [2_000]) == pytest.approx([_ttft(2_000)], rel=1e-6)
    floor = measure(samples, [2_000, 10_000], itls=[0.004, 0.009, 0.005])
    assert floor.mean_s == pytest.approx((_ttft(2_000) + _ttft(10_000)) / 2, rel=1e-6)
    assert floor.request_ttft_s == pytest.approx((_ttft(2_000), _ttft(10_000)), rel=1e-6)
    assert floor.idle_itl_s == 0.005


def test_one_length_does_not_determine_a_fit() -> None:
    with pytest.raises(ValueError, match="do not determine"):
        fit([(512, 0.01)] * 6)


@pytest.mark.parametrize(
    ("arm_mean", "expected"),
    [(0.050, True), (0.0375, True), (0.037, False), (0.031, False)],
)
def test_a_target_below_the_floor_is_out_of_reach(arm_mean: float, expected: bool) -> None:
    floor = Floor((0.0, 0.0, 0.0), samples=(), request_ttft_s=(0.020, 0.040))  # mean 0.030
    assert reachable(arm_mean, 0.2, floor) is expected
