"""The scale-free SLOs of :mod:`benchmarks.sim.goodput`: each request's floor (its TTFT and ITL
alone on an idle worker, :func:`floor`), the share of requests meeting both SLOs
(:func:`attainment`), the order both sides' requests are paired in (:func:`arrival_order`) and
a simulated request's times (:func:`request_times`). Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.fleet.goodput import ITL_SLO_X, TTFT_SLO_X
from benchmarks.fleet.trace import TRACE_BLOCK_TOKENS, PromptShape, TraceRequest
from benchmarks.sim.engine import EngineSpec, SimRequest, decode_ms, prefill_ms
from benchmarks.sim.fleet import DEFAULT_SPEC, KvTransfer


@dataclass(frozen=True, slots=True)
class Floor:
    """Per request (in trace order): the TTFT and ITL it would have alone on an idle worker."""

    ttft_ms: list[float]
    itl_ms: list[float]


def floor(
    trace: Sequence[TraceRequest],
    spec: EngineSpec = DEFAULT_SPEC,
    handoff: KvTransfer | None = None,
    tokens_per_hash: int = TRACE_BLOCK_TOKENS,
) -> Floor:
    """Each request's floor (:mod:`benchmarks.sim.goodput`'s doc): reusable blocks are those of its hash-id prefix that
    an earlier request of the trace already had, at most its last token's block. With a
    ``handoff`` (a disaggregated fleet), plus its KV's move to D and D's first step.
    ``tokens_per_hash``: the tokens each hash id stands for, every prompt scaled as the live
    fleet benchmark scales it (:class:`benchmarks.fleet.trace.PromptShape`)."""
    seen: set[tuple[int, ...]] = set()
    ttft, itl = [], []
    capacity = spec.num_gpu_blocks * spec.block_size
    shape = PromptShape(tokens_per_hash, spec.block_size)
    for entry in trace:
        input_length = shape.input_tokens(entry)
        reused_ids = 0
        for k in range(len(entry.hash_ids)):
            if entry.hash_ids[: k + 1] in seen:
                reused_ids = k + 1
            else:
                break
        for k in range(len(entry.hash_ids)):
            seen.add(entry.hash_ids[: k + 1])
        cap = (input_length - 1) // spec.block_size * spec.block_size
        cached = min(cap, reused_ids * tokens_per_hash)
        step_ms = decode_ms(input_length / capacity) / spec.speedup_ratio
        alone_ms = prefill_ms(input_length - cached) / spec.speedup_ratio
        if handoff is not None:
            alone_ms += handoff.delay_ms(input_length) + step_ms
        ttft.append(alone_ms)
        itl.append(step_ms)
    return Floor(ttft, itl)


def attainment(ttft_ms: Sequence[float], itl_ms: Sequence[float | None], base: Floor) -> float:
    """The share of requests meeting both SLOs (a request of one output token has no ITL to miss)."""
    met = sum(
        1
        for t, i, ft, fi in zip(ttft_ms, itl_ms, base.ttft_ms, base.itl_ms, strict=True)
        if t <= TTFT_SLO_X * ft and (i is None or i <= ITL_SLO_X * fi)
    )
    return met / len(ttft_ms)


def arrival_order(trace: Sequence[TraceRequest], lengths: Sequence[int] | None = None) -> list[int]:
    """The trace's indices by (arrival, prompt, output length): how both sides' requests are
    paired with their floors (Dynamo's replay reports its requests under random ids).
    ``lengths``: the prompts' lengths where they were scaled (else each ``input_length``)."""
    prompt = [e.input_length for e in trace] if lengths is None else lengths
    return sorted(range(len(trace)), key=lambda i: (trace[i].timestamp_ms, prompt[i], trace[i].output_length))


def request_times(requests: Sequence[SimRequest]) -> tuple[list[float], list[float | None]]:
    """Each simulated request's TTFT (ms; infinite if it never started) and mean ITL (ms;
    ``None`` for one token), in the order given."""
    ttft = [r.first_token_ms - r.arrival_ms if r.first_token_ms is not None else float("inf") for r in requests]
    itl: list[float | None] = [
        (r.token_ms[-1] - r.token_ms[0]) / (len(r.token_ms) - 1) if len(r.token_ms) > 1 else None for r in requests
    ]
    return ttft, itl
