"""One simulated engine in virtual time, modelled as Dynamo 1.6.1's mocker models a vLLM
worker (AISimulate 0.13.0's vLLM core, read from its source: ``engine/common/perf_model.rs``,
``engine/scheduler/vllm/core.rs``, ``engine/cache/vllm_block_pool.rs``, and for the host tier
the files named below). Pure: no clock, no I/O;
the caller passes the time in and gets the time a pass ends.

This module's :class:`SimEngine` schedules the passes; the spec and timing model are
:mod:`benchmarks.sim.spec`'s, the request and pass records :mod:`benchmarks.sim.request`'s,
the host pool :mod:`benchmarks.sim.host_tier`'s (all imported here too).

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
- **Generated blocks** (``cache_generated_blocks``, off by default; ``--host-blocks`` sets it): a
  finished request's full blocks past its prompt (``(prompt + generated - 1) // block_size``,
  the last token's KV never computed) stay cached in the LRU, leaf first, ahead of its prompt
  blocks, as the mocker keeps them; no prompt names them, and their evictions are not
  reported. Off, they are freed at once (as this simulator always did): only a cache that
  evicts tells the two apart.
- **Host tier** (``num_host_blocks`` > 0; AISimulate 0.13.0's native host offload with a
  private pool: ``engine/host_offload/tier.rs``, ``engine/scheduler/vllm/host_offload.rs``
  and their calls in ``core.rs``): a block moves ``block_size * kv_bytes_per_token`` bytes.
  *Write-through*: after a pass is scheduled, each request it scheduled offers its prompt
  blocks computed since its cursor (one cohort; only full prompt blocks, only those the host
  neither holds nor is storing); the missing ones take host entries at once (evicting LRU
  victims outside the cohort, or retrying next pass if too few), and every prompt block of
  the request is touched, last first. The pass's stores are submitted on the D2H lane when it
  ends (FIFO: start ``max(lane tail, end)``, duration bytes / bandwidth, first-byte latency 0
  as the mocker's default). A stored block becomes resident, one recency epoch per completed
  transfer (ties by the block's name, as the mocker's by its hash). *Fence*: a GPU block
  evicted while its copy runs cannot be written before the copy ends: every later pass starts
  no earlier (``compute_not_before_ms``). *Restore*: a waiting request's lookup (while the
  pass has budget and room) touches its prompt blocks, last first; after its GPU hit (all
  cached full blocks, uncapped) the host's run of resident blocks is restored: its GPU prefix
  pinned and blocks reserved for the run (after any copy from them ends), the H2D queued on
  its FIFO lane, the host blocks pinned out of the LRU; the request is set aside, the pass
  goes on to the next. A run with a block still being stored or loaded defers the request
  until a transfer completes. Transfers complete at pass ends (an idle worker wakes at the
  next one), stores before loads at one time; any completion wakes those set aside, which are
  retried ahead of the waiting queue: a restored request is admitted with its reuse frozen at
  the restored prefix (capped so its last token is computed), no restore overlapping its
  prefill. Its host-reused tokens are that reuse less its GPU hit when it looked. A worker
  whose waiting head cannot be admitted while restores hold blocks idles until a transfer
  ends or a request arrives.
- **Not modelled with a host tier**: the admission policy's extra headroom for restores and
  running chunked prefills (only the plain block check: a workload whose admissions wait on
  blocks parts from the mocker's), preemption, a request's own pending store deferring it
  (only after preemption), shared (cluster) host pools and G3, and the host tier on
  disaggregated workers (handoffs skip it). Restored blocks are reported as stored KV events
  with the next pass; the host's own events are not.
- **Disaggregated** (the mocker's prefill-first handoff): a prefill worker serves a copy of the
  request capped at one output token (hidden from the report); once its KV has moved, the
  decode worker admits the request with its whole prompt computed (its blocks installed, no
  prefill compute) and decodes it from the pass that admits it: its first token ends that
  pass.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

from benchmarks.sim.host_tier import HIT, LOAD, MISS, PENDING, STORE, HostTier
from benchmarks.sim.request import GeneratedBlock, HostLoad, PassResult, SimRequest, Stored
from benchmarks.sim.spec import (
    DECODE_MS,
    PREFILL_MS,
    EngineSpec,
    decode_ms,
    prefill_ms,
    recompute_ms_per_block,
    restore_ms_per_block,
)

__all__ = [
    "DECODE_MS",
    "HIT",
    "LOAD",
    "MISS",
    "PENDING",
    "PREFILL_MS",
    "STORE",
    "EngineSpec",
    "GeneratedBlock",
    "HostLoad",
    "HostTier",
    "PassResult",
    "SimEngine",
    "SimRequest",
    "Stored",
    "decode_ms",
    "prefill_ms",
    "recompute_ms_per_block",
    "restore_ms_per_block",
]


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
        self.host = (
            HostTier(spec.num_host_blocks, spec.block_size * spec.kv_bytes_per_token, spec.d2h_gb_s, spec.h2d_gb_s)
            if spec.num_host_blocks
            else None
        )
        self.connector: deque[SimRequest] = deque()
        """Requests the host tier set aside (vLLM's skipped waiting): loading, or deferred
        until a transfer completes, or ready (retried ahead of :attr:`waiting`)."""
        self.sleeping: set[int] = set()
        """Ids of those in :attr:`connector` that wait for a transfer to complete."""
        self.d2h_sources: dict[object, int] = {}
        """GPU blocks whose copy to the host has not completed: the store's transfer id."""
        self.compute_not_before_ms = 0.0
        self.activated: list[Stored] = []
        """Blocks restored from the host since the last pass (its stored KV events)."""
        self.store_origins: dict[object, Stored] = {}
        """Blocks whose copy to the host runs: the request and index that name them."""
        self.host_stored: list[Stored] = []
        """Blocks whose copy to the host completed since the last pass (reported with the next one)."""
        self.set_aside = 0
        """Requests set aside so far (a pass that sets one aside does something)."""
        self.stalled = False
        """The last pass did nothing: the head waits for blocks a restore holds (it waits
        for a transfer to end, or a new request)."""

    # ---- the cache ------------------------------------------------------------------
    def _active_blocks(self) -> int:
        return len(self.refs) + self.private_blocks

    def _cached_prefix(self, request: SimRequest, capped: bool = True) -> int:
        """Blocks of ``request``'s prompt cached from its start, capped so its last token is
        computed (``capped``; uncapped, as the host tier's lookup takes the GPU's hit)."""
        cap = (request.prompt_len - 1) // self.spec.block_size if capped else len(request.blocks)
        hits = 0
        for key in request.blocks[:cap]:
            if key in self.refs or key in self.free_cached:
                hits += 1
            else:
                break
        return hits

    def _take(self, blocks: int) -> None:
        """Room for ``blocks`` fresh blocks: evict from the LRU head only what is short."""
        self._fence(self._evict(blocks))

    def _evict(self, blocks: int) -> float:
        """Evict what :meth:`_take` needs; returns when the last of their copies to the host
        ends (0 if none is pending): the blocks cannot be written before."""
        short = self._active_blocks() + len(self.free_cached) + blocks - self.spec.num_gpu_blocks
        source_ready = 0.0
        while short > 0 and self.free_cached:
            key = self.free_cached.popitem(last=False)[0]
            short -= 1
            if isinstance(key, GeneratedBlock):
                continue
            self.evicted.append(key)
            if self.d2h_sources and key in self.d2h_sources:
                assert self.host is not None
                deadline = self.host.deadline(self.d2h_sources.pop(key))
                if deadline is not None:
                    source_ready = max(source_ready, deadline)
        return source_ready

    def _fence(self, source_ready: float) -> None:
        if source_ready > self.compute_not_before_ms:
            self.compute_not_before_ms = source_ready

    def _pin(self, key: object) -> None:
        if key in self.free_cached:
            del self.free_cached[key]
        self.refs[key] = self.refs.get(key, 0) + 1

    def _release(self, request: SimRequest) -> None:
        # Its full blocks past the prompt (generated tokens, the last one's KV never computed)
        # stay cached too, as the mocker keeps them: no later prompt names them.
        full = (
            (request.prompt_len + request.generated - 1) // self.spec.block_size
            if self.spec.cache_generated_blocks
            else 0
        )
        for index in reversed(range(max(len(request.held), len(request.blocks)), full)):
            self.free_cached[GeneratedBlock(request.rid, index)] = None
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
        return not self.stalled and bool(self.running or self.waiting or len(self.connector) > len(self.sleeping))

    def submit(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self.stalled = False

    # ---- the host tier ---------------------------------------------------------------
    def next_host_deadline_ms(self) -> float | None:
        """When a request set aside by the host tier may wake (the next transfer's end)."""
        if self.host is None or not (self.sleeping or self.stalled):
            return None
        return self.host.next_deadline()

    def advance_host(self, now_ms: float) -> None:
        """Complete the host transfers due by ``now_ms``: a completed store frees its GPU
        sources, a completed load activates its request; any completion wakes the requests
        set aside."""
        if self.host is None:
            return
        done = self.host.due(now_ms)
        for kind, transfer, blocks, request in done:
            if kind == STORE:
                for key in blocks:
                    if self.d2h_sources.get(key) == transfer:
                        del self.d2h_sources[key]
                    self.host_stored.append(self.store_origins.pop(key))
            else:
                assert request is not None
                self._activate(request)
        if done:
            self.sleeping.clear()
            self.stalled = False

    def _activate(self, request: SimRequest) -> None:
        """``request``'s restored blocks are cached on the GPU, held by it."""
        load = request.load
        assert load is not None
        for key in load.blocks:
            if key not in self.refs and key not in self.free_cached:
                self.activated.append((request, len(request.held)))
            self._pin(key)
            request.held.append(key)
            request.private_blocks -= 1
            self.private_blocks -= 1
        load.deadline_ms = None

    def _host_lookup(self, request: SimRequest, g1: int) -> list[object] | None:
        """The connector's lookup after the GPU's hit of ``g1`` blocks: every prompt block
        touched (last first), then the run of host blocks after the hit (``None``: deferred,
        one of them is still being stored or loaded)."""
        host = self.host
        assert host is not None
        for key in reversed(request.blocks):
            host.touch(key)
        hit: list[object] = []
        deferred = False
        for key in request.blocks[g1:]:
            state = host.lookup(key)
            if state == MISS:
                break
            hit.append(key)
            deferred = deferred or state == PENDING or key in host.loading
        return None if deferred else hit

    def _next_candidate(self) -> SimRequest | None:
        for request in self.connector:
            if request.rid not in self.sleeping:
                return request
        return self.waiting[0] if self.waiting else None

    def _set_aside(self, request: SimRequest) -> None:
        """Skip ``request`` until a host transfer completes, keeping its place among those set aside."""
        if self.waiting and self.waiting[0] is request:
            self.waiting.popleft()
            self.connector.append(request)
        self.sleeping.add(request.rid)
        self.set_aside += 1

    def _offer(self, request: SimRequest) -> None:
        """Write-through: offer the host tier ``request``'s prompt blocks computed since its
        cursor, one cohort; the missing ones are stored (submitted when the pass ends)."""
        host = self.host
        assert host is not None
        end = min(min(request.computed, request.prompt_len) // self.spec.block_size, len(request.blocks))
        if end <= request.next_store_block:
            return
        keys = request.blocks[request.next_store_block : end]
        missing = {key for key in keys if host.lookup(key) == MISS}
        if not missing:
            request.next_store_block = end
            return
        transfer = host.prepare_store(keys)
        if transfer is None:  # no room: retried next pass, the cursor kept
            return
        for key in missing:
            self.d2h_sources[key] = transfer
        first = request.next_store_block
        self.store_origins.update((key, (request, first + i)) for i, key in enumerate(keys) if key in missing)
        request.next_store_block = end
        for key in reversed(request.blocks):
            host.touch(key)

    # ---- passes ---------------------------------------------------------------------
    def run_pass(self, now_ms: float) -> PassResult:
        """Schedule one pass starting at ``now_ms``; the caller calls :meth:`finish_pass` at its end."""
        spec = self.spec
        host = self.host
        budget = spec.max_num_batched_tokens
        stored: list[Stored] = self.activated
        self.activated = []
        chunks: list[tuple[int, int]] = []  # per prefilling request: tokens computed before the pass, its chunk
        decoding_context = 0
        decoding = False
        emitting: list[SimRequest] = []
        scheduled = 0  # the running requests scheduled, from the first
        set_aside = self.set_aside
        for request in self.running:
            if budget <= 0:
                break
            scheduled += 1
            if request.prefilling:
                budget -= self._prefill_chunk(request, budget, stored, chunks)
                if request.computed >= request.prompt_len:  # its prefill ends in this pass
                    emitting.append(request)
            else:
                budget -= 1
                decoding = True
                decoding_context += request.seq_len
                emitting.append(request)
        admitted_from = len(self.running)
        while len(self.running) < spec.max_num_seqs and budget > 0:
            candidate = self._next_candidate() if host is not None else self.waiting[0] if self.waiting else None
            if candidate is None:
                break
            head = candidate
            hit: list[object] = []
            g1 = 0
            if host is not None and not head.transferred:
                if head.load is None:
                    g1 = self._cached_prefix(head, capped=False)
                    found = self._host_lookup(head, g1)
                    if found is None:
                        self._set_aside(head)
                        continue
                    hit = found
                elif head.load.deadline_ms is not None:  # woken while its restore runs
                    self._set_aside(head)
                    continue
            cap = (head.prompt_len - 1) // spec.block_size
            if head.load is not None:  # restored: its cost frozen at the restored prefix
                cached = min(head.load.g1_blocks + len(head.load.blocks), cap)
            else:
                cached = self._cached_prefix(head)
            needed = self._blocks_for(head.prompt_len) - cached
            if needed > spec.num_gpu_blocks - self._active_blocks():
                self.blocked_admissions += 1
                break
            if hit:  # restore ``hit`` into blocks reserved now, then admit it
                assert host is not None
                prefix = head.blocks[:g1]
                pinned = sum(1 for key in prefix if key not in self.refs)
                if len(hit) + pinned > spec.num_gpu_blocks - self._active_blocks():
                    self.blocked_admissions += 1
                    break
                for key in prefix:
                    self._pin(key)
                    head.held.append(key)
                source_ready = self._evict(len(hit))
                head.private_blocks += len(hit)
                self.private_blocks += len(hit)
                transfer = host.schedule_load(head, hit, now_ms, source_ready)
                head.load = HostLoad(g1, hit, host.deadline(transfer), transfer)
                self._set_aside(head)
                continue
            if self.waiting and self.waiting[0] is head:
                self.waiting.popleft()
            else:  # a restored request, retried ahead of the waiting queue
                del self.connector[next(i for i, r in enumerate(self.connector) if r is head)]
                self.sleeping.discard(head.rid)
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
            if head.load is not None:
                head.host_reused_tokens = head.reused_tokens - min(
                    head.load.g1_blocks * spec.block_size, head.reused_tokens
                )
                head.next_store_block = cached
                head.load = None
            budget -= self._prefill_chunk(head, budget, stored, chunks)
            if not head.prefilling:
                emitting.append(head)
        if host is not None:
            for request in self.running[:scheduled] + self.running[admitted_from:]:
                if not request.transferred:
                    self._offer(request)
        n = len(chunks)
        isl, prefix_tokens = sum(before + chunk for before, chunk in chunks), sum(before for before, _ in chunks)
        tokens = n * (isl // n - prefix_tokens // n) if n else 0
        utilization = decoding_context / (spec.num_gpu_blocks * spec.block_size)
        duration = prefill_ms(tokens) + (decode_ms(utilization) if decoding else 0.0)
        evicted, self.evicted = self.evicted, []
        if host is not None and not (emitting or chunks or self.set_aside != set_aside):
            self.stalled = True
        start_ms = max(now_ms, self.compute_not_before_ms)  # after the copies of the blocks it overwrites
        return PassResult(start_ms + duration / spec.speedup_ratio, stored, evicted, emitting)

    def finish_pass(self, result: PassResult) -> list[SimRequest]:
        """The pass of ``result`` ended: the host transfers due complete and the pass's stores
        are submitted; each emitting request gets a token; returns the finished."""
        if self.host is not None:
            self.advance_host(result.end_ms)
            self.host.submit_prepared(result.end_ms)
            self.advance_host(result.end_ms)  # a store over an instantaneous link completes at once
            result.host_stored, self.host_stored = self.host_stored, []
            result.host_evicted, self.host.evicted = self.host.evicted, []
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
