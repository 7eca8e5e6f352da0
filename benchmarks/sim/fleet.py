"""A fleet of :class:`benchmarks.sim.engine.SimEngine` workers in virtual time, fed a Mooncake trace:
the arrivals at their timestamps (times ``1 / arrival_speedup``), each routed on arrival,
each worker running passes back to back while it has work. Pure and deterministic.

Aggregated (every worker prefills and decodes) or disaggregated (``prefill_workers`` more:
a request placed on a (P, D) pair is prefilled on P as the mocker does it, its KV moves to
D in :meth:`KvTransfer.delay_ms`, and D decodes it; a request placed on D alone is prefilled
there, as kvpilot's conditional disaggregation may choose).

Prompts are named as Dynamo's replay names them: each ``hash_id`` of the trace stands for
``trace_block_size`` tokens, and the engine's blocks of ``block_size`` tokens are named by
their whole prefix of hash ids (two requests share a block exactly when they share the hash
ids up to it).

    python -m benchmarks.sim_vs_dynamo --trace benchmarks/traces/mooncake_conversation_trace.jsonl --workers 16
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.fleet.trace import TRACE_BLOCK_TOKENS, PromptShape, TraceRequest
from benchmarks.sim.engine import EngineSpec, PassResult, SimEngine, SimRequest

PASS_END, KV_EVENTS, HANDOFF, ARRIVAL, WAKE = range(5)
"""Event kinds. Events at one instant are taken in the order they were scheduled; only once
the instant's events are all taken do the handoffs of the prefills that ended in it go to
their decode workers (by prefill worker, as the replay does) and idle workers with work
start their passes, so requests that arrive together share a pass, as in Dynamo's replay.
A ``WAKE`` is a host transfer's end on an idle worker whose requests wait for one."""
DEFAULT_SPEC = EngineSpec()
"""Dynamo 1.6.1's mocker defaults."""


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """The time a request's KV takes from P to D, as the mocker prices its handoff
    (``kv_transfer_bandwidth`` in GB/s and ``kv_transfer_bytes_per_token`` on the prefill
    engine, the whole prompt moved): instant unless both are set, as in Dynamo 1.6.1."""

    bandwidth_gb_s: float | None = None
    bytes_per_token: int | None = None

    def delay_ms(self, tokens: int) -> float:
        if not self.bandwidth_gb_s or not self.bytes_per_token or self.bandwidth_gb_s <= 0:
            return 0.0
        return tokens * self.bytes_per_token / (self.bandwidth_gb_s * 1e9) * 1e3

    def engine_args(self) -> dict[str, float | int]:
        """The mocker's prefill-engine arguments for this transfer (none when instant)."""
        if self.delay_ms(1) == 0.0:
            return {}
        assert self.bandwidth_gb_s is not None and self.bytes_per_token is not None
        return {"kv_transfer_bandwidth": self.bandwidth_gb_s, "kv_transfer_bytes_per_token": self.bytes_per_token}


INSTANT = KvTransfer()


@dataclass(frozen=True, slots=True)
class Pools:
    """The fleet's shape: ``workers`` co-located workers, or decode workers behind
    ``prefill_workers`` with each ``handoff`` priced as :class:`KvTransfer` prices it; every
    worker an engine of ``spec``."""

    workers: int
    prefill_workers: int = 0
    handoff: KvTransfer = INSTANT
    spec: EngineSpec = DEFAULT_SPEC

    def __str__(self) -> str:
        return f"{self.prefill_workers} P + {self.workers} D" if self.prefill_workers else f"{self.workers} workers"


Placed = tuple[int | None, int | None]
"""Where a request goes: the index of its prefill worker (``None``: its decode worker
prefills it) and of its decode worker, each within its pool; a decode worker ``None``
(with a prefill worker) is chosen when P's prefill ends (:meth:`Placement.place_decode`)."""


class Placement(Protocol):
    """A router in the simulation: it places each request on arrival and hears what a live
    router hears, in virtual time (the workers' KV events at each pass's end, after
    ``kv_event_lag_ms``, each worker by its index in ``[*prefill, *decode]``; each request's
    prefill done (its first token, or P's answer) and its end)."""

    def place(self, request: SimRequest, prefill: Sequence[SimEngine], decode: Sequence[SimEngine]) -> Placed:
        """Where ``request`` goes; ``prefill`` is empty in an aggregated fleet."""
        ...

    def place_decode(self, request: SimRequest, decode: Sequence[SimEngine]) -> int:
        """The decode worker of a request placed without one, once its prefill ended."""
        ...

    def kv_events(self, worker: int, changes: PassResult) -> None:
        """A pass's KV events: the GPU blocks it stored and evicted, and what the worker's
        host tier stored and evicted since its last pass (``changes``' fields)."""
        ...

    def first_token(self, request: SimRequest) -> None: ...

    def finished(self, request: SimRequest) -> None: ...


def block_names(
    prompt_len: int, hash_ids: Sequence[int], block_size: int, tokens_per_hash: int = TRACE_BLOCK_TOKENS
) -> list[object]:
    """The names of the full engine blocks of a ``prompt_len``-token prompt whose hash ids
    stand for ``tokens_per_hash`` tokens each: each names its prefix of hash ids and its
    place within the last one."""
    per = tokens_per_hash // block_size
    names: list[object] = []
    parent: object = None
    for j in range(prompt_len // block_size):
        parent = hash((parent, hash_ids[j // per], j % per))
        names.append(parent)
    return names


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, as both sides of :mod:`benchmarks.sim.compare` read it)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class RoundRobin:
    """Cyclic, as Dynamo's replay ``round_robin``: a worker in arrival order, or, disaggregated,
    a prefill worker in arrival order and a decode worker in the order prefills end, each pool
    with its own turn; hears nothing."""

    def __init__(self) -> None:
        self._turn = 0
        self._decode_turn = 0

    def place(self, request: SimRequest, prefill: Sequence[SimEngine], decode: Sequence[SimEngine]) -> Placed:
        turn = self._turn
        self._turn += 1
        return (turn % len(prefill), None) if prefill else (None, turn % len(decode))

    def place_decode(self, request: SimRequest, decode: Sequence[SimEngine]) -> int:
        turn = self._decode_turn
        self._decode_turn += 1
        return turn % len(decode)

    def kv_events(self, worker: int, changes: PassResult) -> None:
        return None

    def first_token(self, request: SimRequest) -> None:
        return None

    def finished(self, request: SimRequest) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Report:
    """Per request: TTFT, mean inter-token latency, reused prompt tokens."""

    ttft_ms: list[float]
    itl_ms: list[float]
    reused_tokens: int
    input_tokens: int
    blocked_admissions: int
    host_reused_tokens: int = 0
    """Of ``reused_tokens``, those restored from the workers' host tiers."""

    def summary(self) -> dict[str, float]:
        return {
            "requests": float(len(self.ttft_ms)),
            "mean_ttft_ms": statistics.fmean(self.ttft_ms),
            "p99_ttft_ms": percentile(self.ttft_ms, 0.99),
            "mean_itl_ms": statistics.fmean(self.itl_ms) if self.itl_ms else float("nan"),
            "reuse": self.reused_tokens / self.input_tokens if self.input_tokens else 0.0,
            "host_reused_tokens": float(self.host_reused_tokens),
        }


def simulate(
    trace: Sequence[TraceRequest],
    workers: int,
    placement: Placement,
    spec: EngineSpec = DEFAULT_SPEC,
    arrival_speedup: float = 1.0,
    kv_event_lag_ms: float = 0.0,
    requests_out: list[SimRequest] | None = None,
    tokens_per_hash: int = TRACE_BLOCK_TOKENS,
    closed_loop_sessions: bool = True,
    prefill_workers: int = 0,
    transfer: KvTransfer = INSTANT,
) -> Report:
    """Run ``trace`` through ``workers`` engines of ``spec`` (decode workers when
    ``prefill_workers`` is not 0, with ``transfer`` pricing each handoff); ``placement``
    places each request.
    ``requests_out`` (when given) receives every request, in trace order, as it ended.
    ``tokens_per_hash``: the tokens each hash id stands for, every prompt scaled as the live
    fleet benchmark's ``--tokens-per-hash`` scales it (:class:`benchmarks.fleet.trace.PromptShape`).
    ``closed_loop_sessions``: a session's turn is sent when its previous one ended plus the
    gap between their timestamps (as Dynamo's replay sends it); False: at its own timestamp
    (as the live fleet benchmark does)."""
    engines = [SimEngine(spec) for _ in range(prefill_workers + workers)]
    prefill_pool, decode_pool = engines[:prefill_workers], engines[prefill_workers:]
    handoffs: dict[int, tuple[SimRequest, int | None]] = {}  # request id -> the request, its decode worker
    events: list[tuple[float, int, int, Any]] = []  # (time, order, kind, payload): see PASS_END
    order = 0
    requests: list[SimRequest] = []
    next_turn: dict[int, tuple[SimRequest, float]] = {}  # a turn's request id -> its session's next turn, its gap
    last_turn: dict[str, tuple[SimRequest, float]] = {}  # a session -> its latest turn, that turn's timestamp
    first_ms = trace[0].timestamp_ms if trace else 0  # arrivals count from the first request
    shape = PromptShape(tokens_per_hash, spec.block_size)
    for rid, entry in enumerate(trace):
        prompt_len = shape.input_tokens(entry)
        request = SimRequest(
            rid,
            prompt_len,
            max(1, entry.output_length),
            block_names(prompt_len, entry.hash_ids, spec.block_size, tokens_per_hash),
            (entry.timestamp_ms - first_ms) / arrival_speedup,
            entry.hash_ids,
            entry.session_id,
        )
        requests.append(request)
        previous = last_turn.get(entry.session_id) if entry.session_id is not None else None
        if entry.session_id is not None:
            last_turn[entry.session_id] = (request, request.arrival_ms)
        if previous is not None and closed_loop_sessions:  # sent when the previous turn ends, after the gap
            next_turn[previous[0].rid] = (request, request.arrival_ms - previous[1])
            continue
        heapq.heappush(events, (request.arrival_ms, order, ARRIVAL, request))
        order += 1
    running_pass: list[PassResult | None] = [None] * len(engines)
    wake_at: list[float | None] = [None] * len(engines)  # each idle worker's pending WAKE
    woken: set[int] = set()  # workers given work this instant
    prefilled: list[tuple[int, SimRequest]] = []  # prefills that ended this instant: P's index, the request

    def end_of_instant(now: float) -> None:
        """The instant's events are all taken: hand the prefills that ended in it to their
        decode workers, then start a pass on every idle worker that has work."""
        nonlocal order
        for _, request in sorted(prefilled, key=lambda ended: ended[0]):
            _, d = handoffs.pop(request.rid)
            if d is None:
                d = placement.place_decode(request, decode_pool)
            handoff_at = now + transfer.delay_ms(request.prompt_len)
            heapq.heappush(events, (handoff_at, order, HANDOFF, (request, prefill_workers + d)))
            order += 1
        prefilled.clear()
        for index in sorted(woken):
            engine = engines[index]
            if running_pass[index] is not None:
                continue
            engine.advance_host(now)
            if engine.busy:
                result = engine.run_pass(now)
                running_pass[index] = result
                heapq.heappush(events, (result.end_ms, order, PASS_END, index))
                order += 1
            else:
                wake = engine.next_host_deadline_ms()
                if wake is not None and wake != wake_at[index]:
                    wake_at[index] = wake
                    heapq.heappush(events, (wake, order, WAKE, index))
                    order += 1
        woken.clear()

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == ARRIVAL:
            p, d = placement.place(payload, prefill_pool, decode_pool)
            if p is None:
                assert d is not None, "a request prefilled on its decode worker needs one"
                engines[prefill_workers + d].submit(payload)
                woken.add(prefill_workers + d)
            else:  # P serves a one-token copy; the request waits for its KV
                handoffs[payload.rid] = (payload, d)
                prefill_pool[p].submit(
                    SimRequest(payload.rid, payload.prompt_len, 1, payload.blocks, payload.arrival_ms, payload.hash_ids)
                )
                woken.add(p)
        elif kind == KV_EVENTS:
            placement.kv_events(*payload)
        elif kind == WAKE:
            if wake_at[payload] == now:
                wake_at[payload] = None
            woken.add(payload)
        elif kind == HANDOFF:
            request, d = payload
            request.transferred = True
            engines[d].submit(request)
            woken.add(d)
        else:
            result = running_pass[payload]
            assert result is not None
            running_pass[payload] = None
            first = [r for r in result.emitting if r.first_token_ms is None and not r.transferred]
            finished = engines[payload].finish_pass(result)
            if result.stored or result.evicted or result.host_stored or result.host_evicted:
                heapq.heappush(events, (now + kv_event_lag_ms, order, KV_EVENTS, (payload, result)))
                order += 1
            woken.add(payload)
            if payload < prefill_workers:  # P's copies: their prefill is done, their KV moves to D
                for copy in finished:
                    request, _ = handoffs[copy.rid]
                    request.reused_tokens = copy.reused_tokens
                    placement.first_token(request)
                    prefilled.append((payload, request))
                continue
            for request in first:
                placement.first_token(request)
            for request in finished:
                placement.finished(request)
                follow = next_turn.pop(request.rid, None)
                if follow is not None:
                    turn, gap = follow
                    turn.arrival_ms = now + gap
                    heapq.heappush(events, (turn.arrival_ms, order, ARRIVAL, turn))
                    order += 1
        if not events or events[0][0] > now:
            end_of_instant(now)
    if requests_out is not None:
        requests_out.extend(requests)
    ttft = [r.first_token_ms - r.arrival_ms for r in requests if r.first_token_ms is not None]
    itl = [(r.token_ms[-1] - r.token_ms[0]) / (len(r.token_ms) - 1) for r in requests if len(r.token_ms) > 1]
    return Report(
        ttft,
        itl,
        sum(r.reused_tokens for r in requests),
        sum(r.prompt_len for r in requests),
        sum(e.blocked_admissions for e in engines),
        sum(r.host_reused_tokens for r in requests),
    )
