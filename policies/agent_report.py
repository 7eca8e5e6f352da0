"""The agent benchmark's arms, predicted on the roofline. Pure.

For one session of a :class:`~kvpilot.policies.planner.Workload` (a shared prefix, then
per step a generated tool call and a tool output), each arm of
``benchmarks/bench_agent.py`` serves step ``k`` as follows (after step ``k-1``,
D holds the previous prompt and its generated tokens; article section 9.2):

- ``no_cache``: P prefills the whole prompt; D loads all of it;
- ``prefix_only`` (option 1 as the article prices it): P holds only the shared
  prefix, prefills the rest; D loads what it lacks (the tool output);
- ``vllm_pull`` (option 2 at every step, vLLM's multi-turn proxy): P holds only
  the shared prefix, pulls the rest of the session from D, prefills the tool
  output; D loads it back;
- ``prefix_aware`` (a cache-aware router without sessions, like vllm-router's
  ``kv_aware``): P holds its own last prefill, prefills D's generated tokens
  and the tool output; D loads the tool output;
- ``kvpilot``: the router's own choice among the five options
  (:mod:`kvpilot.policies.session_options`, the same code the router runs).

Step 1 is the same for every arm but ``no_cache``: P prefills the prompt after
the shared prefix and D loads it all. Each arm reports prefill tokens computed,
tokens moved between engines, and the expected TTFT of each step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.policies.disaggregation import DecodeState, LocalVsRemotePolicy
from kvpilot.policies.planner import Workload
from kvpilot.policies.session_options import PrefillSite, SessionOptionPricer, SessionStep, choose

ARMS = ("no_cache", "prefix_only", "vllm_pull", "prefix_aware", "kvpilot")
LABELS = {
    "no_cache": "(a) no prefix cache",
    "prefix_only": "(b) prefix only",
    "vllm_pull": "(c) vLLM proxy, pull every step",
    "prefix_aware": "(d) cache-aware router, no sessions",
    "kvpilot": "(e) kvpilot",
}


@dataclass(frozen=True, slots=True)
class ArmPrediction:
    """One arm over one session: per step, tokens prefilled, tokens moved, TTFT (s)
    and the option that served it."""

    arm: str
    prefill_tokens: tuple[int, ...]
    moved_tokens: tuple[int, ...]
    ttft_s: tuple[float, ...]
    options: tuple[str, ...]

    @property
    def label(self) -> str:
        return LABELS[self.arm]

    def ttft_at(self, step: int) -> float:
        """TTFT of ``step`` (1-based; the last step when the session is shorter)."""
        return self.ttft_s[min(step, len(self.ttft_s)) - 1]


def predict(
    policy: LocalVsRemotePolicy, workload: Workload, decode: DecodeState = DecodeState()
) -> tuple[ArmPrediction, ...]:
    """Every arm of :data:`ARMS` over one session of ``workload``, priced with
    ``policy``'s model, KV format, hardware, link and guards, D facing ``decode``
    (its running streams decide whether a local prefill stalls them too long)."""
    pricer = SessionOptionPricer(policy)
    out = []
    for arm in ARMS:
        tokens, moved, ttft, options = [], [], [], []
        for k in range(1, workload.steps + 1):
            prompt = workload.prompt_tokens(k)
            held = workload.prompt_tokens(k - 1) + workload.output_tokens if k > 1 else 0  # D after step k-1
            prefix = 0 if arm == "no_cache" else workload.shared_prefix_tokens
            p_cached = workload.prompt_tokens(k - 1) if k > 1 and arm in ("prefix_aware", "kvpilot") else prefix
            d_cached = 0 if arm == "no_cache" else held
            p = PrefillSite("P", min(prompt, p_cached))
            step = SessionStep(
                prompt_tokens=prompt,
                p=p,
                d_name="D",
                d_cached_tokens=d_cached,
                decode=decode,
                last_p=p,
                last_d_chosen=True,
                offer_tokens=held or None,
            )
            if arm == "kvpilot" and k > 1:
                price = choose(pricer.price(step))
            elif arm == "vllm_pull" and k > 1:
                price = pricer.pull(step)
            else:
                price = pricer.reprefill(step)
            tokens.append(price.prefill_tokens)
            moved.append(price.moved_tokens)
            ttft.append(price.seconds)
            options.append(price.option.value)
        out.append(ArmPrediction(arm, tuple(tokens), tuple(moved), tuple(ttft), tuple(options)))
    return tuple(out)


def render(predictions: tuple[ArmPrediction, ...], title: str, steps: tuple[int, ...] = (1, 10, 20)) -> str:
    """A markdown table: prefill tokens per session (and each arm's multiple of
    kvpilot's), tokens moved, TTFT at ``steps``."""
    base = next(p for p in predictions if p.arm == "kvpilot")
    head = ["arm", "prefill tokens", "x kvpilot", "tokens moved"] + [f"TTFT step {s} (ms)" for s in steps]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in predictions:
        ratio = sum(p.prefill_tokens) / max(1, sum(base.prefill_tokens))
        cells = [p.label, f"{sum(p.prefill_tokens):,}", f"{ratio:.1f}", f"{sum(p.moved_tokens):,}"]
        cells += [f"{p.ttft_at(s) * 1e3:.1f}" for s in steps]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


BENCH_ARMS = {"a": "no_cache", "b": "prefix_only", "c": "vllm_pull", "d": "prefix_aware", "e": "kvpilot"}
"""``benchmarks/bench_agent.py``'s arm letters, by the arm they measure."""


def render_measured(predictions: tuple[ArmPrediction, ...], measured: Mapping[str, float], title: str) -> str:
    """A markdown table: each arm's prefill tokens as a multiple of kvpilot's, predicted
    beside ``measured`` (arm name -> prefill tokens computed over a benchmark run)."""
    predicted = {p.arm: sum(p.prefill_tokens) for p in predictions}
    lines = [f"**{title}**", "", "| arm | predicted x kvpilot | measured x kvpilot |", "|---|---|---|"]
    for p in predictions:
        ratio = predicted[p.arm] / max(1, predicted["kvpilot"])
        seen = measured.get(p.arm)
        base = measured.get("kvpilot")
        shown = f"{seen / max(1.0, base):.1f}" if seen is not None and base is not None else "-"
        lines.append(f"| {p.label} | {ratio:.1f} | {shown} |")
    return "\n".join(lines)


__all__ = ["ARMS", "BENCH_ARMS", "LABELS", "ArmPrediction", "predict", "render", "render_measured"]
