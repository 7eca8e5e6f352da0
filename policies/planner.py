"""Pool planner for an agent workload (article sections 5.1 and 10.1).

P is sized by throughput: fleet step rate x prefill instance-seconds per step.
D is sized by Little's law under two limits, and needs the larger: KV residency
(resident sessions / sessions that fit per instance) and decode bandwidth (the
fewest instances whose decode step, with the decoding sequences split across
them, meets the TPOT target). The fleet step rate is fixed by the
session-reuse cycle (prefill + output x TPOT + tool time) for every regime.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Literal

from kvpilot.policies.presets import kv_format_preset
from kvpilot.policies.roofline import decode_step, kv_bytes, prefill, sessions_per_instance
from kvpilot.policies.specs import HardwareSpec, LinkSpec, ModelSpec, SpecError

CacheMode = Literal["none", "prefix", "session"]


@dataclass(frozen=True, slots=True)
class Workload:
    """The agent loop: each step's prompt is the last one plus ``output_tokens``
    generated and ``tool_output_tokens`` returned; step 1 is the shared prefix
    plus the task."""

    sessions: int = 60
    shared_prefix_tokens: int = 32_000
    task_tokens: int = 100
    output_tokens: int = 150
    tool_output_tokens: int = 1_500
    steps: int = 20
    tool_seconds: float = 4.0
    tpot_target_s: float = 0.025

    def __post_init__(self) -> None:
        for name in ("sessions", "task_tokens", "output_tokens", "steps", "tpot_target_s"):
            if getattr(self, name) <= 0:
                raise SpecError(name, f"must be > 0, got {getattr(self, name)!r}")
        for name in ("shared_prefix_tokens", "tool_output_tokens", "tool_seconds"):
            if getattr(self, name) < 0:
                raise SpecError(name, f"must be >= 0, got {getattr(self, name)!r}")

    def prompt_tokens(self, step: int) -> int:
        """Prompt length at ``step`` (1-based)."""
        return (
            self.shared_prefix_tokens + self.task_tokens + (step - 1) * (self.output_tokens + self.tool_output_tokens)
        )

    def new_tokens(self, step: int, cache: CacheMode) -> tuple[int, int]:
        """(tokens to prefill, cached context) at ``step`` under ``cache``.

        ``prefix``: the shared prefix is cached; ``session``: the previous step's
        prompt is cached too, and the step prefills the generated tool call and
        the tool output (as P does under affinity, section 9.2 option 3)."""
        prompt = self.prompt_tokens(step)
        if cache == "none":
            return prompt, 0
        if cache == "prefix" or step == 1:
            return prompt - self.shared_prefix_tokens, self.shared_prefix_tokens
        previous = self.prompt_tokens(step - 1)
        return prompt - previous, previous

    @property
    def mean_context(self) -> float:
        """Mean KV a session holds: its prompt plus the step's output, over steps."""
        return sum(self.prompt_tokens(k) for k in range(1, self.steps + 1)) / self.steps + self.output_tokens


@dataclass(frozen=True, slots=True)
class Regime:
    key: str
    label: str
    cache: CacheMode
    kv_format: str = "bf16"
    dedup: bool = False
    offload: bool = False
    cascade: bool = False


REGIMES: tuple[Regime, ...] = (
    Regime("none", "no cache", "none"),
    Regime("prefix", "prefix only", "prefix"),
    Regime("session", "session reuse", "session"),
    Regime("fp8", "session, FP8 KV", "session", "fp8"),
    Regime("offload", "session, idle offload", "session", offload=True),
    Regime("dedup", "session, prefix dedup", "session", dedup=True),
    Regime("consolidated", "session, dedup + offload", "session", dedup=True, offload=True),
    Regime("cascade", "dedup + offload + cascade", "session", dedup=True, offload=True, cascade=True),
    Regime("nvfp4", "dedup + offload, NVFP4 KV", "session", "nvfp4", dedup=True, offload=True),
)


@dataclass(frozen=True, slots=True)
class TaskPrefill:
    """Prefill seconds of one session's steps under one cache mode."""

    cache: CacheMode
    step_seconds: tuple[float, ...]

    @property
    def total_s(self) -> float:
        return sum(self.step_seconds)

    @property
    def mean_step_s(self) -> float:
        return self.total_s / len(self.step_seconds)


@dataclass(frozen=True, slots=True)
class PlanRow:
    regime: Regime
    p_instances: float
    d_by_memory: int
    d_by_tpot: int | None
    sessions_per_d: int
    step_ms_at_memory: float
    restore_ms: float | None

    @property
    def d_instances(self) -> int:
        return max(self.d_by_memory, self.d_by_tpot or self.d_by_memory)


@dataclass(frozen=True, slots=True)
class Lesson:
    title: str
    holds: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    hardware: str
    workload: Workload
    task: dict[str, TaskPrefill]
    cycle_s: float
    step_rate: float
    mean_context: float
    decoding: float
    resident_offloaded: float
    rows: tuple[PlanRow, ...]
    lessons: tuple[Lesson, ...]

    def row(self, key: str) -> PlanRow:
        return next(r for r in self.rows if r.regime.key == key)

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "workload": asdict(self.workload),
            "task_prefill_instance_s": {k: t.total_s for k, t in self.task.items()},
            "session_step_prefill_s": list(self.task["session"].step_seconds),
            "cycle_s": self.cycle_s,
            "steps_per_s": self.step_rate,
            "mean_context_tokens": self.mean_context,
            "decoding_sequences": self.decoding,
            "resident_sessions_with_offload": self.resident_offloaded,
            "rows": [
                {
                    **asdict(r.regime),
                    "p_instances": r.p_instances,
                    "p_instances_ceil": math.ceil(r.p_instances),
                    "d_by_memory": r.d_by_memory,
                    "d_by_tpot": r.d_by_tpot,
                    "d_instances": r.d_instances,
                    "sessions_per_d": r.sessions_per_d,
                    "step_ms_at_memory": r.step_ms_at_memory,
                    "restore_ms": r.restore_ms,
                }
                for r in self.rows
            ],
            "lessons": [asdict(lesson) for lesson in self.lessons],
        }


def task_prefill(model: ModelSpec, hw: HardwareSpec, workload: Workload, cache: CacheMode) -> TaskPrefill:
    """Roofline prefill time of each step of one task (KV format only affects
    the small KV-read term, so BF16 is used)."""
    bf16 = kv_format_preset("bf16")
    seconds = []
    for step in range(1, workload.steps + 1):
        new, context = workload.new_tokens(step, cache)
        seconds.append(prefill(model, bf16, hw, new, context).seconds)
    return TaskPrefill(cache, tuple(seconds))


def _d_by_tpot(
    model: ModelSpec, hw: HardwareSpec, regime: Regime, workload: Workload, decoding: float, context: int
) -> int | None:
    """Fewest instances whose decode step meets TPOT; None if one sequence cannot."""
    fmt = kv_format_preset(regime.kv_format)
    prefix = workload.shared_prefix_tokens if regime.cascade else 0
    for n in range(1, max(1, math.ceil(decoding)) + 1):
        batch = [context] * math.ceil(decoding / n)
        if decode_step(model, fmt, hw, batch, prefix, regime.cascade).seconds <= workload.tpot_target_s:
            return n
    return None


def plan(
    model: ModelSpec,
    hw: HardwareSpec,
    restore_link: LinkSpec,
    workload: Workload = Workload(),
    regimes: tuple[Regime, ...] = REGIMES,
) -> Plan:
    """Size P and D for every regime. Raises ValueError if a session's KV does
    not fit in one D instance."""
    task = {mode: task_prefill(model, hw, workload, mode) for mode in ("none", "prefix", "session")}
    prefill_s = task["session"].mean_step_s
    decode_s = workload.output_tokens * workload.tpot_target_s
    cycle = prefill_s + decode_s + workload.tool_seconds
    rate = workload.sessions / cycle
    decoding = workload.sessions * decode_s / cycle
    resident_offloaded = workload.sessions * (prefill_s + decode_s) / cycle
    context = round(workload.mean_context)
    rows = []
    for regime in regimes:
        fmt = kv_format_preset(regime.kv_format)
        fit = sessions_per_instance(model, fmt, hw, context, workload.shared_prefix_tokens, regime.dedup)
        if fit == 0:
            raise ValueError(f"{regime.label}: one {context}-token session does not fit in a {hw.name} instance")
        resident = resident_offloaded if regime.offload else workload.sessions
        d_mem = math.ceil(resident / fit)
        batch = [context] * math.ceil(decoding / d_mem)
        prefix = workload.shared_prefix_tokens if regime.cascade else 0
        step = decode_step(model, fmt, hw, batch, prefix, regime.cascade).seconds
        restore = None
        if regime.offload:
            moved = kv_bytes(model, fmt, context)
            moved -= kv_bytes(model, fmt, workload.shared_prefix_tokens) if regime.dedup else 0.0
            restore = restore_link.transfer_seconds(moved) * 1e3
        rows.append(
            PlanRow(
                regime,
                rate * task[regime.cache].mean_step_s,
                d_mem,
                _d_by_tpot(model, hw, regime, workload, decoding, context),
                fit,
                step * 1e3,
                restore,
            )
        )
    draft = Plan(
        model.name,
        hw.name,
        workload,
        task,
        cycle,
        rate,
        workload.mean_context,
        decoding,
        resident_offloaded,
        tuple(rows),
        (),
    )
    keys = {r.key for r in regimes}
    lessons = lessons_of(draft) if keys >= {r.key for r in REGIMES} else ()
    return dataclasses.replace(draft, lessons=lessons)


def _count(instances: int | None) -> str:
    return "an unreachable number of" if instances is None else str(instances)


def lessons_of(p: Plan) -> tuple[Lesson, ...]:
    """The article's four lessons, each checked against this plan's numbers."""
    none, prefix, session = p.row("none"), p.row("prefix"), p.row("session")
    fp8, offload, dedup = p.row("fp8"), p.row("offload"), p.row("dedup")
    consolidated, cascade = p.row("consolidated"), p.row("cascade")
    tpot_ms = p.workload.tpot_target_s * 1e3
    restore = offload.restore_ms or 0.0
    prefill_ms = p.task["session"].mean_step_s * 1e3
    return (
        Lesson(
            "Caching strategy moves the P pool by more than an order of magnitude",
            none.p_instances >= 10 * session.p_instances,
            f"P instances: no cache {none.p_instances:.1f}, prefix only {prefix.p_instances:.1f}, session reuse "
            f"{session.p_instances:.1f} ({prefix.p_instances / session.p_instances:.1f}x fewer than prefix only, "
            f"{none.p_instances / session.p_instances:.1f}x fewer than no cache); D stays {session.d_instances} "
            f"either way, so caching pushes the P:D ratio toward D",
        ),
        Lesson(
            "For agents, the D pool is sized by KV residency, not decode compute",
            session.d_by_memory > (session.d_by_tpot or math.inf),
            f"{p.decoding:.1f} sequences decode at any instant (TPOT needs {_count(session.d_by_tpot)} D), but "
            f"{p.workload.sessions} sessions keep KV warm (memory needs {session.d_by_memory} D); FP8 -> "
            f"{fp8.d_instances}, idle offload -> {offload.d_instances}, prefix dedup -> {dedup.d_instances}",
        ),
        Lesson(
            "Offloading idle sessions can be nearly free under disaggregation",
            restore <= prefill_ms,
            f"restoring a {p.mean_context:,.0f}-token session takes {restore:.0f} ms, vs {prefill_ms:.0f} ms for "
            f"P to prefill the step's new tokens, which it hides behind",
        ),
        Lesson(
            "Deduplication fixes capacity; only a cascade kernel fixes bandwidth",
            consolidated.d_by_memory < (consolidated.d_by_tpot or math.inf)
            and (cascade.d_by_tpot or math.inf) <= cascade.d_by_memory,
            f"dedup + offload fits in {consolidated.d_by_memory} D by memory, but a step there takes "
            f"{consolidated.step_ms_at_memory:.1f} ms vs the {tpot_ms:.0f} ms TPOT target; a cascade kernel "
            f"reads the shared prefix once: {cascade.step_ms_at_memory:.1f} ms",
        ),
    )


def render(p: Plan) -> str:
    """The plan as a terminal table followed by the task prefill summary and the lessons."""
    w = p.workload
    head = (
        f"{p.model} on {p.hardware}: {w.sessions} sessions, {w.steps} steps, cycle {p.cycle_s:.2f} s "
        f"-> {p.step_rate:.2f} steps/s, mean context {p.mean_context:,.0f} tokens, "
        f"{p.decoding:.1f} decoding, TPOT target {w.tpot_target_s * 1e3:.0f} ms"
    )
    cols = (
        f"{'regime':<28}{'P':>6}{'P#':>4}{'D mem':>7}{'D tpot':>8}{'D':>4}{'sess/D':>8}{'step ms':>9}{'restore ms':>12}"
    )
    lines = [head, "", cols, "-" * len(cols)]
    for r in p.rows:
        tpot = "-" if r.d_by_tpot is None else str(r.d_by_tpot)
        restore = "" if r.restore_ms is None else f"{r.restore_ms:.0f}"
        lines.append(
            f"{r.regime.label:<28}{r.p_instances:>6.1f}{math.ceil(r.p_instances):>4}{r.d_by_memory:>7}"
            f"{tpot:>8}{r.d_instances:>4}{r.sessions_per_d:>8}{r.step_ms_at_memory:>9.1f}{restore:>12}".rstrip()
        )
    t = p.task
    session = t["session"].step_seconds
    lines += [
        "",
        "step ms: decode step with D sized by memory; restore: host tier back to HBM.",
        (
            f"Prefill per task (instance-s): no cache {t['none'].total_s:.1f}, prefix only {t['prefix'].total_s:.1f}, "
            f"session reuse {t['session'].total_s:.2f} ({t['none'].total_s / t['session'].total_s:.1f}x and "
            f"{t['prefix'].total_s / t['session'].total_s:.1f}x less); session step prefill "
            f"{session[1] if len(session) > 1 else session[0]:.2f} s (step 2) -> {session[-1]:.2f} s "
            f"(step {len(session)})"
        ),
        "",
    ]
    for i, lesson in enumerate(p.lessons, 1):
        verdict = "holds" if lesson.holds else "DOES NOT HOLD here"
        lines.append(f"{i}. {lesson.title} [{verdict}]: {lesson.detail}.")
    return "\n".join(lines)
