"""A :mod:`benchmarks.sim.goodput` results file as a markdown table (:func:`table`) and as a
figure (:func:`plot`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.fleet.goodput import GoodputBounds, at_least
from benchmarks.sim.arms import UNTIERED
from benchmarks.sim.brackets import arm_bounds, best_dynamo_arm, ratios
from benchmarks.sim.fleet import Pools


def table(result: dict[str, Any]) -> str:
    """Goodput per arm, and each arm's attainment and mean TTFT at each offered rate (and,
    on a trace with sessions, where they went: :func:`benchmarks.sim.goodput.placement_stats`)."""
    placed = any("moved_steps" in p for points in result["points"].values() for p in points)
    what = "mean TTFT ms; steps moved, most sessions on one worker" if placed else "mean TTFT ms"
    lines = [f"| arm | goodput req/s | offered req/s: SLO attainment ({what}) |", "|---|---:|---|"]
    for arm, points in result["points"].items():
        cells = "; ".join(
            f"{p['rate_rps']:.1f}: {p['attainment']:.3f} ({p['mean_ttft_ms']:.0f}"
            + (f"; {p['moved_steps']}, {p['most_sessions_on_one_worker']}" if "moved_steps" in p else "")
            + ")"
            for p in points
        )
        lines.append(f"| {arm} | {_bracket(arm_bounds(points))} | {cells} |")
    compared = ""
    found = {arm: arm_bounds(points) for arm, points in result["points"].items()}
    if "kvpilot" in found and len(found) > 1 and any(not arm.startswith("kvpilot") for arm in found):
        baseline = best_dynamo_arm(found, result.get("dynamo_router_config") is not None)
        r = ratios(result["points"], baseline)
        claim = (
            f"goodput at least {r['goodput_at_least']:.2f}x (our lower end over its upper)"
            if r["goodput_at_least"] is not None
            else "no goodput ratio (it never missed)"
        )
        compared = (
            f" kvpilot against {baseline}: {claim}; mean TTFT at {r['at_rate_rps']:.1f} "
            f"req/s {r['mean_ttft_at_baseline_goodput']:.2f}x."
        )
    if any("computed_tokens" in p for points in result["points"].values() for p in points):
        lines += ["", "| arm | at each offered req/s: prompt tokens prefilled, M (restored from host, M) |"]
        lines.append("|---|---|")
        for arm, points in result["points"].items():
            cells = "; ".join(
                f"{p['rate_rps']:.1f}: {p['computed_tokens'] / 1e6:.1f} ({p['host_reused_tokens'] / 1e6:.1f})"
                for p in points
            )
            lines.append(f"| {arm} | {cells} |")
    if {"kvpilot", UNTIERED} <= set(found):
        untiered = at_least(found["kvpilot"], found[UNTIERED])
        compared += " kvpilot against kvpilot_without_tiers: " + (
            f"goodput at least {untiered:.2f}x." if untiered is not None else "no goodput ratio (it never missed)."
        )
    resolution = result.get("resolution")
    bisected = f" Brackets bisected to {resolution:.0%} where closed." if resolution else " Brackets from the grid."
    return (
        f"{result['workload']}{_shapes(result)}, {_pools(result)}; SLOs: TTFT at most "
        f"{result['slo']['ttft_x_floor']:g}x the floor, ITL at most {result['slo']['itl_x_idle']:g}x an idle "
        f"worker's, met by {result['slo']['attainment']:.0%} of requests.{compared}{bisected} "
        "Goodput lies in [lower, upper); * marks an arm that met the SLOs again above its first miss.\n\n"
        + "\n".join(lines)
    )


def _bracket(found: GoodputBounds) -> str:
    """A goodput bracket as the table shows it: ``[lower, upper)``, ``at least lower`` when
    open above; ``*`` where the arm met the SLOs again above its first miss."""
    text = f"at least {found.lower:.1f}" if found.upper == float("inf") else f"[{found.lower:.1f}, {found.upper:.1f})"
    return text + ("" if found.monotone else " *")


def _shapes(result: dict[str, Any]) -> str:
    """A results file's human turns and host tiers, where it has them (none before tiers)."""
    agent, engine = result.get("agent") or {}, result.get("engine") or {}
    out = ""
    if agent.get("steps_per_turn"):
        out += f" (a human turn every {agent['steps_per_turn']} steps, mean gap {agent['human_gap_s']:g} s)"
    if engine.get("num_host_blocks"):
        out += (
            f", {engine['num_gpu_blocks']:,} GPU and {engine['num_host_blocks']:,} host blocks a worker at "
            f"{engine['host_gb_s']:g} GB/s ({engine['kv_bytes_per_token']:,} B a token; host credit "
            f"{engine['host_credit']:.2f})"
        )
    return out


def _pools(result: dict[str, Any]) -> str:
    """A results file's fleet, as :class:`Pools` names it (files before disaggregation: co-located)."""
    return str(Pools(result["workers"], result.get("prefill_workers", 0)))


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """One column per results file (a fleet size): mean TTFT (log) and SLO attainment
    against the offered rate, one line per arm, the attainment target drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(4.2 * len(results), 6.4), squeeze=False, sharex="col")
    for column, result in enumerate(results):
        top, bottom = axes[0][column], axes[1][column]
        for arm, points in result["points"].items():
            rates = [p["rate_rps"] for p in points]
            (line,) = top.plot(rates, [p["mean_ttft_ms"] for p in points], marker="o", ms=3, label=arm)
            bottom.plot(rates, [p["attainment"] for p in points], marker="o", ms=3, color=line.get_color())
        top.set_title(f"{result['workload']}, {_pools(result)}", fontsize=9)
        top.set_yscale("log")
        top.grid(alpha=0.3)
        bottom.axhline(result["slo"]["attainment"], color="grey", lw=0.8, ls=":")
        bottom.set_ylim(0, 1.02)
        bottom.set_xlabel("offered requests/s")
        bottom.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean TTFT ms")
    axes[1][0].set_ylabel("requests meeting both SLOs")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
