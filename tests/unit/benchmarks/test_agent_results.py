"""The agent benchmark's judged repeats: each headline figure's median and range per
arm, wrong outputs and ties judged by the calibration's noise, the ratios on the
medians, the thread binding's share of the (c)-(e) gap, and the JSON's shape."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks.agent.bench import at_load
from benchmarks.agent.correctness import Verdict
from benchmarks.agent.output import finite, headline_table, result_json, results_table
from benchmarks.agent.results import ArmResult, BenchConfig, Outcome, Run, StepCounters, calibration_noise, judge_run
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
        ttft_slo=1.0,
        tpot_slo=0.1,
        request_timeout=10.0,
        warm_up_timeout=10.0,
        settle=0.0,
        out=tmp_path / "out.json",
        plot=tmp_path / "plot.png",
    )


NOISE = 0.02
"""The calibration's largest max |logprob diff|."""
MARGINS = (1.0, 1.0, 0.01, 1.0)
"""The reference's top-2 margin at each token: token 2 is a near-tie."""


def completion(token_ids: tuple[int, ...] = (5, 6, 7, 8), logprob: float = -1.0) -> Completion:
    return Completion(
        "wxyz", ("w", "x", "y", "z"), (logprob, -1.0, -1.0, -1.0), 0.0, 0.0, token_ids=token_ids, top2_margins=MARGINS
    )


WRONG = completion((5, 9, 7, 8))
"""Token 1 flipped, where the reference led by 1.0: wrong."""
TIE = completion((5, 6, 9, 8))
"""Token 2 flipped, where the reference led by 0.01: a tie."""


def arm(key: str, computed: float, latency: float, step2: Completion | None = None) -> ArmResult:
    """One repeat: each step computes ``computed`` on D and takes ``latency``; step 2
    answers ``step2`` (default: the reference's answer)."""
    result = ArmResult(key, f"({key})")
    for step in range(1, STEPS + 1):
        out = step2 if step2 is not None and step == 2 else completion()
        result.outcomes.append(Outcome(0, step, latency, out))
        result.steps[step] = StepCounters({"P": 0.0, "D": computed}, 0.0, 0.0, 1e6, 1.0, 0.01, {})
    return result


@pytest.fixture
def run(tmp_path: Path) -> Run:
    r = Run(config(tmp_path, repeats=3), tmp_path, "test")
    r.reference = {(0, k): completion() for k in range(1, STEPS + 1)}
    r.noise["calibration"] = {
        "max_diff": {"n": 2, "p50": 0.01, "p90": 0.02, "p99": 0.02, "max": NOISE},
        "token_flips": 1,
    }
    r.results = {
        "a": [arm("a", 100.0, 0.5), arm("a", 120.0, 0.7, TIE), arm("a", 90.0, 0.6)],
        "c": [arm("c", 40.0, 3.0, WRONG), arm("c", 50.0, 5.0, completion(logprob=-1.5)), arm("c", 30.0, 1.0)],
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


def test_a_flip_where_the_reference_led_beyond_the_noise_is_wrong_and_within_it_a_tie(run: Run) -> None:
    judged = judge_run(run)
    wrong, tie = run.results["c"][0].outcomes[1], run.results["a"][1].outcomes[1]
    assert (wrong.verdict, wrong.first_mismatch, wrong.margin) == (Verdict.WRONG, 1, 1.0)
    assert (tie.verdict, tie.first_mismatch, tie.margin) == (Verdict.TIE, 2, 0.01)
    c, a = judged.summaries["c"], judged.summaries["a"]
    assert [s["wrong"] for s in c["per_repeat"]] == [1, 0, 0]  # 0.5 off in logprob, every token the same: right
    assert [s["ties"] for s in a["per_repeat"]] == [0, 1, 0] and [s["wrong"] for s in a["per_repeat"]] == [0, 0, 0]
    assert c["per_repeat"][0]["wrong_at"] == [(0, 2)]
    assert c["max_diff"] == {"n": 6, "p50": 0.0, "p90": 0.25, "p99": pytest.approx(0.475), "max": 0.5}
    assert [s["max_diff"]["max"] for s in c["per_repeat"]] == [0.0, 0.5, 0.0]


def test_the_noise_judged_by_is_the_calibration_s_largest_diff(run: Run) -> None:
    run.noise["calibration"]["max_diff"]["max"] = 1.0  # the reference's lead at the flip, 1.0, is within it
    judge_run(run)
    assert run.results["c"][0].outcomes[1].verdict is Verdict.TIE


def test_the_calibration_s_noise_is_the_distribution_of_its_diffs_and_its_flips(run: Run) -> None:
    calib = arm("calibration", 0.0, 0.1, TIE)
    calib.outcomes += [
        Outcome(1, 1, 0.1, completion(logprob=-1.25)),
        Outcome(1, 2, 0.1, None, error="refused"),
    ]
    run.reference[(1, 1)] = completion()
    noise = calibration_noise(calib, run.reference)
    assert noise == {"max_diff": {"n": 3, "p50": 0.0, "p90": 0.2, "p99": 0.245, "max": 0.25}, "token_flips": 1}


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
    assert set(handicap) == {
        "prefill_computed",
        "kv_bytes",
        "ttft_p50_step1",
        "ttft_p50_step2",
        "wrong",
        "ties",
        "slo_met",
    }
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
    assert out["requests"]["c"][0][1] | {"latency": 0} == {
        "session": 0,
        "step": 2,
        "latency": 0,
        "ttft": pytest.approx(3.0 - 0.03),
        "verdict": "wrong",
        "first_mismatch": 1,
        "margin": 1.0,
        "max_diff": 0.0,
        "error": None,
        "route": None,
        "p_seconds": None,
    }
    assert out["handicap"]["kv_bytes"]["explained"] is None  # NaN as strict JSON


def test_the_table_gives_each_median_with_its_range(run: Run) -> None:
    judged = judge_run(run)
    table = headline_table(judged.summaries, judged.report_steps, 2)
    row = next(line for line in table.splitlines() if line.startswith("| (c)"))
    assert "| 3 | 80 (60-100) |" in row
    assert "2.97 (0.97-4.97)" in row


def test_the_results_table_gives_ties_and_each_arm_s_diffs_beside_wrong_and_the_calibration_s_noise(run: Run) -> None:
    judged = judge_run(run)
    run.timings["total"] = 1.0
    results = json.loads(json.dumps(finite(result_json(run, judged))))
    table, note = results_table(results).split("\n\n")
    head, rule, *rows = table.splitlines()
    assert "| wrong | ties | max logprob diff p50 / p99 / max |" in head
    assert len(rule.split("|")) == len(head.split("|"))
    c = next(row for row in rows if row.startswith("| (c)"))
    assert "| 0 (0-1) | 0 (0-0) | 0.0000 / 0.4750 / 0.5000 |" in c
    a = next(row for row in rows if row.startswith("| (a)"))
    assert "| 0 (0-0) | 0 (0-1) | 0.0000 / 0.0000 / 0.0000 |" in a
    assert "exceeds the noise, 0.0200" in note and "p50 0.0100, p90 0.0200, p99 0.0200, max 0.0200" in note


def test_a_results_file_judged_by_a_logprob_tolerance_is_rendered_by_that_rule(run: Run) -> None:
    judged = judge_run(run)
    run.timings["total"] = 1.0
    results = json.loads(json.dumps(finite(result_json(run, judged))))
    results["tolerance"] = 0.03
    results["noise"] = {"calibration": {"max": 0.0306, "median": 0.0157, "token_flips": 6}}
    table, note = results_table(results).split("\n\n")
    assert "| wrong (diff > 0.03) | SLO met (of 2) |" in table and "ties" not in table
    assert "cannot be judged on tokens" in note and "max 0.0306" in note


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
