"""The agent benchmark's results: what each request and each lockstep step of an
arm measured, judged against the reference, and summarized per arm. Pure but for
:func:`counters`' inputs (two scrapes of the engines' ``/metrics``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.agent import workload as aw
from benchmarks.agent.correctness import Verdict, judge_output
from benchmarks.agent.schedule import Spread
from kvpilot.deploy.client import Completion
from kvpilot.deploy.metrics import Samples, delta
from kvpilot.kvconnectors import vllm_metrics as vm

PROMPT_TOKENS = vm.PROMPT_TOKENS_BY_SOURCE.total
NIXL_BYTES = vm.NIXL_BYTES_TRANSFERRED
TPOT = vm.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS
STALL_S = 25.0
"""A request this slow is counted as stalled (P's NIXL lease on blocks for D is 30 s)."""


@dataclass(frozen=True)
class BenchConfig:
    """The command line's flags (``bench_agent.py --help``), by their dest names."""

    sessions: int
    steps: int
    prefix_tokens: int
    tool_tokens: int
    generated: int
    editing_sessions: int
    edit_steps: tuple[int, ...] | None
    seed: int
    arms: str
    repeats: int
    handicap_arm: bool
    ttft_slo: float | None
    tpot_slo: float | None
    request_timeout: float
    warm_up_timeout: float
    settle: float
    out: Path
    plot: Path
    sessions_sweep: tuple[int, ...] = ()
    """Loads (session counts) to run the whole benchmark at, for goodput (:mod:`agent_goodput`)."""

    @property
    def workload(self) -> aw.WorkloadSpec:
        return aw.WorkloadSpec(
            self.sessions,
            self.steps,
            self.prefix_tokens,
            self.tool_tokens,
            self.generated,
            self.editing_sessions,
            self.edit_steps,
            self.seed,
        )


@dataclass
class Outcome:
    """One request of one arm."""

    session: int
    step: int
    latency: float
    completion: Completion | None
    error: str | None = None
    max_diff: float = math.inf
    route: str | None = None
    ttft: float | None = None
    verdict: Verdict | None = None
    """Against the reference (:mod:`benchmarks.agent.correctness`; None until judged, or for no answer)."""
    p_seconds: float | None = None
    """P's half of the latency (the arms that proxy P->D themselves)."""
    first_mismatch: int | None = None
    """Index of the first generated token that differs from the reference (None: all equal)."""
    margin: float | None = None
    """The reference's top-2 margin at ``first_mismatch`` (None: nothing differs)."""

    @property
    def wrong(self) -> bool:
        return self.verdict is Verdict.WRONG

    @property
    def tie(self) -> bool:
        return self.verdict is Verdict.TIE


@dataclass
class StepCounters:
    compute: dict[str, float]
    """Prompt tokens computed per engine (``local_compute``)."""
    cached: float
    external: float
    kv_bytes: float
    transfers: float
    tpot: float | None
    """D's mean time per output token over the step's requests."""
    extra: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0

    @property
    def computed(self) -> float:
        return sum(self.compute.values())


@dataclass
class ArmResult:
    key: str
    title: str
    outcomes: list[Outcome] = field(default_factory=list)
    steps: dict[int, StepCounters] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


Key = tuple[int, int]
"""(session, step)."""


@dataclass
class Run:
    """One run of the benchmark, filled in as it goes."""

    config: BenchConfig
    root: Path
    """Where the fleets' run directories and logs go."""
    run_id: str
    """Part of every arm's ``cache_salt``: no run inherits another's cache."""
    prompts: dict[Key, list[aw.Message]] = field(default_factory=dict)
    reference: dict[Key, Completion] = field(default_factory=dict)
    edited_steps: list[int] = field(default_factory=list)
    """Steps whose prompt resends an edited history."""
    results: dict[str, list[ArmResult]] = field(default_factory=dict)
    """Per arm, one result per repeat, in repeat order."""
    schedule: str = ""
    """The run order, as :func:`agent_schedule.describe` prints it."""
    noise: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    warm_ups: dict[str, list[float]] = field(default_factory=dict)
    """Per fleet, each start's NIXL warm-up seconds."""
    fleet_notes: list[str] = field(default_factory=list)
    """What happened to a fleet outside any arm (an engine restarted after its warm-up)."""


HANDICAP_ARM = "f"
"""The arm that is (c) on engines that keep their thread binding (see :mod:`benchmarks.bench_agent`)."""
HANDICAPPED_ARM = "c"
KVPILOT_ARM = "e"


@dataclass(frozen=True)
class RunSummary:
    """The judged run: per arm the median summary of its repeats (:func:`aggregate`),
    the SLOs they were judged by, the ratios, the handicap's share of the gap."""

    summaries: dict[str, dict[str, Any]]
    report_steps: list[int]
    ttft_slo: float
    tpot_slo: float
    ratios: dict[str, float] = field(default_factory=dict)
    """Filled by :func:`judge_run`: kvpilot's prefill tokens, TTFT and SLO-met requests
    against the baselines', on the medians."""
    handicap: dict[str, dict[str, float]] = field(default_factory=dict)
    """Filled by :func:`judge_run` when arms (c) and (f) ran: :func:`handicap_share`."""

    def get(self, key: str, f: Callable[[dict[str, Any]], float]) -> float:
        """``f`` of arm ``key``'s summary; NaN if the arm did not run."""
        return f(self.summaries[key]) if key in self.summaries else math.nan


def counters(before: dict[str, Samples], after: dict[str, Samples], decode: str) -> StepCounters:
    """What the engines counted between two scrapes (``decode``: D's name)."""
    source = vm.PromptTokenSource
    compute = {n: delta(after[n], before[n], PROMPT_TOKENS, source=source.LOCAL_COMPUTE.value) for n in after}
    cached = sum(delta(after[n], before[n], PROMPT_TOKENS, source=source.LOCAL_CACHE_HIT.value) for n in after)
    external = sum(delta(after[n], before[n], PROMPT_TOKENS, source=source.EXTERNAL_KV_TRANSFER.value) for n in after)
    kv_bytes = sum(delta(after[n], before[n], NIXL_BYTES.sum) for n in after)
    transfers = sum(delta(after[n], before[n], NIXL_BYTES.count) for n in after)
    count = delta(after[decode], before[decode], TPOT.count)
    tpot = delta(after[decode], before[decode], TPOT.sum) / count if count else None
    extra: dict[str, float] = {}
    for decision in ("pull", "recompute"):
        extra[f"pull_decisions_{decision}"] = sum(
            delta(after[n], before[n], vm.KVPILOT_PULL_DECISIONS.total, decision=decision) for n in after
        )
    extra["verified_blocks"] = sum(delta(after[n], before[n], vm.KVPILOT_VERIFIED_BLOCKS.total) for n in after)
    return StepCounters(compute, cached, external, kv_bytes, transfers, tpot, extra)


def judge(result: ArmResult, reference: dict[Key, Completion], generated: int, noise: float) -> None:
    """Each outcome's verdict against the reference, given the logprob noise of a
    known-correct path (:func:`benchmarks.agent.correctness.judge_output`), and its TTFT estimate."""
    tpots = [c.tpot for c in result.steps.values() if c.tpot is not None]
    arm_tpot = statistics.fmean(tpots) if tpots else 0.0
    for o in result.outcomes:
        if o.completion is None:
            continue
        o.verdict, o.first_mismatch, o.max_diff, o.margin = judge_output(
            o.completion, reference[(o.session, o.step)], noise
        )
        tpot = result.steps[o.step].tpot
        o.ttft = max(0.0, o.latency - (generated - 1) * (tpot if tpot is not None else arm_tpot))


def pct(values: list[float], q: float) -> float:
    """Percentile ``q`` (0-100), linear interpolation; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


QUANTILES = (50, 90, 99)


def distribution(values: list[float]) -> dict[str, float]:
    """``values``' count ``n``, percentiles ``p50``, ``p90``, ``p99`` (:func:`pct`) and ``max``;
    NaN for each but ``n`` when there are none."""
    return {"n": len(values), **{f"p{q}": pct(values, q) for q in QUANTILES}, "max": max(values, default=math.nan)}


def calibration_noise(result: ArmResult, reference: dict[Key, Completion]) -> dict[str, Any]:
    """The logprob noise of a known-correct path (``result``, the calibration): the
    :func:`distribution` of its answers' max |logprob diff| against the reference over
    the tokens up to and including the first that differs (``max_diff``; its ``max`` is
    the noise :func:`judge_run` judges by), and how many answers had a token differ."""
    diffs, flips = [], 0
    for o in result.outcomes:
        if o.completion is not None:
            first, diff = o.completion.divergence(reference[(o.session, o.step)])
            diffs.append(diff)
            flips += first is not None
    return {"max_diff": distribution(diffs), "token_flips": flips}


def noise_threshold(noise: dict[str, Any]) -> float:
    """The noise outputs are judged by: the calibration's largest max |logprob diff|."""
    return float(noise["calibration"]["max_diff"]["max"])


def at_step(result: ArmResult, step: int, what: str) -> list[float]:
    return [
        getattr(o, what)
        for o in result.outcomes
        if o.step == step and o.completion is not None and getattr(o, what) is not None
    ]


def summarize(result: ArmResult, report_steps: list[int], ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    steps = result.steps.values()
    good = [
        o
        for o in result.outcomes
        if o.completion is not None
        and not o.wrong
        and o.ttft is not None
        and o.ttft <= ttft_slo
        and (result.steps[o.step].tpot or 0.0) <= tpot_slo
    ]
    tpots = [c.tpot for c in steps if c.tpot is not None]
    per_engine: dict[str, float] = {}
    for c in steps:
        for name, v in c.compute.items():
            per_engine[name] = per_engine.get(name, 0.0) + v
    routes: dict[str, int] = {}
    for o in result.outcomes:
        if o.route:
            routes[o.route] = routes.get(o.route, 0) + 1
    wrong = [o for o in result.outcomes if o.wrong]
    return {
        "arm": result.title,
        "requests": len(result.outcomes),
        "prefill_computed": sum(c.computed for c in steps),
        "prefill_computed_by_engine": per_engine,
        "local_cache_hit": sum(c.cached for c in steps),
        "external_kv_transfer": sum(c.external for c in steps),
        "kv_bytes": sum(c.kv_bytes for c in steps),
        "nixl_transfers": sum(c.transfers for c in steps),
        "latency": {
            k: {"p50": pct(at_step(result, k, "latency"), 50), "p99": pct(at_step(result, k, "latency"), 99)}
            for k in report_steps
        },
        "ttft": {
            k: {"p50": pct(at_step(result, k, "ttft"), 50), "p99": pct(at_step(result, k, "ttft"), 99)}
            for k in report_steps
        },
        "tpot_mean": statistics.fmean(tpots) if tpots else math.nan,
        "slo_met": len(good),
        "wrong": len(wrong),
        "ties": sum(o.tie for o in result.outcomes),
        "stalled": sum(o.latency >= STALL_S for o in result.outcomes),
        "slowest": max(((o.latency, o.p_seconds) for o in result.outcomes), default=(math.nan, None)),
        "wrong_at": sorted({(o.session, o.step) for o in wrong}),
        "failed": sum(o.error is not None for o in result.outcomes),
        "errors": sorted({o.error for o in result.outcomes if o.error})[:5],
        "max_diff": distribution(_diffs(result)),
        "routes": routes,
        "extra": {k: sum(c.extra.get(k, 0.0) for c in steps) for k in next(iter(steps)).extra} if steps else {},
        "seconds": result.seconds,
        "notes": result.notes,
    }


def _diffs(result: ArmResult) -> list[float]:
    """Each answered request's max |logprob diff| against the reference."""
    return [o.max_diff for o in result.outcomes if o.completion is not None]


def headline(summary: dict[str, Any], report_steps: list[int]) -> dict[str, float]:
    """The figures of one repeat's :func:`summarize` that the report gives as medians
    with their spread: prefill tokens computed, KV bytes moved, TTFT p50 at each
    report step, wrong outputs, ties, SLO-met requests."""
    return {
        "prefill_computed": float(summary["prefill_computed"]),
        "kv_bytes": float(summary["kv_bytes"]),
        **{f"ttft_p50_step{k}": float(summary["ttft"][k]["p50"]) for k in report_steps},
        "wrong": float(summary["wrong"]),
        "ties": float(summary["ties"]),
        "slo_met": float(summary["slo_met"]),
    }


def aggregate(title: str, per_repeat: list[dict[str, Any]], report_steps: list[int]) -> dict[str, Any]:
    """One arm's repeats as one summary: each :func:`headline` figure's median at the
    top level (so a reader of one run's ``prefill_computed`` reads the median), its
    :class:`~agent_schedule.Spread` under ``spread``, the repeats' own summaries under
    ``per_repeat``."""
    figures = [headline(s, report_steps) for s in per_repeat]
    spreads = {name: Spread.of([f[name] for f in figures]) for name in (figures[0] if figures else {})}
    return {
        "arm": title,
        "repeats": len(per_repeat),
        **{name: spread.median for name, spread in spreads.items()},
        "spread": {name: spread.as_json() for name, spread in spreads.items()},
        "per_repeat": per_repeat,
    }


def handicap_share(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per headline figure, how much of the gap between (c) and kvpilot (e) the thread
    binding explains: (c)'s and (f)'s medians, ``binding`` = (c) - (f) (what the binding
    alone changed), and, with (e), ``gap`` = (c) - (e) and ``explained`` = binding / gap
    (NaN for no gap). Empty unless (c) and (f) both ran."""
    if HANDICAPPED_ARM not in summaries or HANDICAP_ARM not in summaries:
        return {}
    c, f = summaries[HANDICAPPED_ARM], summaries[HANDICAP_ARM]
    e = summaries.get(KVPILOT_ARM)
    out: dict[str, dict[str, float]] = {}
    for name in c["spread"]:
        row = {"c": c[name], "f": f[name], "binding": c[name] - f[name]}
        if e is not None:
            gap = c[name] - e[name]
            row |= {"e": e[name], "gap": gap, "explained": row["binding"] / gap if gap else math.nan}
        out[name] = row
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def judge_run(run: Run) -> RunSummary:
    """Judge every repeat of every arm against the reference by the calibration's noise
    (:func:`noise_threshold`; sets each outcome's verdict and TTFT), summarize each repeat
    and :func:`aggregate` each arm's repeats, with the :func:`distribution` of the max
    |logprob diff| of all its answers (``max_diff``). Unless given, the SLOs are 1.5x the
    base arm's (arm (a), else the first by letter) TTFT p50 at step 1 (the median over its
    repeats) and 1.5x its median step TPOT (over all its repeats' steps). Raises KeyError
    without a calibration in ``run.noise``."""
    config, results = run.config, run.results
    noise = noise_threshold(run.noise)
    for repeats in results.values():
        for r in repeats:
            judge(r, run.reference, config.generated, noise)
    # the first arm by letter (the order arms are reported in), never the first to run: the runs are shuffled
    base = results[min(results)] if results else []
    base_ttft1 = Spread.of([pct(at_step(r, 1, "ttft"), 50) for r in base]).median
    base_tpots = [c.tpot for r in base for c in r.steps.values() if c.tpot]
    base_tpot = statistics.median(base_tpots) if base_tpots else math.nan
    ttft_slo = config.ttft_slo if config.ttft_slo is not None else 1.5 * base_ttft1
    tpot_slo = config.tpot_slo if config.tpot_slo is not None else 1.5 * base_tpot
    report_steps = sorted({1, max(1, config.steps // 2), config.steps})
    summaries = {
        key: aggregate(rs[0].title, [summarize(r, report_steps, ttft_slo, tpot_slo) for r in rs], report_steps)
        | {"max_diff": distribution([d for r in rs for d in _diffs(r)])}
        for key, rs in results.items()
        if rs
    }
    judged = RunSummary(summaries, report_steps, ttft_slo, tpot_slo, handicap=handicap_share(summaries))
    last = config.steps

    def of(a: str, b: str, f: Callable[[dict[str, Any]], float]) -> float:
        return ratio(judged.get(a, f), judged.get(b, f))

    judged.ratios.update(
        {
            "prefill_a_over_e": of("a", "e", lambda s: s["prefill_computed"]),
            "prefill_b_over_e": of("b", "e", lambda s: s["prefill_computed"]),
            f"ttft_p50_step{last}_b_over_e": of("b", "e", lambda s: s[f"ttft_p50_step{last}"]),
            "slo_met_e_over_c": of("e", "c", lambda s: s["slo_met"]),
            "slo_met_e_over_d": of("e", "d", lambda s: s["slo_met"]),
        }
    )
    return judged
