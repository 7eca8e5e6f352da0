"""Recompute a span on P, or transfer its KV from D (article section 9.3).

A span is tokens P lacks KV for (typically D's generated tokens) at a context
position. Recomputing it costs the *marginal* time it adds to P's pass: an idle
P running a small pass is bound by weight streaming, so extra tokens up to the
roofline crossover are nearly free; a P with queued or running prefill work
pays full compute price. Transferring costs the link's fixed cost plus bytes
over the bandwidth recent transfers achieved, and with the observed failure
rate it costs the time to notice a failure plus the recompute anyway.

The recompute side is priced by the roofline on a hardware spec (the prior) or, once
P has timed enough of its own passes, by :class:`MeasuredPrefill`: the per-token and
per-pair terms of the prefill model fitted to them (:mod:`kvpilot.policies.measured_fit`).
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass

from kvpilot.policies.measured_fit import attention_pairs
from kvpilot.policies.roofline import PassCost, kv_bytes, linear_flops, pass_seconds, prefill
from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec

VLLM_RECOMPUTE_BELOW_TOKENS = 64
"""vLLM's fixed rule for D -> P pulls: recompute spans shorter than this."""


class Choice(enum.Enum):
    RECOMPUTE = "recompute"
    TRANSFER = "transfer"


@dataclass(frozen=True, slots=True)
class TransferSample:
    """One completed transfer: ``nbytes`` in ``seconds`` (including fixed cost)."""

    nbytes: float
    seconds: float


@dataclass(frozen=True, slots=True)
class LinkTelemetry:
    """Recent history of one link; empty means "trust the spec".

    ``samples`` are the transfers as the transport timed them (NIXL's own durations):
    they give the link's rate. ``pulls`` are whole pulls as the waiting request saw
    them, from the moment it started to wait for the peer's KV to the step that found
    the KV arrived (the transport's time plus the engine's: the load is issued in the
    next step's pass and its arrival is collected in a later one): what a pull adds to
    the request beyond moving its bytes is the fixed cost. ``failures`` counts failed
    transfers in the same window as ``samples``; ``mean_failure_s`` is how long a
    failure took to surface (None: use the policy's ``failure_detect_s``)."""

    samples: tuple[TransferSample, ...] = ()
    failures: int = 0
    mean_failure_s: float | None = None
    pulls: tuple[TransferSample, ...] = ()

    @property
    def failure_rate(self) -> float:
        attempts = len(self.samples) + self.failures
        return self.failures / attempts if attempts else 0.0


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """P's load: tokens waiting in its prefill queue and tokens in its running pass."""

    queued_prefill_tokens: int = 0
    running_batch_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Span:
    """``tokens`` positions after ``context`` cached ones; ``new_tokens`` more of the
    same request follow and are prefilled in the same pass whatever we decide."""

    tokens: int
    context: int
    new_tokens: int = 0


@dataclass(frozen=True, slots=True)
class MeasuredPrefill:
    """P's own prefill rates: the per-token (``per_token_s``) and per-pair
    (``per_pair_s``) terms, and the fixed cost of a pass (``fixed_s``), of the prefill
    model ``a + b * n + c * attention_pairs(n, C)`` fitted over ``samples`` of its passes.

    The marginal seconds a span of ``s`` tokens at context ``C`` adds to its request's
    pass, whatever ``new_tokens`` follow it: the fixed cost is paid either way, the
    span's tokens cost ``b * s``, and the pairs of the pass with the span,
    ``attention_pairs(s + m, C)``, exceed those of the pass without it,
    ``attention_pairs(m, C + s)``, by exactly ``attention_pairs(s, C)``. A linear model
    has no weight-bound pass to hide a span in: P's load does not change the price."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float
    samples: int

    def marginal_seconds(self, span: Span) -> float:
        return self.per_token_s * span.tokens + self.per_pair_s * attention_pairs(span.tokens, span.context)

    def explain(self) -> str:
        return (
            f"measured: {self.per_token_s * 1e6:.1f} us/token + {self.per_pair_s * 1e9:.3f} ns/pair "
            f"(fixed {self.fixed_s * 1e3:.1f} ms) over {self.samples} of P's passes"
        )


@dataclass(frozen=True, slots=True)
class RecomputeTransferConfig:
    """``failure_detect_s``: time until a failed pull is noticed, when telemetry
    has none. ``min_samples``: telemetry samples needed before their bandwidth
    replaces the spec's."""

    failure_detect_s: float = 0.1
    min_samples: int = 3


@dataclass(frozen=True, slots=True)
class RecomputeTransferDecision:
    """The decision and both expected costs, in seconds of added latency."""

    choice: Choice
    recompute_s: float
    transfer_s: float
    span: Span
    span_bytes: float
    bandwidth: float
    fixed_s: float
    bandwidth_source: str
    failure_rate: float
    recompute_source: str
    """What priced the recompute side: the roofline on a named hardware spec (with the
    pass's bound), or :meth:`MeasuredPrefill.explain`."""
    measured: bool = False
    """Whether :class:`MeasuredPrefill` priced the recompute side."""

    def cost_of(self, choice: Choice) -> float:
        return self.recompute_s if choice is Choice.RECOMPUTE else self.transfer_s

    def explain(self) -> str:
        other = Choice.TRANSFER if self.choice is Choice.RECOMPUTE else Choice.RECOMPUTE
        return (
            f"{self.choice.value}: {self.span.tokens} tokens at context {self.span.context}; "
            f"recompute {self.recompute_s * 1e3:.2f} ms (marginal, {self.recompute_source}) vs "
            f"transfer {self.transfer_s * 1e3:.2f} ms ({self.span_bytes / 1e6:.1f} MB at "
            f"{self.bandwidth / 1e9:.2f} GB/s + {self.fixed_s * 1e3:.2f} ms from {self.bandwidth_source}, failure rate "
            f"{self.failure_rate:.0%}); {other.value} would cost "
            f"{(self.cost_of(other) - self.cost_of(self.choice)) * 1e3:.2f} ms more"
        )


class RecomputeVsTransferPolicy:
    """Chooses the cheaper way to give P the KV of a span. Pure and stateless."""

    def __init__(
        self,
        model: ModelSpec,
        fmt: KVFormat,
        p_hardware: HardwareSpec,
        link: LinkSpec,
        config: RecomputeTransferConfig = RecomputeTransferConfig(),
    ) -> None:
        self.model, self.fmt, self.hw, self.link, self.config = model, fmt, p_hardware, link, config

    def recompute_seconds(self, span: Span, load: PrefillLoad) -> tuple[float, PassCost]:
        """Marginal pass time the span adds on P, and the pass with the span.

        P's other work (queued and running tokens) counts as linear-layer FLOPs
        and the weights it streams; the request's own ``new_tokens`` add their
        FLOPs over context + span."""
        own = prefill(self.model, self.fmt, self.hw, span.new_tokens, span.context + span.tokens)
        others = linear_flops(self.model, load.queued_prefill_tokens + load.running_batch_tokens)
        base_flops = own.flops + others
        base_bytes = own.bytes or (self.model.weight_bytes if others else 0.0)
        base, _ = pass_seconds(self.hw, base_flops, base_bytes)
        with_span = prefill(self.model, self.fmt, self.hw, span.tokens + span.new_tokens, span.context)
        flops = with_span.flops + others
        seconds, bound = pass_seconds(self.hw, flops, with_span.bytes)
        return seconds - base, PassCost(flops, with_span.attention_flops, with_span.bytes, seconds, bound)

    def link_estimate(self, telemetry: LinkTelemetry) -> tuple[float, float, str]:
        """``(fixed cost s, bytes/s, source)`` of a pull on this link: the transport's
        (:meth:`wire_estimate`), its fixed cost replaced, once ``min_samples`` whole
        pulls were timed, by their median wait beyond moving their bytes at that rate
        (the engine's steps around the transfer are part of what a pull costs)."""
        fixed, rate, source = self.wire_estimate(telemetry)
        waits = [p.seconds - p.nbytes / rate for p in telemetry.pulls]
        if len(waits) < self.config.min_samples:
            return fixed, rate, source
        return max(0.0, statistics.median(waits)), rate, f"{source}, fixed cost from {len(waits)} whole pulls"

    def wire_estimate(self, telemetry: LinkTelemetry) -> tuple[float, float, str]:
        """``(fixed cost s, bytes/s, source)`` of a transfer on this link, as the
        transport timed its ``samples``.

        With at least ``min_samples`` usable samples whose sizes differ by 2x or
        more, both come from a least-squares fit of ``seconds = fixed + bytes / rate``
        (a fit with no positive rate is not used). Samples of one size cannot tell
        the two apart: the spec's fixed cost stands and the median rate of the
        samples net of it is the bandwidth. Fewer samples: the spec's figures.
        Samples no slower than the spec's fixed cost carry no rate and are ignored."""
        usable = [s for s in telemetry.samples if s.seconds > self.link.setup_s and s.nbytes > 0]
        if len(usable) < self.config.min_samples:
            return self.link.setup_s, self.link.effective_bytes_per_s, f"{self.link.name} spec"
        sizes = [s.nbytes for s in usable]
        if max(sizes) >= 2 * min(sizes):
            mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(s.seconds for s in usable)
            var = sum((x - mean_x) ** 2 for x in sizes)
            slope = sum((s.nbytes - mean_x) * (s.seconds - mean_y) for s in usable) / var
            if slope > 0:
                fixed = max(0.0, mean_y - slope * mean_x)
                return fixed, 1.0 / slope, f"a fit of {len(usable)} recent transfers"
        rates = [s.nbytes / (s.seconds - self.link.setup_s) for s in usable]
        return self.link.setup_s, statistics.median(rates), f"{len(usable)} recent transfers"

    def decide(
        self,
        span: Span,
        load: PrefillLoad = PrefillLoad(),
        telemetry: LinkTelemetry = LinkTelemetry(),
        measured: MeasuredPrefill | None = None,
    ) -> RecomputeTransferDecision:
        """Expected added latency of both options; the cheaper wins (ties recompute,
        which needs no remote state). An empty span costs nothing either way. The
        recompute side is ``measured``'s marginal seconds where given, else the
        roofline's on this policy's hardware."""
        if measured is not None:
            recompute_s, source = measured.marginal_seconds(span), measured.explain()
        else:
            recompute_s, with_span = self.recompute_seconds(span, load)
            source = f"roofline on {self.hw.name}: P pass {with_span.bound}-bound"
        nbytes = kv_bytes(self.model, self.fmt, span.tokens)
        fixed_s, bandwidth, link_source = self.link_estimate(telemetry)
        clean = fixed_s + nbytes / bandwidth if nbytes else 0.0
        p_fail = telemetry.failure_rate
        detect = telemetry.mean_failure_s if telemetry.mean_failure_s is not None else self.config.failure_detect_s
        transfer_s = (1 - p_fail) * clean + p_fail * (detect + recompute_s) if nbytes else 0.0
        choice = Choice.RECOMPUTE if recompute_s <= transfer_s else Choice.TRANSFER
        return RecomputeTransferDecision(
            choice,
            recompute_s,
            transfer_s,
            span,
            nbytes,
            bandwidth,
            fixed_s,
            link_source,
            p_fail,
            source,
            measured is not None,
        )


def fixed_threshold_choice(span_tokens: int, threshold: int = VLLM_RECOMPUTE_BELOW_TOKENS) -> Choice:
    """vLLM's rule: recompute spans shorter than ``threshold`` tokens, else transfer."""
    return Choice.RECOMPUTE if span_tokens < threshold else Choice.TRANSFER
