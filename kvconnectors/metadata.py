"""What crosses between ``KVPilotConnector``'s scheduler side and its worker side each
step, wrapping the inner connector's own metadata (as vLLM's ``MultiConnector`` does).

* Scheduler -> worker, :class:`KVPilotMetadata`: the inner connector's metadata, the
  blocks whose KV the worker digests after this step's forward pass (requests whose
  blocks will be offered to a peer), and the reads that began this step with what
  landing them must satisfy (:class:`ReadCheck`: digests and a deadline).
* Worker -> scheduler, :class:`DigestReport` (vLLM's ``kv_connector_worker_meta``): the
  digests computed, per request and KV-cache group, keyed by block id.

vLLM pickles both between its processes; they hold only ints, bytes, strings and tuples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

GroupBlocks = tuple[tuple[int, ...], ...]
"""Block ids, one tuple per KV-cache group."""


@dataclass(frozen=True, slots=True)
class ReadCheck:
    """A read of a peer's KV into ``local_block_ids`` (per group, the blocks the inner
    connector fills). ``expected``: per group, the holder's packed digests of exactly those
    blocks, in order, computed with ``algo``; ``None`` when the offer carried none (attached
    on the token check alone). ``deadline_s``: how long after the worker first sees this
    check the read may take before it is abandoned."""

    local_block_ids: GroupBlocks
    expected: tuple[bytes, ...] | None
    algo: str
    deadline_s: float
    nbytes: int = 0


@dataclass
class KVPilotMetadata(KVConnectorMetadata):
    """One step's scheduler -> worker metadata: ``inner`` is the inner connector's."""

    inner: KVConnectorMetadata | None
    digest_jobs: dict[str, GroupBlocks] = field(default_factory=dict)
    """Request id -> the block ids (per group) to digest after this step's forward pass."""
    reads: dict[str, ReadCheck] = field(default_factory=dict)
    """Request id -> the read that begins this step."""


@dataclass
class DigestReport(KVConnectorWorkerMetadata):
    """The worker's digests of one step: request id -> per group, ``(block ids, packed
    digests)`` in that order; ``algo`` names the digest; ``inner`` the inner connector's
    own worker metadata, passed through."""

    algo: str = ""
    digests: dict[str, tuple[tuple[tuple[int, ...], bytes], ...]] = field(default_factory=dict)
    inner: KVConnectorWorkerMetadata | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another worker's report (vLLM aggregates the workers' reports of a step).
        Engines with more than one worker compute no digests, so only ``inner`` merges in
        practice; a digest reported twice keeps the first."""
        if not isinstance(other, DigestReport):
            raise TypeError(f"cannot aggregate DigestReport with {type(other).__name__}")
        for request_id, groups in other.digests.items():
            self.digests.setdefault(request_id, groups)
        self.algo = self.algo or other.algo
        if other.inner is not None:
            self.inner = other.inner if self.inner is None else self.inner.aggregate(other.inner)
        return self
