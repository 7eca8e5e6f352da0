"""Which of a peer's offered blocks one request loads, and why. Pure.

The attaching side of :mod:`kvpilot.kvconnectors.scheduler`, as plain functions of plain
values: the request as :class:`PromptView`, the peer's kv_transfer_params, this
engine's contract and local prefix hit. The scheduler layer reads those from vLLM's
``Request`` and holds the live state that two inputs come from: whether to skip the
peer (its lease, its last failure) and the pull policy's decision on a session pull.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.kvconnectors.group_clip import GroupLayout, Refused, cut_to_prefix
from kvpilot.kvconnectors.pull_policy import PullDecision
from kvpilot.kvconnectors.reasons import Reason
from kvpilot.kvconnectors.transfer_params import (
    PARAMS_KEY,
    BlockOffer,
    ContractId,
    FieldDiff,
    TransferParamsError,
    decode_offer,
)
from kvpilot.kvconnectors.verify import verify_offer
from kvpilot.policies.recompute_vs_transfer import Span

DecidePull = Callable[[Span], PullDecision]
"""The pull policy on live load and link telemetry, for one verified span."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptView:
    """One request as the planner sees it."""

    num_prompt_tokens: int
    prompt_token_ids: Sequence[int] | None
    """``None`` for prompt embeddings: no tail to compare."""
    block_hashes: Sequence[bytes]
    """vLLM's hashes of this engine's full blocks, over its own token ids."""
    extra_keys: bool = False
    """LoRA or multimodal inputs enter the block hashes but not the tail's token ids."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachPlan:
    """What one request may load from its peer.

    ``attach_blocks is None`` means everything the peer offered verified, tail
    included: the inner connector's own plan stands. Otherwise the request loads
    the peer's first ``attach_blocks`` blocks (those beyond its local hit) and
    recomputes the rest.
    """

    attach_blocks: int | None
    reason: Reason
    rejected_blocks: int
    """Offered blocks this request needed but does not load."""
    recomputed_tokens: int
    """Offered tokens prefilled here because of ``reason``."""
    attached_blocks: int
    """Blocks loaded from the peer beyond the local hit."""
    explanation: str
    contract_diffs: tuple[FieldDiff, ...] = ()
    """On a contract mismatch: each contract field that differs from the peer's."""
    pull_decision: PullDecision | None = None
    """For a session pull: the policy's decision on the verified span."""
    block_ids: tuple[tuple[int, ...], ...] | None = None
    """For a partial plan: the peer's block list of each KV cache group, cut to what
    vLLM's pull pairs with this engine's blocks (:func:`~kvpilot.kvconnectors.group_clip.cut_to_prefix`);
    ``None`` where the peer sent none."""

    @property
    def policy_recomputed_tokens(self) -> int:
        """Verified tokens recomputed because the pull policy chose to."""
        d = self.pull_decision
        return d.span.tokens if d is not None and not d.pull else 0


def is_session_pull(params: Mapping[str, Any]) -> bool:
    """A pull of a peer's KV of earlier turns (optional), not a P->D handoff (always loaded)."""
    return not params.get("do_remote_prefill")


def plan_attach(
    prompt: PromptView,
    params: Mapping[str, Any],
    contract: ContractId,
    num_computed_tokens: int,
    *,
    screened_out: str | None = None,
    skip: tuple[Reason, str] | None = None,
    decide_pull: DecidePull,
    groups: Sequence[GroupLayout],
) -> AttachPlan:
    """Plan the request's load from the offer in ``params``.

    ``screened_out``: why its pull fields were dropped on arrival (malformed).
    ``skip``: why not to try this peer at all (lease ending, recent failure).
    ``decide_pull`` is asked only for a session pull with verified blocks to load.
    ``groups``: this engine's KV cache groups, in the order of the peer's block
    lists. A partial plan whose prefix some group cannot attach (a sliding window
    the peer no longer holds) recomputes beyond the local hit instead.
    """
    block_size = contract.block_size
    own_hashes = prompt.block_hashes[: prompt.num_prompt_tokens // block_size]
    local_hit = num_computed_tokens // block_size
    recompute_all = prompt.num_prompt_tokens - num_computed_tokens

    def nothing(reason: Reason, rejected: int, recomputed: int, explanation: str) -> AttachPlan:
        lists = params.get("remote_block_ids")
        return AttachPlan(
            attach_blocks=0,
            reason=reason,
            rejected_blocks=rejected,
            recomputed_tokens=recomputed,
            attached_blocks=0,
            explanation=explanation,
            block_ids=None if lists is None else tuple(() for _ in lists),
        )

    if screened_out is not None:
        return nothing(Reason.MALFORMED, len(own_hashes) - local_hit, recompute_all, screened_out)
    try:
        offer = decode_offer(params.get(PARAMS_KEY))
    except TransferParamsError as exc:
        return nothing(Reason.MALFORMED, len(own_hashes) - local_hit, recompute_all, f"{exc}: prefill locally")
    if skip is not None:
        reason, why = skip
        unloaded = min(offer.num_tokens, prompt.num_prompt_tokens) - num_computed_tokens
        rejected = max(0, min(offer.num_blocks, len(own_hashes)) - local_hit)
        return nothing(reason, rejected, max(0, unloaded), f"{why}: prefill locally")
    plan = _verified_plan(prompt, offer, contract, own_hashes, num_computed_tokens)
    if plan.attached_blocks and is_session_pull(params):
        plan = _with_pull_decision(prompt, plan, offer.num_tokens, num_computed_tokens, block_size, decide_pull)
    return _cut_per_group(plan, params, groups, offer.num_tokens, num_computed_tokens, block_size)


def _verified_plan(
    prompt: PromptView, offer: BlockOffer, contract: ContractId, own_hashes: Sequence[bytes], num_computed_tokens: int
) -> AttachPlan:
    block_size = contract.block_size
    local_hit = num_computed_tokens // block_size
    verdict = verify_offer(offer, contract, own_hashes, local_hit)
    if tail_verified(prompt, offer, verdict.reason, verdict.num_verified_blocks, len(own_hashes), block_size):
        return AttachPlan(
            attach_blocks=None,
            reason=Reason.VERIFIED_ALL,
            rejected_blocks=0,
            recomputed_tokens=0,
            attached_blocks=len(own_hashes) - local_hit,
            explanation=verdict.explain() + ", tail verified",
        )
    attach_end = verdict.attach_blocks.stop
    covered = min(offer.num_tokens, prompt.num_prompt_tokens)
    recomputed = max(0, covered - max(attach_end * block_size, num_computed_tokens))
    reason = verdict.reason
    if reason is Reason.VERIFIED_ALL:
        start = offer.num_blocks * block_size
        ids = prompt.prompt_token_ids
        prompt_tail = None if ids is None else tuple(ids[start : start + len(offer.tail_token_ids)])
        reason = Reason.PARTIAL_TAIL if prompt_tail == offer.tail_token_ids else Reason.TOKEN_MISMATCH
    explanation = verdict.explain() if recomputed == 0 else f"{verdict.explain()}; recompute {recomputed} tokens"
    return AttachPlan(
        attach_blocks=attach_end,
        reason=reason,
        rejected_blocks=len(verdict.rejected_blocks),
        recomputed_tokens=recomputed,
        attached_blocks=len(verdict.attach_blocks),
        explanation=explanation,
        contract_diffs=verdict.contract_diffs,
    )


def _with_pull_decision(
    prompt: PromptView,
    plan: AttachPlan,
    offer_tokens: int,
    num_computed_tokens: int,
    block_size: int,
    decide_pull: DecidePull,
) -> AttachPlan:
    """For a session pull: pull the verified span beyond the local hit, or recompute
    it, as the pull policy decides."""
    if plan.attach_blocks is None:  # everything verified: the inner connector would load up to the offer's end
        span_end = min(offer_tokens, prompt.num_prompt_tokens)
    else:
        span_end = plan.attach_blocks * block_size
    span_tokens = span_end - num_computed_tokens
    if span_tokens <= 0:
        return plan
    span = Span(tokens=span_tokens, context=num_computed_tokens, new_tokens=prompt.num_prompt_tokens - span_end)
    decision = decide_pull(span)
    if decision.pull:
        return dataclasses.replace(
            plan, pull_decision=decision, explanation=f"{plan.explanation}; pull: {decision.explanation}"
        )
    return dataclasses.replace(
        plan,
        attach_blocks=num_computed_tokens // block_size,
        attached_blocks=0,
        pull_decision=decision,
        explanation=f"{plan.explanation}; recompute the verified span: {decision.explanation}",
    )


def _cut_per_group(
    plan: AttachPlan,
    params: Mapping[str, Any],
    groups: Sequence[GroupLayout],
    peer_tokens: int,
    num_computed_tokens: int,
    block_size: int,
) -> AttachPlan:
    """``plan`` with the peer's block lists cut to its prefix, group by group; or, if
    some group cannot attach that prefix, the plan that loads nothing beyond the
    local hit, its verified blocks counted as rejected and recomputed."""
    lists = params.get("remote_block_ids")
    if plan.attach_blocks is None or lists is None:
        return plan
    local_hit = num_computed_tokens // block_size
    cut = cut_to_prefix(
        groups,
        lists,
        attach_blocks=plan.attach_blocks,
        local_hit=local_hit,
        peer_tokens=peer_tokens,
        block_size=block_size,
    )
    if not isinstance(cut, Refused):
        return dataclasses.replace(plan, block_ids=cut)
    fallback = cut_to_prefix(
        groups, lists, attach_blocks=local_hit, local_hit=local_hit, peer_tokens=peer_tokens, block_size=block_size
    )
    assert not isinstance(fallback, Refused)  # nothing to pull: never refused
    return dataclasses.replace(
        plan,
        attach_blocks=local_hit,
        rejected_blocks=plan.rejected_blocks + plan.attached_blocks,
        recomputed_tokens=plan.recomputed_tokens + plan.attach_blocks * block_size - num_computed_tokens,
        attached_blocks=0,
        explanation=f"{plan.explanation}; {cut.why}: recompute beyond the local hit",
        block_ids=fallback,
    )


def tail_verified(
    prompt: PromptView, offer: BlockOffer, reason: Reason, num_verified: int, num_own_blocks: int, block_size: int
) -> bool:
    """Whether the peer's whole offer verified and covers exactly this prompt.

    The partial tail has no block hash: given a verified chain up to it, equal token
    ids mean equal KV, unless extra keys (LoRA, multimodal) apply."""
    if reason is not Reason.VERIFIED_ALL or num_verified != offer.num_blocks or num_verified != num_own_blocks:
        return False
    if offer.num_tokens != prompt.num_prompt_tokens or prompt.extra_keys or prompt.prompt_token_ids is None:
        return False
    return tuple(prompt.prompt_token_ids[num_verified * block_size :]) == offer.tail_token_ids


def external_tokens(plan: AttachPlan, num_computed_tokens: int, block_size: int) -> int:
    """Tokens to load from the peer under a partial ``plan`` (may be <= 0: none)."""
    assert plan.attach_blocks is not None
    return plan.attach_blocks * block_size - num_computed_tokens


def apply_plan(plan: AttachPlan, params: dict[str, Any]) -> None:
    """Rewrite ``params`` so that the inner connector pulls only what ``plan`` allows.

    Each group's block list becomes the plan's cut of it, which vLLM's pull pairs with
    this engine's blocks beyond its local hit. The lists stay even when nothing is
    attached, so the peer is told to free its blocks. A plan that loads the whole
    offer leaves them as they are; a screened-out request has none left: nothing to do.
    """
    if plan.attach_blocks is not None and plan.block_ids is not None and "remote_block_ids" in params:
        params["remote_block_ids"] = [list(group) for group in plan.block_ids]
