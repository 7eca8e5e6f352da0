"""kvpilot's scheduler-side bookkeeping for the KV digest and the read deadline; its
worker side is :mod:`kvpilot.kvconnectors.worker`.

* **Holder**: a request whose blocks will be offered to a peer (a P->D prefill,
  ``do_remote_decode``; with ``bidirectional_kv_xfer``, a decode that will offer its
  session) is tracked from its first step. Each step the worker digests the blocks the
  step wrote (and, on the first step, the prefix the request found cached), so each block
  is digested once, after its last write. ``request_finished`` puts the digests of the
  offered blocks into the offer; those of the last step arrive in the same
  ``update_from_output`` pass, after ``request_finished`` and before vLLM emits the
  request's output (vLLM itself adds ``remote_prefill_cached_tokens`` to the params at that
  point), and complete the offer then.
* **Reader**: a read that begins (``update_state_after_alloc`` with external tokens) is
  queued for the worker with the holder's digests of the blocks it fills, aligned as the
  inner connector pairs them (the end of the peer's list), and its deadline
  (:class:`~kvpilot.kvconnectors.read_deadline.DeadlineRule` on its bytes and the measured
  link rate).

Engines with more than one worker track nothing: their offers carry no digests.
Not thread-safe: vLLM's scheduler calls it from one thread.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvpilot.kvconnectors.metadata import DigestReport, GroupBlocks, ReadCheck
from kvpilot.kvconnectors.read_deadline import DeadlineRule
from kvpilot.kvconnectors.transfer_params import BlockOffer, TransferParamsError, set_kv_digests

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvpilot.connector")


def offers_at_finish(params: dict[str, Any] | None, bidirectional: bool) -> bool:
    """Whether a request with these kv_transfer_params hands its blocks to a peer when it
    finishes: a prefill for a remote decoder, or (bidirectional) a decode whose session a
    later prefill may pull."""
    if not params:
        return False
    return bool(params.get("do_remote_decode") or (bidirectional and params.get("do_remote_prefill")))


class IntegrityLedger:
    """The holder's digests per request and block, the offers waiting for them, and the
    reads queued for the worker. ``enabled`` false: tracks nothing, queues reads with no
    digests (the deadline still holds)."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, enabled: bool, deadline: DeadlineRule, bidirectional: bool
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        self._block_sizes = tuple(g.kv_cache_spec.block_size for g in groups)
        self._block_bytes = tuple(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
        self._enabled = enabled
        self._deadline = deadline
        self._bidirectional = bidirectional
        self._manager: KVCacheManager | None = None
        self._done: dict[str, list[int]] = {}  # request id -> per group, blocks digested after their last write
        self._digests: dict[str, list[dict[int, bytes]]] = {}  # request id -> per group, block id -> digest
        self._pending: dict[str, tuple[dict[str, Any], tuple[tuple[int, ...], ...]]] = {}
        self._awaiting: set[str] = set()  # requests whose step's digests the worker has not reported yet
        self._algo = ""
        self._reads: dict[str, ReadCheck] = {}

    def bind(self, manager: KVCacheManager) -> None:
        """The scheduler's KV cache manager, where a tracked request's block ids are read."""
        self._manager = manager

    # ------------------------------------------------------------------ holder
    def track(self, request: Request) -> None:
        """Track ``request`` if it will offer its blocks (:func:`offers_at_finish`)."""
        if self._enabled and offers_at_finish(request.kv_transfer_params, self._bidirectional):
            self._done[request.request_id] = [0] * len(self._block_sizes)
            self._digests[request.request_id] = [{} for _ in self._block_sizes]

    def digest_jobs(self, scheduler_output: SchedulerOutput) -> dict[str, GroupBlocks]:
        """For each tracked request this step runs, the blocks (per group) to digest after
        its forward pass: from the first not yet digested after its last write to the last
        the step writes. A request scheduled anew (first step, or resumed after a
        preemption) starts from block 0."""
        if not self._done or self._manager is None:
            return {}
        scheduled = scheduler_output.num_scheduled_tokens
        steps: list[tuple[str, int, bool]] = [
            (new.req_id, new.num_computed_tokens, True) for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        resumed: Collection[str] = getattr(cached, "resumed_req_ids", frozenset())
        steps += [(r, c, r in resumed) for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True)]
        jobs: dict[str, GroupBlocks] = {}
        for request_id, computed, anew in steps:
            done = self._done.get(request_id)
            if done is None:
                continue
            if anew:
                done[:] = [0] * len(done)
            after = computed + scheduled.get(request_id, 0)
            block_ids = self._manager.get_block_ids(request_id)
            groups = []
            for g, size in enumerate(self._block_sizes):
                end = min(-(-after // size), len(block_ids[g]))
                groups.append(tuple(block_ids[g][done[g] : end]))
                done[g] = min(after // size, end)
            if any(groups):
                jobs[request_id] = tuple(groups)
        self._awaiting.update(jobs)
        return jobs

    def merge(self, report: object) -> None:
        """The worker's digests of a step (a :class:`DigestReport`; anything else is
        ignored); then completes the offers waiting for them."""
        self._awaiting.clear()
        if isinstance(report, DigestReport):
            self._algo = report.algo or self._algo
            for request_id, groups in report.digests.items():
                per_group = self._digests.get(request_id)
                if per_group is None:
                    continue
                for g, (ids, packed) in enumerate(groups):
                    per_group[g].update((b, packed[8 * i : 8 * i + 8]) for i, b in enumerate(ids))
        for request_id in list(self._pending):
            offer, remote = self._pending.pop(request_id)
            if not self._complete(request_id, offer, remote):
                logger.warning("kvpilot %s: the offer goes without KV digests (the worker reported none)", request_id)
            self._drop(request_id)

    def offer(self, request_id: str, params: dict[str, Any] | None, offer_key: str) -> None:
        """``request_id`` finished with ``params``: if they carry kvpilot's offer
        (``params[offer_key]``), put its KV digests in, now or when the last step's report
        comes (:meth:`merge`). Stops tracking the request either way."""
        offer = params.get(offer_key) if params else None
        if request_id not in self._digests or not isinstance(offer, dict):
            self._drop(request_id)
            return
        assert params is not None
        remote = tuple(tuple(group) for group in _per_group(params.get("remote_block_ids")))
        # a block the last step wrote may hold an older digest (a partial block digested
        # before): wait for the step's report
        if request_id in self._awaiting or not self._complete(request_id, offer, remote):
            self._pending[request_id] = (offer, remote)
            return
        self._drop(request_id)

    def _complete(self, request_id: str, offer: dict[str, Any], remote: Sequence[Sequence[int]]) -> bool:
        per_group = self._digests.get(request_id)
        if per_group is None or not self._algo or len(remote) != len(per_group):
            return False
        try:
            packed = [b"".join(digests[b] for b in ids) for digests, ids in zip(per_group, remote, strict=True)]
        except KeyError:
            return False
        try:
            set_kv_digests(offer, self._algo, packed)
        except TransferParamsError as exc:  # a worker report of another shape: a bug, not the peer's
            logger.error("kvpilot %s: %s", request_id, exc)
            return False
        return True

    def _drop(self, request_id: str) -> None:
        self._done.pop(request_id, None)
        if request_id not in self._pending:
            self._digests.pop(request_id, None)

    # ------------------------------------------------------------------ reader
    def read_started(
        self,
        request_id: str,
        local_block_ids: Sequence[Sequence[int]],
        remote_block_ids: object,
        offer: BlockOffer | None,
        rate_bytes_per_s: float | None,
    ) -> None:
        """A read of a peer's KV into ``local_block_ids`` (per group) begins: queue its
        check. The holder's digests, per group, are those of the end of
        ``remote_block_ids`` (as cut by the attach plan) that the inner connector pairs
        with the local blocks; none when the offer has none, the group counts differ, or
        the local blocks outnumber the remote ones."""
        local = tuple(tuple(group) for group in local_block_ids)
        remote = _per_group(remote_block_ids)
        expected: tuple[bytes, ...] | None = None
        if self._enabled and offer is not None and offer.kv_digests and len(offer.kv_digests) == len(local):
            groups = []
            for packed, theirs, ours in zip(offer.kv_digests, remote, local, strict=False):
                if len(ours) > len(theirs) or len(packed) < 8 * len(theirs):
                    break
                start = len(theirs) - len(ours)
                groups.append(packed[8 * start : 8 * len(theirs)])
            if len(groups) == len(local):
                expected = tuple(groups)
        nbytes = sum(len(ids) * size for ids, size in zip(local, self._block_bytes, strict=False))
        algo = offer.kv_digest_algo if offer is not None else ""
        bound = self._deadline.bound_s(nbytes, rate_bytes_per_s)
        self._reads[request_id] = ReadCheck(local, expected, algo, bound, nbytes)

    def take_reads(self) -> dict[str, ReadCheck]:
        """The reads queued since the last call (for this step's metadata)."""
        reads, self._reads = self._reads, {}
        return reads


def _per_group(block_ids: object) -> list[list[int]]:
    """``remote_block_ids`` as a list per group (vLLM 0.32 sends one list per group; a flat
    list is one group)."""
    if not isinstance(block_ids, list | tuple) or not block_ids:
        return []
    if all(isinstance(b, int) for b in block_ids):
        return [list(block_ids)]
    return [list(group) for group in block_ids if isinstance(group, list | tuple)]
