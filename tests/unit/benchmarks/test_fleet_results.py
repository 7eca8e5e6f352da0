from __future__ import annotations

import math

import pytest

from benchmarks.fleet.results import REQUIRED_KEYS, Outcome, ReuseCounts, reuse_from_computed, summarize


def test_ttft_and_itl_of_one_request():
    o = Outcome(0, sent=1.0, first_token=1.25, last_token=2.25, output_tokens=5)
    assert o.ok and o.ttft == pytest.approx(0.25) and o.itl == pytest.approx(0.25)
    assert Outcome(0, 1.0, 1.5, 1.5, 1).itl is None  # one token: no gap between tokens
    failed = Outcome(1, 1.0, None, None, 0, error="HTTP 500")
    assert not failed.ok and failed.ttft is None and failed.itl is None


def test_an_arm_summary_holds_every_required_key_and_counts_failures():
    outcomes = [
        Outcome(0, 0.0, 0.1, 1.1, 11),
        Outcome(1, 0.5, 0.8, 1.8, 11, queued_s=0.2),
        Outcome(2, 1.0, None, None, 0, error="HTTP 500: boom"),
        Outcome(3, 1.5, 1.9, 3.9, 21),
    ]
    summary = summarize(outcomes, ReuseCounts(1000, 250), {"frontend": 2.0, "router": 1.0}, {"arm": "x"})
    assert set(REQUIRED_KEYS) <= set(summary)
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["errors"] == {"HTTP 500: boom": 1}
    assert summary["ttft_mean_s"] == pytest.approx((0.1 + 0.3 + 0.4) / 3)
    assert summary["ttft_p50_s"] == pytest.approx(0.3)
    assert summary["itl_mean_s"] == pytest.approx(0.1)
    assert summary["throughput_rps"] == pytest.approx(3 / 3.9)  # first send at 0, last token at 3.9
    assert summary["prefix_reuse"] == pytest.approx(0.25)
    assert summary["cpu_s_per_request"] == {"frontend": 0.5, "router": 0.25}
    assert summary["client_queued_mean_s"] == pytest.approx(0.05)
    assert summary["arm"] == "x"


def test_the_p99_is_the_tail_and_no_counts_give_nan():
    outcomes = [Outcome(i, 0.0, 0.01 if i < 99 else 1.0, 0.02, 2) for i in range(100)]
    summary = summarize(outcomes, ReuseCounts(0, 0), {})
    assert summary["ttft_p99_s"] == pytest.approx(0.01 + 0.01 * 0.99)  # interpolated towards the one slow request
    assert summary["ttft_p50_s"] == pytest.approx(0.01)
    assert math.isnan(summary["prefix_reuse"])


def test_reuse_from_the_workers_kv_events_counts_the_full_blocks_no_worker_computed():
    # 3 requests of 100 tokens, block size 32: 3 full blocks each (9), 4-token tails always computed
    counts = reuse_from_computed(input_tokens=300, full_blocks=9, computed_blocks=5, block_size=32)
    assert counts.cached_tokens == 4 * 32 and counts.reuse == pytest.approx(128 / 300)
    assert reuse_from_computed(300, 9, 9, 32).reuse == 0.0
    assert math.isnan(reuse_from_computed(0, 0, 0, 32).reuse)  # nothing completed: no reuse to speak of
