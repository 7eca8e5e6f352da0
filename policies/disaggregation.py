"""Local or remote prefill: conditional disaggregation (article section 7).

Dynamo's default serves a request on the decode worker D when its effective
prompt (the prompt minus D's own cached prefix) is under 2,048 tokens and under
70% of the raw prompt. kvpilot keeps those thresholds and adds a decode-busy
guard (D's KV usage) and a cost-model comparison: local prefill must not stall
D's running streams longer than a budget, and its TTFT plus the stall it imposes on
each running stream must beat the remote path (P's queue, P's prefill, the handoff of
the KV D lacks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpilot.policies.roofline import kv_bytes, linear_flops, pass_seconds, prefill, weight_stream_seconds
from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec
from kvpilot.policies.typed_config import TypedConfig


class Where(enum.Enum):
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class PromptState:
    """A prompt of ``prompt_tokens``; D already caches ``d_cached_tokens`` of it,
    the chosen P ``p_cached_tokens``; P has ``p_queued_tokens`` of prefill queued."""

    prompt_tokens: int
    d_cached_tokens: int = 0
    p_cached_tokens: int = 0
    p_queued_tokens: int = 0

    @property
    def effective_tokens(self) -> int:
        return self.prompt_tokens - self.d_cached_tokens


@dataclass(frozen=True, slots=True)
class DecodeState:
    """D's ``kv_usage`` (fraction of KV blocks in use) and its running decode streams."""

    kv_usage: float = 0.0
    running_streams: int = 0


class LocalPrefillConfig(TypedConfig, frozen=True):
    """Thresholds (None disables one), the decode-busy guard, and the cost check."""

    max_local_tokens: int | None = 2048
    """Prompts whose tokens left to prefill (beyond D's cached prefix) exceed this are
    prefilled remotely; null: no limit."""
    max_local_fraction: float | None = 0.7
    """Prompts whose uncached share exceeds this are prefilled remotely; null: no limit."""
    decode_busy_kv_usage: float | None = None
    """D's KV usage at or above which a local prefill on D is out; null: no guard."""
    compare_costs: bool = False
    """Also require a local prefill to stall D's running streams at most ``max_stall_s``
    and to cost less than the remote one, its cost its own TTFT plus the stall it imposes
    on each of D's running streams (article section 9.2, option 5: good while D is lightly
    loaded, poor when D is full)."""
    max_stall_s: float = 0.05
    """The longest pause an unchunked local prefill may impose on D's running streams
    (with ``compare_costs``)."""


DYNAMO_DEFAULT = LocalPrefillConfig()
KVPILOT_DEFAULT = LocalPrefillConfig(decode_busy_kv_usage=0.9, compare_costs=True)


@dataclass(frozen=True, slots=True)
class MeasuredTimes:
    """Measured predicted TTFTs of the local path (D prefills) and of the remote path
    (P's queue and prefill, D's read), each with D's first step and the overhead
    measured around that path, and the stall a local prefill imposes on D's running
    streams; they replace the roofline's in :meth:`LocalVsRemotePolicy.decide`."""

    local_s: float
    remote_s: float
    local_stall_s: float
    """The pause a local prefill adds to each of D's running streams' steps: its prefill
    beyond the decode step those streams run anyway."""


@dataclass(frozen=True, slots=True)
class LocalRemoteDecision:
    where: Where
    local_s: float
    remote_s: float
    stall_s: float
    reasons: tuple[str, ...]
    guards_ok: bool = True
    """Every check but the stall budget and the cost comparison passed: local is
    possible, and only its price (its own and the stall it imposes) speaks against it."""
    stalled_streams: int = 0
    """D's running streams, each paused ``stall_s`` by a local prefill."""

    @property
    def local_priced_s(self) -> float:
        """The local path's price: its TTFT plus the stall it imposes on each of D's running streams."""
        return self.local_s + self.stall_s * self.stalled_streams

    def explain(self) -> str:
        return (
            f"{self.where.value} prefill: local {self.local_s * 1e3:.1f} ms (stalls D's streams "
            f"{self.stall_s * 1e3:.1f} ms) vs remote {self.remote_s * 1e3:.1f} ms; " + "; ".join(self.reasons)
        )


def remote_prefill_seconds(
    model: ModelSpec, fmt: KVFormat, p_hw: HardwareSpec, link: LinkSpec, prompt: PromptState
) -> float:
    """TTFT contribution of the remote path: P drains its queue (linear FLOPs of
    the queued tokens), prefills what it lacks, then hands D the KV D lacks."""
    queue_s, _ = pass_seconds(p_hw, linear_flops(model, prompt.p_queued_tokens), 0.0)
    own = prefill(model, fmt, p_hw, prompt.prompt_tokens - prompt.p_cached_tokens, prompt.p_cached_tokens)
    handoff = link.transfer_seconds(kv_bytes(model, fmt, prompt.effective_tokens))
    return queue_s + own.seconds + handoff


class LocalVsRemotePolicy:
    """Decides where one request's prefill runs. Pure and stateless."""

    def __init__(
        self,
        model: ModelSpec,
        fmt: KVFormat,
        p_hardware: HardwareSpec,
        d_hardware: HardwareSpec,
        link: LinkSpec,
        config: LocalPrefillConfig = KVPILOT_DEFAULT,
    ) -> None:
        self.model, self.fmt, self.p_hw, self.d_hw, self.link = model, fmt, p_hardware, d_hardware, link
        self.config = config

    def decide(
        self, prompt: PromptState, decode: DecodeState = DecodeState(), measured: MeasuredTimes | None = None
    ) -> LocalRemoteDecision:
        """Local only if every enabled check passes; reasons list each check's verdict.
        ``measured``: the local and remote seconds to use instead of the roofline's."""
        c = self.config
        eff = prompt.effective_tokens
        if measured is not None:
            local_s, remote_s, local_stall_s = measured.local_s, measured.remote_s, measured.local_stall_s
        else:
            local_s = prefill(self.model, self.fmt, self.d_hw, eff, prompt.d_cached_tokens).seconds
            # the running streams' step streams the weights anyway: the prefill's pass costs them the rest
            local_stall_s = max(0.0, local_s - weight_stream_seconds(self.model, self.d_hw))
            remote_s = remote_prefill_seconds(self.model, self.fmt, self.p_hw, self.link, prompt)
        stall_s = local_stall_s if decode.running_streams else 0.0
        checks: list[tuple[bool, str]] = []
        if c.max_local_tokens is not None:
            checks.append((eff < c.max_local_tokens, f"effective prompt {eff} vs limit {c.max_local_tokens}"))
        if c.max_local_fraction is not None:
            share = eff / prompt.prompt_tokens if prompt.prompt_tokens else 0.0
            checks.append((share < c.max_local_fraction, f"effective share {share:.0%} vs {c.max_local_fraction:.0%}"))
        if c.decode_busy_kv_usage is not None:
            checks.append(
                (
                    decode.kv_usage <= c.decode_busy_kv_usage,
                    f"D KV usage {decode.kv_usage:.0%} vs guard {c.decode_busy_kv_usage:.0%}",
                )
            )
        guards_ok = all(ok for ok, _ in checks)
        if c.compare_costs:
            checks.append(
                (
                    stall_s <= c.max_stall_s,
                    (
                        f"stall on {decode.running_streams} streams "
                        f"{stall_s * 1e3:.1f} ms vs budget {c.max_stall_s * 1e3:.0f} ms"
                    ),
                )
            )
            priced_s = local_s + stall_s * decode.running_streams  # LocalRemoteDecision.local_priced_s
            cheaper = "local cheaper" if priced_s <= remote_s else "remote cheaper"
            checks.append(
                (
                    priced_s <= remote_s,
                    (
                        f"{cheaper}: local {local_s * 1e3:.1f} ms + its stall on {decode.running_streams} streams "
                        f"= {priced_s * 1e3:.1f} ms vs {remote_s * 1e3:.1f} ms"
                    ),
                )
            )
        where = Where.LOCAL if all(ok for ok, _ in checks) else Where.REMOTE
        reasons = tuple(f"{'ok' if ok else 'NO'}: {text}" for ok, text in checks)
        return LocalRemoteDecision(where, local_s, remote_s, stall_s, reasons, guards_ok, decode.running_streams)
