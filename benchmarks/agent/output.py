"""The agent benchmark's output: the markdown report on stdout, the plot, the JSON
file (``--out``). Reads a judged :class:`~agent_results.Run`; changes nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.agent import workload as aw
from benchmarks.agent.arms import Kvpilot
from benchmarks.agent.results import STALL_S, TPOT, ArmResult, Run, RunSummary
from benchmarks.provenance import describe, provenance, recorded_argv


def finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as ``None`` (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def fmt_s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def spread_cell(spread: dict[str, Any], fmt: str = ",.0f", scale: float = 1.0) -> str:
    """A median with its range, ``median (min-max)``; the range left out for one repeat."""
    median, low, high = (spread[k] for k in ("median", "min", "max"))
    if median is None or math.isnan(median):
        return "-"
    cell = format(median * scale, fmt)
    if len(spread["values"]) > 1:
        cell += f" ({format(low * scale, fmt)}-{format(high * scale, fmt)})"
    return cell


def diff_cell(distribution: dict[str, Any]) -> str:
    """A :func:`agent_results.distribution` of max |logprob diff| as ``p50 / p99 / max``."""
    return " / ".join("-" if v is None or not math.isfinite(v) else f"{v:.4f}" for v in _quantiles(distribution))


def _quantiles(distribution: dict[str, Any]) -> tuple[float | None, ...]:
    return distribution["p50"], distribution["p99"], distribution["max"]


def headline_table(
    summaries: dict[str, dict[str, Any]], report_steps: list[int], total_requests: int, tolerance: float | None = None
) -> str:
    """Per arm, the median over its repeats of each headline figure, with its range; wrong
    outputs and ties (:mod:`benchmarks.agent.correctness`) beside the distribution of the arm's max
    |logprob diff| over all its answers. ``tolerance``: a results file judged before
    correctness was decided on tokens (wrong = a max |logprob diff| over ``tolerance``),
    which recorded neither ties nor that distribution."""
    head = " / ".join(f"s{k}" for k in report_steps)
    correctness = (
        "wrong | ties | max logprob diff p50 / p99 / max" if tolerance is None else f"wrong (diff > {tolerance})"
    )
    lines = [
        (
            f"| arm | repeats | prefill computed | KV moved MB | TTFT p50 {head} (s) | {correctness} "
            f"| SLO met (of {total_requests}) |"
        ),
        "|---|---:|---:|---:|---:|" + "---:|" * (1 + correctness.count("|")) + "---:|",
    ]
    for s in summaries.values():
        sp = s["spread"]
        ttft = " / ".join(spread_cell(sp[f"ttft_p50_step{k}"], ".2f") for k in report_steps)
        cells = [spread_cell(sp["wrong"])]
        if tolerance is None:
            cells += [spread_cell(sp["ties"]), diff_cell(s["max_diff"])]
        lines.append(
            f"| {s['arm']} | {s['repeats']} | {spread_cell(sp['prefill_computed'])} | "
            f"{spread_cell(sp['kv_bytes'], ',.1f', 1e-6)} | {ttft} | {' | '.join(cells)} | "
            f"{spread_cell(sp['slo_met'])} |"
        )
    return "\n".join(lines)


def noise_note(noise: dict[str, Any], tolerance: float | None = None) -> str:
    """What wrong means and the noise it was judged by: the calibration's distribution of
    max |logprob diff| (``tolerance``: as :func:`headline_table`)."""
    calibration = noise["calibration"]
    if tolerance is not None:
        return (
            f"Wrong here: a max |logprob diff| over {tolerance} against the reference, up to the first token that "
            f"differs. This run recorded no top-2 margins of the reference, so it cannot be judged on tokens. Its "
            f"calibration (the reference's engine with its prefix cache, {calibration['token_flips']} answers with a "
            f"token flipped): max |logprob diff| median {calibration['median']:.4f}, max {calibration['max']:.4f}."
        )
    dist = calibration["max_diff"]
    return (
        f"Wrong: the first greedy token that differs from the reference's is where the reference's top-2 margin "
        f"exceeds the noise, {dist['max']:.4f}; a tie: where it is within it. The noise is the largest max "
        f"|logprob diff| of the calibration (the reference's engine with its prefix cache, {dist['n']} answers, "
        f"{calibration['token_flips']} with a token flipped): p50 {dist['p50']:.4f}, p90 {dist['p90']:.4f}, "
        f"p99 {dist['p99']:.4f}, max {dist['max']:.4f}."
    )


def results_table(results: dict[str, Any]) -> str:
    """:func:`headline_table` of a results file (``--out``) and its :func:`noise_note`, for
    ``benchmarks/report.py``."""
    tolerance = results.get("tolerance")
    table = headline_table(results["summaries"], results["report_steps"], results["total_requests"], tolerance)
    return f"{table}\n\n{noise_note(results['noise'], tolerance)}"


def tables(summaries: dict[str, dict[str, Any]], report_steps: list[int], total_requests: int) -> str:
    """One repeat's full tables (``summaries``: arm -> :func:`agent_results.summarize`)."""
    lines = [
        (
            "| arm | prefill computed | local cache hit | external KV | KV moved MB (xfers) "
            "| wrong | ties | max logprob diff p50 / p99 / max | failed | stalled | SLO met |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {s['arm']} | {s['prefill_computed']:,.0f} | {s['local_cache_hit']:,.0f} | "
        f"{s['external_kv_transfer']:,.0f} | {s['kv_bytes'] / 1e6:,.1f} ({s['nixl_transfers']:.0f}) | "
        f"{s['wrong']} | {s['ties']} | {diff_cell(s['max_diff'])} | {s['failed']} | {s['stalled']} | "
        f"{s['slo_met']}/{total_requests} |"
        for s in summaries.values()
    )
    head = (
        " | ".join(f"lat s{k} p50/p99" for k in report_steps)
        + " | "
        + " | ".join(f"TTFT s{k} p50/p99" for k in report_steps)
    )
    lines += ["", f"| arm | {head} | D TPOT ms | arm wall s |", "|---|" + "---:|" * (2 * len(report_steps) + 2)]
    for s in summaries.values():
        cells = [f"{fmt_s(s['latency'][k]['p50'])} / {fmt_s(s['latency'][k]['p99'])}" for k in report_steps]
        cells += [f"{fmt_s(s['ttft'][k]['p50'])} / {fmt_s(s['ttft'][k]['p99'])}" for k in report_steps]
        lines.append(f"| {s['arm']} | " + " | ".join(cells) + f" | {s['tpot_mean'] * 1e3:.1f} | {s['seconds']:.0f} |")
    return "\n".join(lines)


def plot(results: dict[str, list[ArmResult]], path: Path, edited_steps: list[int], title: str) -> None:
    """Prompt tokens computed per step, one line per arm (the median over its repeats);
    a cross where a step had failed requests in any repeat."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    failed_label: str | None = "x: that step had failed requests (not computed)"
    for repeats in results.values():
        xs = sorted({k for r in repeats for k in r.steps})
        if not xs:
            continue
        ys = {k: statistics.median(r.steps[k].computed for r in repeats if k in r.steps) for k in xs}
        (line,) = ax.plot(xs, [ys[k] for k in xs], marker="o", markersize=3, label=repeats[0].title)
        failed = sorted({o.step for r in repeats for o in r.outcomes if o.error is not None})
        ax.plot(
            failed,
            [ys[k] for k in failed],
            "x",
            color=line.get_color(),
            markersize=9,
            markeredgewidth=2,
            label=failed_label if failed else None,
        )
        if failed:
            failed_label = None
    for k in edited_steps:
        ax.axvline(k, color="grey", linestyle=":", linewidth=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("agent step (dotted: a session resends an edited history)")
    ax.set_ylabel("prompt tokens computed (P + D), median over repeats")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(run: Run, judged: RunSummary) -> None:
    config, noise, summaries, ratios = run.config, run.noise, judged.summaries, judged.ratios
    wspec = config.workload
    total_requests = config.sessions * config.steps
    last = config.steps
    print()
    print(
        f"## Coding agent, {config.sessions} sessions x {config.steps} steps (prefix {config.prefix_tokens}, tool "
        f"output {config.tool_tokens}, G={config.generated}); session(s) "
        f"{[s for s in range(config.sessions) if wspec.edits(s)]} "
        f"edit at {', '.join(f'{k} ({aw.EDIT_NAMES[v]})' for k, v in wspec.edit_plan.items())}; "
        f"{config.repeats} repeat(s), seed {config.seed}, order {run.schedule}"
    )
    print()
    print("Median over the repeats (min-max):")
    print()
    print(headline_table(summaries, judged.report_steps, total_requests))
    for index in range(config.repeats):
        per_repeat = {k: s["per_repeat"][index] for k, s in summaries.items() if index < len(s["per_repeat"])}
        print()
        print(f"Repeat {index + 1}:")
        print()
        print(tables(per_repeat, judged.report_steps, total_requests))
    print()
    print(
        f"- on the medians: prefill tokens computed (a)/(e): {ratios['prefill_a_over_e']:.2f}x, (b)/(e): "
        f"{ratios['prefill_b_over_e']:.2f}x; TTFT p50 at step {last}, (b)/(e): "
        f"{ratios[f'ttft_p50_step{last}_b_over_e']:.2f}x; SLO met (e)/(c) {ratios['slo_met_e_over_c']:.2f}x, "
        f"(e)/(d) {ratios['slo_met_e_over_d']:.2f}x"
    )
    print(
        f"- SLO met = correct requests with TTFT <= {judged.ttft_slo:.3f} s and their step's D TPOT <= "
        f"{judged.tpot_slo * 1e3:.1f} ms (1.5x arm (a)'s TTFT p50 at step 1 and 1.5x its median step TPOT, unless "
        f"given): a count at the lockstep's one load, not DistServe's goodput (the highest request rate at which "
        f"the SLOs hold), which needs a rate sweep this benchmark does not run. TTFT of a non-streaming request = "
        f"latency - (G-1) x D's mean TPOT over that step (D's {TPOT.name})"
    )
    if judged.handicap:
        print(
            "- the thread-binding handicap: (f) is (c) on KVPilotConnector engines that keep their binding; "
            "(c) - (f) on the medians"
            + (", and its share of the gap (c) - (e)" if "explained" in next(iter(judged.handicap.values())) else "")
            + ": "
            + "; ".join(_handicap_cell(name, row) for name, row in judged.handicap.items())
        )
    print(f"- {noise_note(noise)} Max |logprob diff|: over the generated tokens up to the first that differs.")
    print(
        "- arm (b) emulates a busy fleet: P's prefix cache is reset before every step and re-warmed with the "
        "shared prefix only (uncounted, so its step 1 computes no shared prefix, unlike the other arms), so no "
        "session KV survives on P between steps"
    )
    print(
        f"- stalled = requests that took >= {STALL_S:.0f} s; on this 2-core box engines share cores with NIXL's "
        "busy-polling progress threads (and with whatever else runs), so a step can take tens of seconds"
    )
    for key, s in summaries.items():
        for index, per_repeat in enumerate(s["per_repeat"]):
            print(f"- {s['arm']}, repeat {index + 1}: " + "; ".join(_arm_details(key, per_repeat)))
    warm_ups = ", ".join(f"fleet {k} " + " / ".join(f"{v:.1f}" for v in vs) + " s" for k, vs in run.warm_ups.items())
    print(f"- NIXL warm-ups (uncounted, one per fleet start): {warm_ups}")
    print(
        f"- time: total {run.timings['total']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in run.timings.items() if k != "total")
        + ")"
    )


def _handicap_cell(name: str, row: dict[str, float]) -> str:
    cell = f"{name} {row['c']:,.4g} - {row['f']:,.4g} = {row['binding']:,.4g}"
    if "explained" in row:
        explained = row["explained"]
        share = "no gap" if math.isnan(explained) else f"{explained:.0%}"
        cell += f" of {row['gap']:,.4g} ({share})"
    return cell


def _arm_details(key: str, s: dict[str, Any]) -> list[str]:
    """What the report says of one arm beyond its table rows."""
    details: list[str] = []
    if s["wrong"]:
        details.append(f"wrong at (session, step) {s['wrong_at']}")
    if s["errors"]:
        details.append(f"errors: {s['errors']}")
    if s["stalled"]:
        lat, p_s = s["slowest"]
        details.append(
            f"{s['stalled']} request(s) took >= {STALL_S:.0f} s (slowest {lat:.1f} s"
            + (f", of which P {p_s:.1f} s)" if p_s is not None else ")")
        )
    if s["routes"]:
        details.append(f"routes: {s['routes']}")
    if key == Kvpilot.key:
        details.append(
            f"P pull decisions {s['extra'].get('pull_decisions_pull', 0):.0f} pull / "
            f"{s['extra'].get('pull_decisions_recompute', 0):.0f} recompute"
        )
    by_engine = s["prefill_computed_by_engine"].items()
    details.append("computed by engine " + ", ".join(f"{n} {v:,.0f}" for n, v in by_engine))
    notes: list[str] = s["notes"]
    return details + notes


def result_json(run: Run, judged: RunSummary) -> dict[str, Any]:
    """Everything the run measured, for ``--out`` (NaN and infinities still in: see :func:`finite`).

    ``summaries``: per arm :func:`agent_results.aggregate` (the medians at the top
    level, ``spread``, ``per_repeat``); ``handicap``: :func:`agent_results.handicap_share`;
    ``per_step`` and ``requests``: per arm a list, one entry per repeat in repeat order."""
    config, wspec = run.config, run.config.workload
    return {
        "run": {"argv": recorded_argv()},
        "report_steps": judged.report_steps,
        "total_requests": config.sessions * config.steps,
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()},
            "edit_plan": wspec.edit_plan,
            "editing_sessions_ids": [s for s in range(config.sessions) if wspec.edits(s)],
            "run_dir": str(run.root),
        },
        "noise": run.noise,
        "ttft_slo_s": judged.ttft_slo,
        "tpot_slo_s": judged.tpot_slo,
        "summaries": judged.summaries,
        "ratios": judged.ratios,
        "handicap": judged.handicap,
        "schedule": run.schedule,
        "timings_s": run.timings,
        "warm_ups_s": run.warm_ups,
        "fleet_notes": run.fleet_notes,
        "per_step": {k: [_per_step(r) for r in rs] for k, rs in run.results.items()},
        "requests": {k: [_requests(r) for r in rs] for k, rs in run.results.items()},
    }


def _per_step(r: ArmResult) -> dict[int, dict[str, Any]]:
    return {
        step: {
            "computed": c.computed,
            "computed_by_engine": c.compute,
            "cached": c.cached,
            "external": c.external,
            "kv_bytes": c.kv_bytes,
            "tpot": c.tpot,
            "wall": c.wall,
            **c.extra,
        }
        for step, c in r.steps.items()
    }


def _requests(r: ArmResult) -> list[dict[str, Any]]:
    return [
        {
            "session": o.session,
            "step": o.step,
            "latency": o.latency,
            "ttft": o.ttft,
            "verdict": o.verdict.value if o.verdict is not None else None,
            "first_mismatch": o.first_mismatch,
            "margin": o.margin,
            "max_diff": o.max_diff,
            "error": o.error,
            "route": o.route,
            "p_seconds": o.p_seconds,
        }
        for o in r.outcomes
    ]


def write_outputs(run: Run, judged: RunSummary) -> None:
    """The plot at ``--plot`` and the JSON at ``--out``; says where on stdout."""
    config = run.config
    plot(
        run.results,
        config.plot,
        run.edited_steps,
        f"Prefill tokens computed per step, {config.sessions} sessions x {config.steps} steps (tiny model, CPU)",
    )
    config.out.parent.mkdir(parents=True, exist_ok=True)
    run_info = provenance()
    config.out.write_text(json.dumps(finite({**result_json(run, judged), "provenance": run_info}), indent=1))
    print(f"- wrote {config.out} and {config.plot} ({describe(run_info)})")
