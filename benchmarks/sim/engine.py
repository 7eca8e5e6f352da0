"""One simulated engine in virtual time, modelled as Dynamo 1.6.1's mocker models a vLLM
worker (AISimulate 0.13.0's vLLM core, read from its source: ``engine/common/perf_model.rs``,
``engine/scheduler/vllm/core.rs``, ``engine/cache/vllm_block_pool.rs``). Pure: no clock, no I/O;
the caller passes the time in and gets the time a pass ends.

- **Timing** (the polynomial model, ms, divided by ``speedup_ratio``): a pass lasts
  ``prefill(T) + decode(p)``. ``prefill(T) = 4.209989e-07 T^2 + 1.518344e-02 T + 16.50142``
  (0 without prompt tokens), ``T = n * (floor(sum(isl) / n) - floor(sum(prefix) / n))`` over the
  ``n`` requests with prompt tokens in the pass (``isl`` counts what was computed before the
  pass plus the chunk, ``prefix`` what was computed or cached before it).
  ``decode(p) = max(1, -25.74 p^2 + 54.01 p + 5.74)`` over the requests already decoding (0 if
  none), ``p = min(1, their context tokens / (num_gpu_blocks * block_size))``. A request whose
  prefill ends in a pass emits its first token at the pass's end without a decode step of its
  own (1.6.1: one request alone has TTFT = its prefill).
- **Scheduling** (continuous batching, chunked prefill): ``max_num_batched_tokens`` tokens a
  pass; running requests first, in admission order (a decode takes 1, a prefill its next
  chunk); then the waiting queue in order while fewer than ``max_num_seqs`` run, stopping at
  the first request whose blocks do not fit (no preemption: see :class:`SimEngine`).
- **KV cache** (prefix caching, LRU): blocks of ``block_size`` tokens named by their prompt
  prefix; a request reuses the longest run of cached blocks from its start (held by running
  requests or free in the LRU), at most ``floor((len - 1) / block_size)`` blocks (the last token
  is always computed); a block is cached once computed, visible to requests scheduled later in
  the same pass; a finished request's blocks go to the LRU tail leaf first, and eviction takes
  the LRU head only when fresh blocks are needed. The pass's new blocks are its stored KV
  events.
- **Disaggregated** (the mocker's prefill-first handoff): a prefill worker serves a copy of the
  request capped at one output token (hidden from the report); once its KV has moved, the
  decode worker admits the request with its whole prompt computed (its blocks installed, no
  prefill compute) and decodes it from the pass that admits it: its first token ends that
  pass.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFILL_MS = (4.209989e-07, 1.518344e-02, 1.650142e01)
"""The polynomial prefill model's coefficients (T^2, T, 1), milliseconds."""
DECODE_MS = (-25.74, 54.01, 5.74)
"""The polynomial decode model's coefficients (p^2, p, 1), milliseconds, floored at 1 ms."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Dynamo 1.6.1 mocker defaults for the vLLM backend."""

    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    speedup_ratio: float = 1.0


def prefill_ms(tokens: int) -> float:
    if tokens <= 0:
        return 0.0
    a, b, c = PREFILL_MS
    return max(0.0, a * tokens * tokens + b * tokens + c)


def decode_ms(utilization: float) -> float:
    a, b, c = DECODE_MS
    p = min(1.0, utilization)
    return max(1.0, a * p * p + b * p + c)


@dataclass(slots=True)
class SimRequest:
    """A request as the engine sees it: ``blocks`` names its full prompt blocks (each key
    names its whole prefix), ``arrival_ms`` when the client sent it."""

    rid: int
    prompt_len: int
    output_len: int
    blocks: Sequence[object]
    arrival_ms: float
    hash_ids: Sequence[int] = ()
    """The trace's hash ids of its prompt (a router that names tokens synthesizes them)."""
    session: str | None = None
    """The trace's ``session_id`` (a router that knows sessions is told it)."""
    transferred: bool = False
    """Its prompt's KV was computed elsewhere and moved here: admitted computed (module doc)."""
    computed: int = 0
    generated: int = 0
    reused_tokens: int = 0
    held: list[object] = field(default_factory=list)
    """The cached blocks this request pins (in order)."""
    private_blocks: int = 0
    """Blocks it holds that no other request can reuse (its partial and generated blocks)."""
    first_token_ms: float | None = None
    token_ms: list[float] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


Stored = tuple[SimRequest, int]
"""A block that became cached: the request that computed it and the block's index in its prompt."""


@dataclass(slots=True)
class PassResult:
    """What a pass did: when it ends, the blocks it stored and evicted (its KV events), who
    emits a token."""

    end_ms: float
    stored: list[Stored]
    evicted: list[object]
    emitting: list[SimRequest]


class SimEngine:
    """A worker: waiting queue, running batch, block cache. Not preempting: Dynamo's vLLM core
    preempts the newest request when a running one cannot grow; with the default 16,384
    blocks of 64 tokens per worker the traces here never fill it (:attr:`blocked_admissions`
    counts what waited for blocks instead)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.refs: dict[object, int] = {}
        self.free_cached: OrderedDict[object, None] = OrderedDict()
        self.private_blocks = 0
        self.blocked_admissions = 0
        self.evicted: list[object] = []
        """Blocks evicted since the last pass was scheduled (reported with the next one)."""

    # ---- the cache ------------------------------------------------------------------
    def _active_blocks(self) -> int:
        return len(self.refs) + self.private_blocks

    def _cached_prefix(self, request: SimRequest) -> int:
        """Blocks of ``request``'s prompt cached from its start, capped so its last token is computed."""
        cap = (request.prompt_len - 1) // self.spec.block_size
        hits = 0
        for key in request.blocks[:cap]:
            if key in self.refs or key in self.free_cached:
                hits += 1
            else:
                break
        return hits

    def _take(self, blocks: int) -> None:
        """Room for ``blocks`` fresh blocks: evict from the LRU head only what is short."""
        short = self._active_blocks() + len(self.free_cached) + blocks - self.spec.num_gpu_blocks
        while short > 0 and self.free_cached:
            self.evicted.append(self.free_cached.popitem(last=False)[0])
            short -= 1

    def _pin(self, key: object) -> None:
        if key in self.free_cached:
            del self.free_cached[key]
        self.refs[key] = self.refs.get(key, 0) + 1

    def _release(self, request: SimRequest) -> None:
        for key in reversed(request.held):  # leaf first: suffixes leave the cache before parents
            count = self.refs[key] - 1
            if count:
                self.refs[key] = count
            else:
                del self.refs[key]
                self.free_cached[key] = None
        self.private_blocks -= request.private_blocks
        request.held, request.private_blocks = [], 0

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.spec.block_size)

    def _prefill_chunk(
        self, request: SimRequest, budget: int, stored: list[Stored], chunks: list[tuple[int, int]]
    ) -> int:
        """Compute ``request``'s next prefill chunk (at most ``budget`` tokens) in this pass,
        noting it in ``chunks``; returns its tokens."""
        chunk = min(request.prompt_len - request.computed, budget)
        chunks.append((request.computed, chunk))
        request.computed += chunk
        self._grow(request, stored)
        return chunk

    def _grow(self, request: SimRequest, stored: list[Stored]) -> None:
        """``request`` has computed ``request.computed`` tokens: its full prompt blocks are cached
        (new ones are stored), the rest of its sequence is private blocks."""
        bs = self.spec.block_size
        full = min(request.computed, request.prompt_len) // bs
        while len(request.held) < full:
            key = request.blocks[len(request.held)]
            if key not in self.refs and key not in self.free_cached:
                self._take(1)
                stored.append((request, len(request.held)))
            self._pin(key)
            request.held.append(key)
        private = self._blocks_for(request.computed + request.generated) - len(request.held)
        if private > request.private_blocks:
            self._take(private - request.private_blocks)
            self.private_blocks += private - request.private_blocks
            request.private_blocks = private

    # ---- passes ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def submit(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def run_pass(self, now_ms: float) -> PassResult:
        """Schedule one pass starting at ``now_ms``; the caller calls :meth:`finish_pass` at its end."""
        spec = self.spec
        budget = spec.max_num_batched_tokens
        stored: list[Stored] = []
        chunks: list[tuple[int, int]] = []  # per prefilling request: tokens computed before the pass, its chunk
        decoding_context = 0
        decoding = False
        emitting: list[SimRequest] = []
        for request in self.running:
            if budget <= 0:
                break
            if request.prefilling:
                budget -= self._prefill_chunk(request, budget, stored, chunks)
                if request.computed >= request.prompt_len:  # its prefill ends in this pass
                    emitting.append(request)
            else:
                budget -= 1
                decoding = True
                decoding_context += request.seq_len
                emitting.append(request)
        while self.waiting and len(self.running) < spec.max_num_seqs and budget > 0:
            head = self.waiting[0]
            cached = self._cached_prefix(head)
            needed = self._blocks_for(head.prompt_len) - cached
            if needed > spec.num_gpu_blocks - self._active_blocks():
                self.blocked_admissions += 1
                break
            self.waiting.popleft()
            self.running.append(head)
            if head.transferred:  # its KV installed, it decodes in this pass
                head.computed = head.prompt_len
                self._grow(head, stored)
                budget -= 1
                decoding = True
                decoding_context += head.seq_len
                emitting.append(head)
                continue
            head.computed = head.reused_tokens = cached * spec.block_size
            budget -= self._prefill_chunk(head, budget, stored, chunks)
            if not head.prefilling:
                emitting.append(head)
        n = len(chunks)
        isl, prefix = sum(before + chunk for before, chunk in chunks), sum(before for before, _ in chunks)
        tokens = n * (isl // n - prefix // n) if n else 0
        utilization = decoding_context / (spec.num_gpu_blocks * spec.block_size)
        duration = prefill_ms(tokens) + (decode_ms(utilization) if decoding else 0.0)
        evicted, self.evicted = self.evicted, []
        return PassResult(now_ms + duration / spec.speedup_ratio, stored, evicted, emitting)

    def finish_pass(self, result: PassResult) -> list[SimRequest]:
        """The pass of ``result`` ended: each emitting request gets a token; returns the finished."""
        finished = []
        for request in result.emitting:
            request.token_ms.append(result.end_ms)
            if request.first_token_ms is None:
                request.first_token_ms = result.end_ms
            request.generated += 1
            if request.generated >= request.output_len:
                finished.append(request)
            else:
                self._grow(request, [])
        for request in finished:
            self.running.remove(request)
            self._release(request)
        return finished
