"""The agent benchmark's judged repeats: each headline figure's median and range per
arm, the ratios on the medians, the thread binding's share of the (c)-(e) gap, and
the JSON's shape."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from agent.bench import at_load
from agent.output import finite, headline_table, result_json
from agent.results import ArmResult, BenchConfig, Outcome, Run, StepCounters, judge_run

from kvpilot.deploy.client import Completion

GENERATED = 4
STEPS = 2


def config(tmp_path: Path, repeats: int) -> BenchConfig:
    return BenchConfig(
        sessions=1,
        steps=STEPS,
        prefix_tokens=10,
        tool_tokens=5,
        generated=GENERATED,
        editing_sessions=0,
        edit_steps=None,
        seed=1,
        arms="ace",
        repeats=repeats,
        handicap_arm=True,
        tolerance=0.03,
        ttft_slo=1.0,
        tpot_slo=0.1,
        request_timeout=10.0,
        warm_up_timeout=10.0,
        settle=0.0,
        out=tmp_path / "out.json",
        plot=tmp_path / "plot.png",
    )


def completion(logprob: float = -1.0) -> Completion:
    return Completion("wxyz", ("w", "x", "y", "z"), (logprob, -1.0, -1.0, -1.0), 0.0, 0.0, token_ids=(5, 6, 7, 8))


def arm(key: str, computed: float, latency: float, wrong: bool = False) -> ArmResult:
    """One repeat: each step computes ``computed`` on D and takes ``latency``; with
    ``wrong``, step 2's output is off the reference by 0.5 in logprob."""
    result = ArmResult(key, f"({key})")
    for step in range(1, STEPS + 1):
        out = completion(-1.5 if wrong and step == 2 else -1.0)
        result.outcomes.append(Outcome(0, step, latency, out))
        result.steps[step] = StepCounters({"P": 0.0, "D": computed}, 0.0, 0.0, 1e6, 1.0, 0.01, {})
    return result


@pytest.fixture
def run(tmp_path: Path) -> Run:
    r = Run(config(tmp_path, repeats=3), tmp_path, "test")
    r.reference = {(0, k): completion() for k in range(1, STEPS + 1)}
    r.noise["calibration"] = {"max": 0.0, "token_flips": 0}
    r.results = {
        "a": [arm("a", 100.0, 0.5), arm("a", 120.0, 0.7), arm("a", 90.0, 0.6)],
        "c": [arm("c", 40.0, 3.0, wrong=True), arm("c", 50.0, 5.0), arm("c", 30.0, 1.0)],
        "e": [arm("e", 10.0, 0.2), arm("e", 12.0, 0.3), arm("e", 11.0, 0.25)],
        "f": [arm("f", 40.0, 1.0), arm("f", 44.0, 2.0), arm("f", 30.0, 0.8)],
    }
    r.schedule = "1: N[a c] K[e] B[f]"
    return r


def test_each_figure_is_the_median_of_the_repeats_with_its_range(run: Run) -> None:
    judged = judge_run(run)
    c = judged.summaries["c"]
    assert c["repeats"] == 3
    assert c["prefill_computed"] == 80.0  # steps x median(40, 50, 30)
    assert c["spread"]["prefill_computed"] == {"median": 80.0, "min": 60.0, "max": 100.0, "values": [80, 100, 60]}
    ttft = c["spread"]["ttft_p50_step2"]
    assert ttft["values"] == pytest.approx([3.0 - 0.03, 5.0 - 0.03, 1.0 - 0.03])  # latency - (G-1) x TPOT
    assert c["ttft_p50_step2"] == pytest.approx(3.0 - 0.03)
    assert c["spread"]["wrong"]["values"] == [1.0, 0.0, 0.0]
    assert c["wrong"] == 0.0  # the median: one repeat of three was wrong
    assert [s["wrong"] for s in c["per_repeat"]] == [1, 0, 0]
    assert judged.summaries["e"]["slo_met"] == 2.0  # TTFT <= 1 s and TPOT <= 0.1 s, both steps
    assert judged.summaries["c"]["spread"]["slo_met"]["values"] == [0.0, 0.0, 2.0]


def test_ratios_are_taken_on_the_medians(run: Run) -> None:
    ratios = judge_run(run).ratios
    assert ratios["prefill_a_over_e"] == pytest.approx(200.0 / 22.0)
    assert math.isnan(ratios["prefill_b_over_e"])  # (b) did not run
    assert ratios["slo_met_e_over_c"] == math.inf  # (c)'s median SLO-met is 0


def test_the_handicap_is_c_minus_f_and_its_share_of_c_minus_e(run: Run) -> None:
    handicap = judge_run(run).handicap
    row = handicap["ttft_p50_step1"]
    assert row["binding"] == pytest.approx(row["c"] - row["f"])
    assert row["c"] == pytest.approx(2.97) and row["f"] == pytest.approx(0.97) and row["e"] == pytest.approx(0.22)
    assert row["explained"] == pytest.approx(2.0 / 2.75)
    assert set(handicap) == {"prefill_computed", "kv_bytes", "ttft_p50_step1", "ttft_p50_step2", "wrong", "slo_met"}
    assert math.isnan(handicap["kv_bytes"]["explained"])  # no gap to explain


def test_no_handicap_without_f(run: Run) -> None:
    del run.results["f"]
    assert judge_run(run).handicap == {}


def test_the_json_holds_medians_spreads_repeats_and_the_order(run: Run) -> None:
    judged = judge_run(run)
    run.timings["total"] = 1.0
    out = json.loads(json.dumps(finite(result_json(run, judged))))
    assert out["schedule"] == "1: N[a c] K[e] B[f]"
    assert out["config"]["repeats"] == 3
    for key in "acef":
        summary = out["summaries"][key]
        assert isinstance(summary["prefill_computed"], float)  # what `kvpilot agent --measured` reads
        assert len(summary["per_repeat"]) == 3 and summary["repeats"] == 3
        assert set(summary["spread"]["ttft_p50_step1"]) == {"median", "min", "max", "values"}
        assert len(out["per_step"][key]) == 3 and len(out["requests"][key]) == 3
        assert len(out["requests"][key][0]) == STEPS
    assert out["handicap"]["kv_bytes"]["explained"] is None  # NaN as strict JSON


def test_the_table_gives_each_median_with_its_range(run: Run) -> None:
    judged = judge_run(run)
    table = headline_table(judged.summaries, judged.report_steps, 2)
    row = next(line for line in table.splitlines() if line.startswith("| (c)"))
    assert "| 3 | 80 (60-100) |" in row
    assert "2.97 (0.97-4.97)" in row


def test_without_arm_a_the_default_slos_come_from_the_first_arm_by_letter_not_the_first_to_run(
    run: Run,
) -> None:
    run.config = dataclasses.replace(run.config, ttft_slo=None, tpot_slo=None)
    run.results = {"e": run.results["e"], "c": run.results["c"]}  # (e) ran first in this shuffle
    summary = judge_run(run)
    assert summary.tpot_slo == pytest.approx(1.5 * 0.01)  # both arms' steps: the median TPOT is 0.01
    c_ttft = judge_run(dataclasses.replace(run, results={"c": run.results["c"]})).ttft_slo
    assert summary.ttft_slo == pytest.approx(c_ttft)
    e_ttft = judge_run(dataclasses.replace(run, results={"e": run.results["e"]})).ttft_slo
    assert e_ttft != pytest.approx(c_ttft)


def test_each_load_of_a_sweep_runs_the_same_benchmark_at_its_session_count_into_its_own_files(tmp_path: Path) -> None:
    swept = dataclasses.replace(config(tmp_path, 1), sessions=4, editing_sessions=1, sessions_sweep=(1, 2))
    one = at_load(swept, 1)
    assert (one.sessions, one.editing_sessions, one.steps, one.arms) == (1, 1, STEPS, "ace")
    assert (one.out, one.plot) == (tmp_path / "out-s1.json", tmp_path / "plot-s1.png")
    assert (one.ttft_slo, one.tpot_slo) == (swept.ttft_slo, swept.tpot_slo)
    assert at_load(dataclasses.replace(swept, editing_sessions=0), 2).editing_sessions == 0
