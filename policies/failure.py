"""What D does when it cannot load a request's KV (article section 8.6).

vLLM's ``kv_load_failure_policy`` is ``fail`` (the default) or ``recompute``.
Recomputing runs a prefill on an instance tuned for decode and delays every
other stream on it; kvpilot's ``budgeted`` mode recomputes only while the delay
it inflicts fits a jitter budget that the caller tracks (per window, in
stream-seconds) and no single stream stalls longer than ``max_stall_s``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal

from kvpilot.policies.disaggregation import PromptState, remote_prefill_seconds
from kvpilot.policies.roofline import prefill
from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec

FailureMode = Literal["fail", "recompute", "budgeted"]


class FailureAction(enum.Enum):
    FAIL = "fail"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class FailurePolicyConfig:
    """``jitter_budget_s``: stream-seconds of delay recomputes may inflict per
    window; ``max_stall_s``: the longest step any one stream may see;
    ``chunk_tokens``: D's prefill chunk (0 = unchunked); ``retry_delay_s``: time
    for a failed request to surface and be resubmitted through P."""

    mode: FailureMode = "budgeted"
    jitter_budget_s: float = 2.0
    max_stall_s: float = 0.05
    chunk_tokens: int = 512
    retry_delay_s: float = 0.05


VLLM_DEFAULT = FailurePolicyConfig(mode="fail")
VLLM_RECOMPUTE = FailurePolicyConfig(mode="recompute")
KVPILOT_DEFAULT = FailurePolicyConfig()


@dataclass(frozen=True, slots=True)
class FailureDecision:
    action: FailureAction
    fail_s: float
    recompute_s: float
    stall_s: float
    jitter_s: float
    reason: str

    def explain(self) -> str:
        return (
            f"{self.action.value}: recompute on D {self.recompute_s * 1e3:.1f} ms (each step stalls "
            f"{self.stall_s * 1e3:.1f} ms, {self.jitter_s:.2f} stream-s of jitter) vs fail and retry "
            f"{self.fail_s * 1e3:.1f} ms; {self.reason}"
        )


class LoadFailurePolicy:
    """Pure: the caller passes the jitter already spent in the current window."""

    def __init__(
        self,
        model: ModelSpec,
        fmt: KVFormat,
        p_hardware: HardwareSpec,
        d_hardware: HardwareSpec,
        link: LinkSpec,
        config: FailurePolicyConfig = KVPILOT_DEFAULT,
    ) -> None:
        self.model, self.fmt, self.p_hw, self.d_hw, self.link = model, fmt, p_hardware, d_hardware, link
        self.config = config

    def decide(self, prompt: PromptState, running_streams: int, jitter_spent_s: float = 0.0) -> FailureDecision:
        """Decide for one failed load of ``prompt`` (D recomputes beyond its own
        ``d_cached_tokens``), with ``running_streams`` other streams on D."""
        c = self.config
        missing = prompt.effective_tokens
        recompute = prefill(self.model, self.fmt, self.d_hw, missing, prompt.d_cached_tokens)
        if c.chunk_tokens and missing > c.chunk_tokens:
            chunks = math.ceil(missing / c.chunk_tokens)
            stall_s = recompute.seconds / chunks
        else:
            stall_s = recompute.seconds
        stall_s = stall_s if running_streams else 0.0
        jitter_s = recompute.seconds * running_streams
        fail_s = c.retry_delay_s + remote_prefill_seconds(self.model, self.fmt, self.p_hw, self.link, prompt)
        if c.mode == "fail":
            action, reason = FailureAction.FAIL, "mode is fail (vLLM's default)"
        elif c.mode == "recompute":
            action, reason = FailureAction.RECOMPUTE, "mode is recompute"
        elif stall_s > c.max_stall_s:
            action, reason = (
                FailureAction.FAIL,
                f"a step would stall {stall_s * 1e3:.1f} ms > {c.max_stall_s * 1e3:.0f} ms",
            )
        elif jitter_spent_s + jitter_s > c.jitter_budget_s:
            action, reason = (
                FailureAction.FAIL,
                (f"jitter {jitter_spent_s:.2f} + {jitter_s:.2f} stream-s exceeds the budget {c.jitter_budget_s:.2f}"),
            )
        else:
            action, reason = (
                FailureAction.RECOMPUTE,
                (f"within budget ({jitter_spent_s + jitter_s:.2f} of {c.jitter_budget_s:.2f} stream-s)"),
            )
        return FailureDecision(action, fail_s, recompute.seconds, stall_s, jitter_s, reason)
