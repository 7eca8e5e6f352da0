"""The agent benchmark's output: the markdown report on stdout, the plot, the JSON
file (``--out``). Reads a judged :class:`~agent_results.Run`; changes nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import agent_workload as aw
from agent_arms import Kvpilot
from agent_results import STALL_S, TPOT, ArmResult, Run, RunSummary


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


def tables(summaries: dict[str, dict[str, Any]], report_steps: list[int], total_requests: int) -> str:
    lines = [
        (
            "| arm | prefill computed | local cache hit | external KV | KV moved MB (xfers) "
            "| wrong | near-tie flips | failed | stalled | goodput |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {s['arm']} | {s['prefill_computed']:,.0f} | {s['local_cache_hit']:,.0f} | "
        f"{s['external_kv_transfer']:,.0f} | {s['kv_bytes'] / 1e6:,.1f} ({s['nixl_transfers']:.0f}) | "
        f"{s['wrong']} | {s['token_flips']} | {s['failed']} | {s['stalled']} | "
        f"{s['goodput']}/{total_requests} |"
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


def plot(results: dict[str, ArmResult], path: Path, edited_steps: list[int], title: str) -> None:
    """Prompt tokens computed per step, one line per arm; a cross where a step had failed requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    failed_label: str | None = "x: that step had failed requests (not computed)"
    for r in results.values():
        if not r.steps:
            continue
        xs = sorted(r.steps)
        (line,) = ax.plot(xs, [r.steps[k].computed for k in xs], marker="o", markersize=3, label=r.title)
        failed = sorted({o.step for o in r.outcomes if o.error is not None})
        ax.plot(
            failed,
            [r.steps[k].computed for k in failed],
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
    ax.set_ylabel("prompt tokens computed (P + D)")
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
        f"edit at {', '.join(f'{k} ({aw.EDIT_NAMES[v]})' for k, v in wspec.edit_plan.items())}"
    )
    print()
    print(tables(summaries, judged.report_steps, total_requests))
    print()
    print(
        f"- prefill tokens computed (a)/(e): {ratios['prefill_a_over_e']:.2f}x, (b)/(e): "
        f"{ratios['prefill_b_over_e']:.2f}x"
    )
    print(f"- TTFT p50 at step {last}, (b)/(e): {ratios[f'ttft_p50_step{last}_b_over_e']:.2f}x")

    def goodput(key: str) -> float:
        return judged.get(key, lambda s: s["goodput"])

    print(
        f"- goodput (e) {goodput('e'):.0f} vs (c) {goodput('c'):.0f} "
        f"({ratios['goodput_e_over_c']:.2f}x) vs (d) {goodput('d'):.0f} "
        f"({ratios['goodput_e_over_d']:.2f}x), of {total_requests} requests"
    )
    print(
        f"- goodput = correct requests with TTFT <= {judged.ttft_slo:.3f} s and their step's D TPOT <= "
        f"{judged.tpot_slo * 1e3:.1f} ms (1.5x arm (a)'s TTFT p50 at step 1 and 1.5x its median step TPOT, unless "
        f"given). TTFT of a non-streaming request = latency - (G-1) x D's mean TPOT over that step "
        f"(D's {TPOT.name})"
    )
    print(
        f"- wrong = max |logprob diff| against the no-cache reference > {config.tolerance}, over the generated "
        f"tokens up to and including the first one that differs (after it the contexts differ). A token that "
        f"differs with a diff within the tolerance is a near-tie flip on numeric noise (bf16, random weights), "
        f"counted apart, not as wrong. Noise of known-correct paths: calibration (D's own prefix cache, "
        f"{noise['calibration']['token_flips']} flips) max {noise['calibration']['max']:.4f}"
        + (f", arm (a) max {noise['arm_a']['max']:.4f}" if "arm_a" in noise else "")
        + f"; wrong outputs' diffs ranged {noise['smallest_diff_among_wrong']:.3g}"
        f" .. {noise['largest_diff_among_wrong']:.3g}"
    )
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
        print(f"- {s['arm']}: " + "; ".join(_arm_details(key, s)))
    print(f"- NIXL warm-ups (uncounted): {', '.join(f'fleet {k} {v:.1f} s' for k, v in run.warm_ups.items())}")
    print(
        f"- time: total {run.timings['total']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in run.timings.items() if k != "total")
        + ")"
    )


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
    """Everything the run measured, for ``--out`` (NaN and infinities still in: see :func:`finite`)."""
    config, wspec = run.config, run.config.workload
    return {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()},
            "edit_plan": wspec.edit_plan,
            "editing_sessions_ids": [s for s in range(config.sessions) if wspec.edits(s)],
            "run_dir": str(run.root),
        },
        "tolerance": config.tolerance,
        "noise": run.noise,
        "ttft_slo_s": judged.ttft_slo,
        "tpot_slo_s": judged.tpot_slo,
        "summaries": judged.summaries,
        "ratios": judged.ratios,
        "timings_s": run.timings,
        "warm_ups_s": run.warm_ups,
        "per_step": {
            k: {
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
            for k, r in run.results.items()
        },
        "requests": {
            k: [
                {
                    "session": o.session,
                    "step": o.step,
                    "latency": o.latency,
                    "ttft": o.ttft,
                    "tokens_match": o.tokens_match,
                    "first_mismatch": o.first_mismatch,
                    "max_diff": o.max_diff,
                    "wrong": o.wrong,
                    "error": o.error,
                    "route": o.route,
                    "p_seconds": o.p_seconds,
                }
                for o in r.outcomes
            ]
            for k, r in run.results.items()
        },
    }


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
    config.out.write_text(json.dumps(finite(result_json(run, judged)), indent=1))
    print(f"- wrote {config.out} and {config.plot}")
