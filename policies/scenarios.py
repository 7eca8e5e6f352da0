"""The recompute-vs-transfer scenario table (article section 9.3).

Short vs long context, idle vs busy P, fast vs slow vs failing link, for a
span just under and well over vLLM's 64-token threshold. Each row scores the
policy's choice and the fixed threshold's choice with the same expected-latency
model, so the table shows where (and by how much) a context- and load-aware
threshold beats a fixed token count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvpilot.policies.recompute_vs_transfer import (
    Choice,
    LinkTelemetry,
    PrefillLoad,
    RecomputeTransferDecision,
    RecomputeVsTransferPolicy,
    Span,
    TransferSample,
    fixed_threshold_choice,
)
from kvpilot.policies.specs import LinkSpec


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    span: Span
    load: PrefillLoad
    telemetry: LinkTelemetry


@dataclass(frozen=True, slots=True)
class ScenarioRow:
    scenario: Scenario
    decision: RecomputeTransferDecision
    baseline: Choice

    @property
    def policy_s(self) -> float:
        return self.decision.cost_of(self.decision.choice)

    @property
    def baseline_s(self) -> float:
        return self.decision.cost_of(self.baseline)


def _samples(link: LinkSpec, bytes_per_s: float, count: int = 8) -> tuple[TransferSample, ...]:
    """``count`` recent transfers of a few sizes, all at ``bytes_per_s``."""
    sizes = [8e6 * (i + 1) for i in range(count)]
    return tuple(TransferSample(n, link.setup_s + n / bytes_per_s) for n in sizes)


def link_conditions(
    link: LinkSpec, slow_factor: float = 10.0, failure_rate: float = 0.2, failure_s: float = 0.05
) -> dict[str, LinkTelemetry]:
    """Telemetry for three link states: ``fast`` (transfers at the spec's rate),
    ``slow`` (congested: ``slow_factor`` x slower) and ``failing`` (spec rate,
    ``failure_rate`` of transfers failing after ``failure_s``)."""
    rate = link.effective_bytes_per_s
    fast = _samples(link, rate)
    failures = round(len(fast) * failure_rate / (1 - failure_rate))
    return {
        "fast": LinkTelemetry(fast),
        "slow": LinkTelemetry(_samples(link, rate / slow_factor)),
        "failing": LinkTelemetry(fast, failures=failures, mean_failure_s=failure_s),
    }


def default_scenarios(
    link: LinkSpec,
    short_context: int = 2_000,
    long_context: int = 62_000,
    spans: tuple[int, ...] = (32, 150),
    new_tokens: int = 100,
    busy: PrefillLoad = PrefillLoad(16_384, 8_192),
) -> list[Scenario]:
    """The grid: context x P load x link state x span size (24 rows by default).

    ``new_tokens`` is the request's own increment (a short follow-up) prefilled
    in the same pass; ``busy`` is a saturated P's queue and running batch."""
    contexts = {"short": short_context, "long": long_context}
    loads = {"idle": PrefillLoad(), "busy": busy}
    links = link_conditions(link)
    grid = itertools.product(contexts.items(), loads.items(), links.items(), spans)
    return [
        Scenario(
            f"{c_name} ctx / {l_name} P / {k_name} link / {span} tok", Span(span, context, new_tokens), load, telemetry
        )
        for (c_name, context), (l_name, load), (k_name, telemetry), span in grid
    ]


def evaluate(policy: RecomputeVsTransferPolicy, scenarios: list[Scenario], threshold: int = 64) -> list[ScenarioRow]:
    """Decide every scenario and score the fixed ``threshold`` rule beside it."""
    return [
        ScenarioRow(s, policy.decide(s.span, s.load, s.telemetry), fixed_threshold_choice(s.span.tokens, threshold))
        for s in scenarios
    ]


def render_table(rows: list[ScenarioRow], threshold: int = 64) -> str:
    """A Markdown table of the scenarios plus a totals line (mean expected latency)."""
    header = (
        f"| scenario | recompute ms | transfer ms | policy | vLLM <{threshold} | "
        f"policy ms | vLLM ms |\n|---|---:|---:|---|---|---:|---:|"
    )
    lines = [header]
    for row in rows:
        d = row.decision
        mark = "" if d.choice is row.baseline else " *"
        lines.append(
            f"| {row.scenario.name} | {d.recompute_s * 1e3:.2f} | {d.transfer_s * 1e3:.2f} | "
            f"{d.choice.value}{mark} | {row.baseline.value} | {row.policy_s * 1e3:.2f} | {row.baseline_s * 1e3:.2f} |"
        )
    policy = sum(r.policy_s for r in rows) / len(rows) if rows else 0.0
    baseline = sum(r.baseline_s for r in rows) / len(rows) if rows else 0.0
    wins = sum(r.policy_s < r.baseline_s for r in rows)
    losses = sum(r.policy_s > r.baseline_s for r in rows)
    lines.append(
        f"\nMean expected latency over {len(rows)} scenarios: policy {policy * 1e3:.2f} ms, "
        f"fixed {threshold}-token threshold {baseline * 1e3:.2f} ms; the policy is faster in {wins} "
        f"(marked *) and slower in {losses}."
        if rows
        else "\nNo scenarios."
    )
    return "\n".join(lines)
