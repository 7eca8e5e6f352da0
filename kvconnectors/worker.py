"""kvpilot's worker-side layer: the KV bytes checked after every read, a deadline on
every read, and the data-plane fault injector.

The inner connector moves the bytes; this layer sits between its report and vLLM:

* **Holder**: after each forward pass, digest the blocks the scheduler listed
  (:class:`~kvpilot.kvconnectors.metadata.KVPilotMetadata` ``digest_jobs``: blocks of
  requests that will be offered to a peer) and report them up
  (:class:`~kvpilot.kvconnectors.metadata.DigestReport`); the scheduler puts them in the offer.
* **Reader**: when the inner connector reports a read landed, digest what landed and
  compare it with the holder's digests (:class:`~kvpilot.kvconnectors.metadata.ReadCheck`).
  A block that differs, and every block after it in the read, is reported through
  ``get_block_ids_with_load_errors`` (one KV-cache group: vLLM recomputes from the first
  bad block) or the request through ``failed_recving`` (several groups, whose block ids
  vLLM cannot map back), in the same pass that reports the read finished, so vLLM never
  schedules the request on those bytes.
* **Deadline**: a read not reported by its deadline is abandoned: the inner connector's
  transfer is stopped (:func:`kvpilot.kvconnectors.inner_abort.abort_read`), the read is
  reported finished with all its blocks failed, and any later report of it is dropped.
  No request waits on a read longer than its deadline plus one engine step. A read that
  cannot be stopped (an inner connector other than NIXL) is left to finish, and counted.

vLLM calls one worker from one thread; this class is not thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvpilot.kvconnectors.faults import FaultInjector, FaultKind
from kvpilot.kvconnectors.inner_abort import abort_read, drop_queued_reads, posted_read
from kvpilot.kvconnectors.kv_digest import DigestAlgo, DigestLayoutError, GroupKV, algo_for, digest_blocks, mismatched
from kvpilot.kvconnectors.metadata import DigestReport, KVPilotMetadata, ReadCheck
from kvpilot.kvconnectors.stats import KVPilotStats

logger = logging.getLogger("kvpilot.connector")


@dataclass(slots=True)
class _Read:
    check: ReadCheck
    started_s: float
    fault: FaultKind | None
    held_until_s: float | None = None
    """Set when a fault holds the inner connector's completion: released then (inf: never)."""
    unabortable_counted: bool = False


_FORGET_ABANDONED_S = 600.0
"""How long an abandoned read's id is kept to drop a late report of it."""


class KVPilotWorker:
    """Worker-side state of one ``KVPilotConnector``. ``inner`` is the inner connector
    (for :func:`~kvpilot.kvconnectors.inner_abort.abort_read`); ``group_layers`` the layer
    names of each KV-cache group; ``digests`` whether this engine digests at all (one
    worker per engine); ``clock`` monotonic seconds."""

    def __init__(
        self,
        inner: object,
        group_layers: tuple[tuple[str, ...], ...],
        num_blocks: int,
        digests: bool,
        injector: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inner = inner
        self._group_layers = group_layers
        self._num_blocks = num_blocks
        self._digests_on = digests
        self._injector = injector
        self._clock = clock
        self._groups: tuple[GroupKV, ...] = ()
        self._algo: DigestAlgo = "xxh3_64"
        self._reads: dict[str, _Read] = {}
        self._abandoned: dict[str, float] = {}  # request id -> when abandoned
        self._load_errors: set[int] = set()
        self._jobs: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._report: dict[str, tuple[tuple[tuple[int, ...], bytes], ...]] = {}
        self._stats = KVPilotStats()

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Find each group's layers in ``kv_caches``, for the digest and the fault injector's
        damage (with digests off, an injector still damages what it names: the positive
        control). A layout the digest cannot read turns digests off on this engine (logged):
        its offers carry none, its reads are unchecked."""
        if not self._digests_on and self._injector is None:
            return
        try:
            self._groups = tuple(GroupKV.of(kv_caches, names, self._num_blocks) for names in self._group_layers)
        except (DigestLayoutError, KeyError) as exc:
            if self._digests_on:
                logger.warning("kvpilot: KV digests off on this engine: %s", exc)
            self._digests_on = False
            return
        if self._groups:
            self._algo = algo_for(self._groups[0])

    # ------------------------------------------------------------------ per step
    def bind(self, meta: KVPilotMetadata) -> None:
        """A step's metadata: remember its digest jobs and start the clock of its reads."""
        self._jobs = dict(meta.digest_jobs) if self._digests_on else {}
        now = self._clock()
        for request_id, check in meta.reads.items():
            fault = self._injector.pick(request_id) if self._injector is not None else None
            self._reads[request_id] = _Read(check, now, fault)
        drop_queued_reads(self._inner, self._abandoned.keys())

    def after_start_load(self) -> None:
        """After the inner connector posted this step's reads: stop any read of an abandoned
        request that a handshake finishing late queued and the inner connector just posted."""
        for request_id in self._abandoned:
            if posted_read(self._inner, request_id):
                abort_read(self._inner, request_id)

    def after_forward(self) -> None:
        """Digest this step's jobs (the forward pass has written their KV): one
        :func:`~kvpilot.kvconnectors.kv_digest.digest_blocks` call per group for all the
        step's requests, so a step of many decodes costs one pass, not one per request."""
        if not self._jobs:
            return
        started = time.perf_counter()
        packed = [
            digest_blocks(group, [b for groups in self._jobs.values() for b in groups[g]], self._algo)
            for g, group in enumerate(self._groups)
        ]
        offsets = [0] * len(self._groups)
        for request_id, groups in self._jobs.items():
            parts = []
            for g, ids in enumerate(groups):
                start, offsets[g] = offsets[g], offsets[g] + len(ids)
                parts.append((ids, packed[g][8 * start : 8 * offsets[g]]))
            self._report[request_id] = tuple(parts)
        self._stats.count("digest_seconds", time.perf_counter() - started)
        self._jobs = {}

    def take_report(self) -> DigestReport | None:
        """The digests computed since the last call (this step's jobs first, if
        ``wait_for_save`` was deferred), or ``None`` for none."""
        self.after_forward()
        if not self._report:
            return None
        report, self._report = DigestReport(algo=self._algo, digests=self._report), {}
        return report

    # ------------------------------------------------------------------ reads
    def transfer_results(self, finished: set[str], failed: set[str]) -> tuple[set[str], set[str]]:
        """Filter the inner connector's report of a pass (``finished``, ``failed`` receives;
        not mutated): drop reads abandoned earlier, apply faults, check digests, abandon
        reads past their deadline. Returns the ``(finished, failed)`` to give vLLM; bad
        blocks go to :meth:`take_load_errors`."""
        now = self._clock()
        self._abandoned = {r: t for r, t in self._abandoned.items() if now - t < _FORGET_ABANDONED_S}
        finished = set(finished) - self._abandoned.keys()
        failed = set(failed) - self._abandoned.keys()
        for request_id, held in self._reads.items():
            if held.held_until_s is not None and now >= held.held_until_s:
                finished.add(request_id)  # a stalled completion released: checked below
                held.held_until_s, held.fault = None, None
        for request_id in sorted(finished):
            found = self._reads.get(request_id)
            if found is None:
                continue
            read = found
            if request_id in failed:  # the inner connector failed it and reported its blocks
                del self._reads[request_id]
                continue
            if read.fault in (FaultKind.STALL_READ, FaultKind.DROP_COMPLETION) and read.held_until_s is None:
                stall = self._injector.spec.stall_s if self._injector is not None else 0.0
                read.held_until_s = now + stall if read.fault is FaultKind.STALL_READ else float("inf")
                self._stats.count("faults_injected", reason=read.fault.value)
            if read.held_until_s is not None and now < read.held_until_s:
                finished.discard(request_id)  # held: reported when released, or abandoned
                continue
            del self._reads[request_id]
            if read.fault in (FaultKind.CORRUPT_BLOCK, FaultKind.REUSED_BLOCK):
                self._damage_first_block(read.check, read.fault)
            bad = self._check(request_id, read.check)
            if bad and len(read.check.local_block_ids) > 1:
                failed.add(request_id)
        for request_id, read in list(self._reads.items()):
            late = now - read.started_s > read.check.deadline_s and request_id not in finished
            if late and self._abandon(request_id, read):
                finished.add(request_id)
                if len(read.check.local_block_ids) > 1:
                    failed.add(request_id)
        return finished, failed

    def _check(self, request_id: str, check: ReadCheck) -> list[int]:
        """Compare what landed with the holder's digests; the bad blocks (from the first
        mismatch on, per group) are recorded as load errors and returned."""
        if check.expected is None or not self._digests_on:
            self._stats.count("unchecked_reads")
            return []
        if check.algo != self._algo:
            logger.warning(
                "kvpilot %s: the holder's digest is %s, this engine's %s: the read is recomputed",
                request_id,
                check.algo,
                self._algo,
            )
            bad = [b for ids in check.local_block_ids for b in ids]
        else:
            started = time.perf_counter()
            bad = []
            for g, (ids, expected) in enumerate(zip(check.local_block_ids, check.expected, strict=True)):
                landed = digest_blocks(self._groups[g], ids, self._algo)
                differing = mismatched(expected, landed)
                if differing:
                    self._stats.count("digest_mismatch_blocks", len(differing))
                    bad.extend(ids[differing[0] :])
            self._stats.count("digest_seconds", time.perf_counter() - started)
            self._stats.count("checked_blocks", sum(len(ids) for ids in check.local_block_ids))
        if bad:
            logger.warning(
                "kvpilot %s: %d block(s) read from the peer differ from the holder's KV digest; "
                "never attached: reported as failed loads",
                request_id,
                len(bad),
            )
            self._stats.count("integrity_failed_blocks", len(bad), reason="digest_mismatch")
            self._load_errors.update(bad)
        return bad

    def _abandon(self, request_id: str, read: _Read) -> bool:
        """Stop a read past its deadline; its blocks become load errors."""
        if read.held_until_s is None and not abort_read(self._inner, request_id):
            if not read.unabortable_counted:
                read.unabortable_counted = True
                self._stats.count("unabortable_reads")
            return False
        del self._reads[request_id]
        self._abandoned[request_id] = self._clock()
        blocks = [b for ids in read.check.local_block_ids for b in ids]
        self._load_errors.update(blocks)
        self._stats.count("abandoned_reads")
        self._stats.count("integrity_failed_blocks", len(blocks), reason="deadline")
        logger.warning(
            "kvpilot %s: the read of %d block(s) passed its %.1f s deadline: abandoned, its blocks "
            "reported as failed loads",
            request_id,
            len(blocks),
            read.check.deadline_s,
        )
        return True

    def _damage_first_block(self, check: ReadCheck, fault: FaultKind) -> None:
        """The first landed block's bytes as ``fault`` leaves them: ``corrupt_block`` flips the
        first byte of its first layer; ``reused_block`` gives it another block's bytes in every
        layer of its group (the read's last block, or for a one-block read the cache's next)."""
        for g, ids in enumerate(check.local_block_ids):
            if ids and self._groups:
                layers = self._groups[g].layers
                if fault is FaultKind.CORRUPT_BLOCK:
                    block = layers[0][ids[0]].view(-1).view(torch.uint8)
                    block[0] ^= 0xFF
                else:
                    donor = ids[-1] if len(ids) > 1 else (ids[0] + 1) % len(layers[0])
                    for layer in layers:
                        layer[ids[0]].copy_(layer[donor])
                self._stats.count("faults_injected", reason=fault.value)
                return

    def take_load_errors(self) -> set[int]:
        """Block ids this layer failed since the last call; clears them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def has_reads(self) -> bool:
        """Whether a read is still waiting (its deadline must still be watched)."""
        return bool(self._reads)

    def take_stats(self) -> KVPilotStats:
        """The counts since the last call; resets them."""
        stats, self._stats = self._stats, KVPilotStats()
        return stats
