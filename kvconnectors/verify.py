"""Decide which of P's offered blocks D may attach: pure, no I/O, no vLLM.

D holds its own block hashes (vLLM's ``request.block_hashes``, computed over
D's token ids) and the number of leading blocks it already has in its local
prefix cache. P's offer carries P's contract and a digest per block (see
:mod:`kvpilot.kvconnectors.transfer_params`). The rule:

1. If the contracts differ in any field (model, block size, hash algorithm,
   seed, salt, KV dtype or layout), attach nothing.
2. Otherwise the *verified run* is the longest run of blocks from block 0 whose
   offered digest equals D's own digest (same truncation). Because hashes are
   chained, block ``i`` verifies only if blocks ``0..i`` hold the same tokens
   and extra keys on both sides.
3. D attaches exactly the verified blocks beyond its local hit,
   ``[num_local_hit_blocks, num_verified_blocks)``, and recomputes everything
   after them. A block outside the verified run is never attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.kvconnectors.reasons import Reason
from kvpilot.kvconnectors.transfer_params import (
    DIGEST_BYTES,
    BlockOffer,
    ContractId,
    FieldDiff,
    pack_digests,
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of :func:`verify_offer`; block indices are positions in the
    prompt, the same on both sides. "P" is the offering peer and "D" the engine
    about to attach (in a bidirectional session pull D offers and P attaches).

    - ``reason``: ``VERIFIED_ALL``, ``TOKEN_MISMATCH`` or ``CONTRACT_MISMATCH``
      (:class:`~kvpilot.kvconnectors.reasons.Reason`, re-exported here).
    - ``num_verified_blocks``: length of the verified run (0 on a contract
      mismatch); never more than ``min(num_offered_blocks, num_own_blocks)``.
    - ``attach_blocks``: blocks to load from P; empty unless the verified run
      goes beyond the local hit.
    - ``first_mismatch_block``: the first block both sides have whose digests
      differ; ``None`` if there is none or the contracts differ.
    - ``rejected_blocks``: blocks P offered and D would have loaded (beyond its
      local hit, within its own blocks) but may not; their tokens are
      recomputed because of the rejection. Empty for ``VERIFIED_ALL``.
    - ``contract_diffs``: each differing contract field, ``this`` = P's value,
      ``other`` = D's.
    """

    reason: Reason
    num_offered_blocks: int
    num_own_blocks: int
    num_local_hit_blocks: int
    num_verified_blocks: int
    attach_blocks: range
    first_mismatch_block: int | None
    rejected_blocks: range
    contract_diffs: tuple[FieldDiff, ...]

    def explain(self) -> str:
        """One log line stating the decision and the numbers behind it."""
        sizes = (
            f"peer offered {self.num_offered_blocks} blocks, this engine has {self.num_own_blocks}, "
            f"local hit {self.num_local_hit_blocks}"
        )
        if self.reason is Reason.CONTRACT_MISMATCH:
            diffs = "; ".join(f"{d.field} peer={d.this!r} here={d.other!r}" for d in self.contract_diffs)
            return f"contract mismatch ({diffs}): attach nothing, recompute {_span(self.rejected_blocks)} ({sizes})"
        attach = _span(self.attach_blocks)
        if self.reason is Reason.VERIFIED_ALL:
            return f"verified {self.num_verified_blocks} blocks: attach {attach} ({sizes})"
        return (
            f"token mismatch at block {self.first_mismatch_block}: verified "
            f"{self.num_verified_blocks} blocks, attach {attach}, "
            f"recompute {_span(self.rejected_blocks)} ({sizes})"
        )


def _span(blocks: range) -> str:
    return f"blocks [{blocks.start}, {blocks.stop})" if blocks else "no blocks"


def verify_offer(
    offer: BlockOffer,
    own_contract: ContractId,
    own_hashes: Sequence[bytes],
    num_local_hit_blocks: int,
) -> Verdict:
    """Compare P's offer with D's own chain and return what D may attach.

    ``own_hashes`` are D's block hashes from block 0, at
    ``own_contract.block_size`` granularity; ``num_local_hit_blocks`` is how
    many leading blocks D already has locally. Pure: mutates nothing. Empty
    offers or empty ``own_hashes`` verify nothing and attach nothing. Raises
    ``ValueError`` if ``num_local_hit_blocks`` is negative or more than
    ``len(own_hashes)`` (a local hit is always within D's own hashed blocks),
    or if one of the compared ``own_hashes`` is shorter than a digest.
    """
    num_own = len(own_hashes)
    if not 0 <= num_local_hit_blocks <= num_own:
        raise ValueError(f"num_local_hit_blocks={num_local_hit_blocks} is outside [0, {num_own}]")
    comparable = min(offer.num_blocks, num_own)
    diffs = offer.contract.diff(own_contract)
    first_mismatch: int | None = None
    if diffs:
        reason, verified = Reason.CONTRACT_MISMATCH, 0
    else:
        own_packed = pack_digests(own_hashes[:comparable])
        if len(own_packed) != comparable * DIGEST_BYTES:
            raise ValueError(f"own_hashes must be at least {DIGEST_BYTES} bytes each")
        verified = _matching_run(offer.packed_digests, own_packed, comparable)
        if verified < comparable:
            reason, first_mismatch = Reason.TOKEN_MISMATCH, verified
        else:
            reason = Reason.VERIFIED_ALL
    attach_end = max(num_local_hit_blocks, verified)
    return Verdict(
        reason=reason,
        num_offered_blocks=offer.num_blocks,
        num_own_blocks=num_own,
        num_local_hit_blocks=num_local_hit_blocks,
        num_verified_blocks=verified,
        attach_blocks=range(num_local_hit_blocks, attach_end),
        first_mismatch_block=first_mismatch,
        rejected_blocks=range(attach_end, max(attach_end, comparable)),
        contract_diffs=diffs,
    )


def _matching_run(offered: bytes, own: bytes, num_blocks: int) -> int:
    """The largest ``k <= num_blocks`` whose first ``k`` digests are equal.

    "The first ``k`` digests are equal" is a prefix property, so it holds for
    every ``k`` up to the answer and for none beyond: a binary search that
    compares packed prefixes (one ``memcmp`` each) finds it exactly, without
    relying on the hash chain.
    """
    if offered[: num_blocks * DIGEST_BYTES] == own[: num_blocks * DIGEST_BYTES]:
        return num_blocks
    matching, differing = 0, num_blocks  # invariant: prefix(matching) equal, prefix(differing) not
    while differing - matching > 1:
        middle = (matching + differing) // 2
        if offered[: middle * DIGEST_BYTES] == own[: middle * DIGEST_BYTES]:
            matching = middle
        else:
            differing = middle
    return matching
