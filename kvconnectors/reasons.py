"""Why a request did not load (all of) the KV a peer offered: the one closed set of
reasons, pure, no vLLM.

Each value is a ``reason`` label of ``vllm:kvpilot_rejected_blocks_total`` and
``vllm:kvpilot_recomputed_tokens_total``; dashboards and tests match them as
strings, so a value never changes once shipped. :func:`kvpilot.kvconnectors.verify.verify_offer`
decides the first three; the scheduler layer adds the others.
"""

from __future__ import annotations

import enum


class Reason(enum.Enum):
    """What decided how much of a peer's offer a request attaches."""

    VERIFIED_ALL = "verified_all"
    """Every block both sides have matched (vacuously so for an empty offer): nothing rejected."""
    TOKEN_MISMATCH = "token_mismatch"
    """Some block both sides have differs: the run stops before it."""
    CONTRACT_MISMATCH = "contract_mismatch"
    """The contracts differ: nothing is comparable, nothing is attached."""
    MALFORMED = "malformed_params"
    """The pull fields or the offer in kv_transfer_params do not parse: prefilled locally."""
    PARTIAL_TAIL = "partial_tail"
    """The offer verified up to its partial last block, which cannot be attached
    because this prompt goes on past it (a session's next turn): recomputed."""
    LEASE_EXPIRED = "lease_expired"
    """The peer's hold on its blocks ends (nearly) before the pull could read them."""
    PEER_FAILED = "peer_failed"
    """A pull from this peer failed moments ago (dead holder, broken link): its offer
    is prefilled locally without another try for a while."""
    PULL_POLICY = "pull_policy"
    """The pull policy chose to recompute a verified span rather than pull it."""
    LOAD_FAILED = "load_failed"
    """A pull failed in flight and vLLM's ``kv_load_failure_policy: recompute``
    prefilled the tokens it was to load."""


REJECT_REASONS: tuple[Reason, ...] = (
    Reason.TOKEN_MISMATCH,
    Reason.CONTRACT_MISMATCH,
    Reason.MALFORMED,
    Reason.PARTIAL_TAIL,
    Reason.LEASE_EXPIRED,
    Reason.PEER_FAILED,
)
"""Why offered blocks that were needed were not loaded (rejected blocks)."""

RECOMPUTE_REASONS: tuple[Reason, ...] = (*REJECT_REASONS, Reason.PULL_POLICY, Reason.LOAD_FAILED)
"""Why offered tokens were prefilled locally: a rejection, the pull policy, or a failed load."""
