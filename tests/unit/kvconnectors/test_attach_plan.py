"""plan_attach: what one request loads from a peer's offer, table by table, without vLLM."""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import msgspec
import pytest

from kvpilot.kvconnectors.attach_plan import AttachPlan, PromptView, apply_plan, external_tokens, plan_attach
from kvpilot.kvconnectors.group_clip import ONE_FULL_GROUP, GroupKind, GroupLayout
from kvpilot.kvconnectors.hash_contract import salt_identity
from kvpilot.kvconnectors.pull_policy import DecidedBy, PullDecision
from kvpilot.kvconnectors.reasons import Reason
from kvpilot.kvconnectors.transfer_params import PARAMS_KEY, encode_offer
from kvpilot.policies.recompute_vs_transfer import Span
from tests.unit.kvconnectors.offer_contract import CONTRACT

BLOCK = CONTRACT.block_size  # 16
TAIL = (7, 8, 9, 10, 11)


def _hashes(labels: str) -> list[bytes]:
    """One block per character: equal characters are equal blocks."""
    return [hashlib.sha256(c.encode()).digest() for c in labels]


def _prompt(labels: str, tail: tuple[int, ...] = TAIL, extra: int = 0, **kw: Any) -> PromptView:
    """A prompt of ``len(labels)`` full blocks (token ids stand in), ``tail``, then ``extra`` tokens."""
    ids = [1] * (len(labels) * BLOCK) + list(tail) + [2] * extra
    return PromptView(num_prompt_tokens=len(ids), prompt_token_ids=ids, block_hashes=_hashes(labels), **kw)


def _params(labels: str = "abcd", tail: tuple[int, ...] = TAIL, handoff: bool = True) -> dict[str, Any]:
    params: dict[str, Any] = {
        PARAMS_KEY: encode_offer(CONTRACT, _hashes(labels), tail),
        "remote_block_ids": [[10, 11, 12, 13]],
    }
    if handoff:
        params["do_remote_prefill"] = True
    return params


def _never(span: Span) -> PullDecision:
    raise AssertionError(f"the pull policy was asked about {span} for a P->D handoff")


def _policy(pull: bool):
    asked: list[Span] = []

    def decide(span: Span) -> PullDecision:
        asked.append(span)
        return PullDecision("pull" if pull else "recompute", DecidedBy.THRESHOLD, span, "test policy")

    return decide, asked


class Case(NamedTuple):
    prompt: PromptView
    params: dict[str, Any]
    computed: int
    attach_blocks: int | None
    reason: Reason
    attached: int
    rejected: int
    recomputed: int


HANDOFFS = {
    "everything verified, tail included": Case(_prompt("abcd"), _params(), 0, None, Reason.VERIFIED_ALL, 4, 0, 0),
    "beyond a local hit of 2 blocks": Case(_prompt("abcd"), _params(), 2 * BLOCK, None, Reason.VERIFIED_ALL, 2, 0, 0),
    "tail token differs": Case(
        _prompt("abcd", tail=(7, 8, 9, 10, 99)), _params(), 0, 4, Reason.TOKEN_MISMATCH, 4, 0, 5
    ),
    "prompt runs past the offer": Case(_prompt("abcd", extra=20), _params(), 0, 4, Reason.PARTIAL_TAIL, 4, 0, 5),
    "block 2 differs": Case(_prompt("abXd"), _params(), 0, 2, Reason.TOKEN_MISMATCH, 2, 2, 37),
    "block 2 differs inside the local hit": Case(
        _prompt("abXd"), _params(), 3 * BLOCK, 3, Reason.TOKEN_MISMATCH, 0, 1, 21
    ),
    "LoRA: the tail is not trusted": Case(
        _prompt("abcd", extra_keys=True), _params(), 0, 4, Reason.PARTIAL_TAIL, 4, 0, 5
    ),
    "prompt embeddings: no tail to compare": Case(
        PromptView(num_prompt_tokens=69, prompt_token_ids=None, block_hashes=_hashes("abcd")),
        _params(),
        0,
        4,
        Reason.TOKEN_MISMATCH,
        4,
        0,
        5,
    ),
    "malformed offer": Case(
        _prompt("abcd"), {**_params(), PARAMS_KEY: {"v": "junk"}}, BLOCK, 0, Reason.MALFORMED, 0, 3, 69 - BLOCK
    ),
}


@pytest.mark.parametrize("name", HANDOFFS)
def test_a_handoff_loads_only_what_verifies(name: str) -> None:
    case = HANDOFFS[name]
    plan = plan_attach(case.prompt, case.params, CONTRACT, case.computed, decide_pull=_never, groups=ONE_FULL_GROUP)
    got = (plan.attach_blocks, plan.reason, plan.attached_blocks, plan.rejected_blocks, plan.recomputed_tokens)
    assert got == (case.attach_blocks, case.reason, case.attached, case.rejected, case.recomputed), plan.explanation
    assert plan.pull_decision is None


def test_another_tenants_offer_is_a_contract_mismatch() -> None:
    theirs = msgspec.structs.replace(CONTRACT, salt_id=salt_identity("tenant-b"))
    params = {PARAMS_KEY: encode_offer(theirs, _hashes("abcd"), TAIL), "do_remote_prefill": True}
    plan = plan_attach(_prompt("abcd"), params, CONTRACT, 0, decide_pull=_never, groups=ONE_FULL_GROUP)
    assert (plan.attach_blocks, plan.reason, plan.recomputed_tokens) == (0, Reason.CONTRACT_MISMATCH, 69)
    # the differing field, without this request's sizes: what the scheduler logs once per peer config
    assert [d.field for d in plan.contract_diffs] == ["salt_id"]


def test_screened_out_and_skipped_offers_load_nothing_and_say_why() -> None:
    screened = plan_attach(
        _prompt("abcd"),
        _params(),
        CONTRACT,
        BLOCK,
        screened_out="malformed remote_port",
        decide_pull=_never,
        groups=ONE_FULL_GROUP,
    )
    assert (screened.reason, screened.attach_blocks, screened.recomputed_tokens) == (Reason.MALFORMED, 0, 69 - BLOCK)
    assert screened.explanation == "malformed remote_port"
    skipped = plan_attach(
        _prompt("abcd", extra=20),
        _params(),
        CONTRACT,
        BLOCK,
        skip=(Reason.LEASE_EXPIRED, "the peer's lease ends in 1.0 s"),
        decide_pull=_never,
        groups=ONE_FULL_GROUP,
    )
    # offered 69 tokens of a 89-token prompt, 16 of them already here
    assert (skipped.reason, skipped.attach_blocks, skipped.rejected_blocks, skipped.recomputed_tokens) == (
        Reason.LEASE_EXPIRED,
        0,
        3,
        69 - BLOCK,
    )
    assert skipped.explanation.endswith("prefill locally")


def test_a_session_pull_asks_the_policy_about_the_verified_span_beyond_the_local_hit() -> None:
    decide, asked = _policy(pull=True)
    prompt = _prompt("abcd", extra=20)  # the next turn: the peer's session plus 20 new tokens
    plan = plan_attach(prompt, _params(handoff=False), CONTRACT, BLOCK, decide_pull=decide, groups=ONE_FULL_GROUP)
    assert asked == [Span(tokens=3 * BLOCK, context=BLOCK, new_tokens=prompt.num_prompt_tokens - 4 * BLOCK)]
    assert (plan.attach_blocks, plan.attached_blocks, plan.policy_recomputed_tokens) == (4, 3, 0)
    assert plan.pull_decision is not None and plan.pull_decision.pull
    assert "pull: test policy" in plan.explanation


def test_a_session_pull_the_policy_declines_keeps_only_the_local_hit() -> None:
    decide, asked = _policy(pull=False)
    plan = plan_attach(
        _prompt("abcd"), _params(handoff=False), CONTRACT, BLOCK, decide_pull=decide, groups=ONE_FULL_GROUP
    )
    # everything verified, tail too: the span runs to the offer's end (69 tokens)
    assert asked == [Span(tokens=69 - BLOCK, context=BLOCK, new_tokens=0)]
    assert (plan.attach_blocks, plan.attached_blocks, plan.policy_recomputed_tokens) == (1, 0, 69 - BLOCK)
    assert "recompute the verified span" in plan.explanation


def test_a_session_pull_with_nothing_beyond_the_local_hit_asks_nobody() -> None:
    plan = plan_attach(_prompt("abcd"), _params(handoff=False), CONTRACT, 69, decide_pull=_never, groups=ONE_FULL_GROUP)
    assert plan.attached_blocks == 0 and plan.pull_decision is None


def test_applying_a_plan_cuts_the_peers_block_list_to_the_verified_prefix() -> None:
    params = _params()
    plan = plan_attach(_prompt("abXd"), params, CONTRACT, 0, decide_pull=_never, groups=ONE_FULL_GROUP)
    apply_plan(plan, params)
    assert params["remote_block_ids"] == [[10, 11]]
    assert external_tokens(plan, 0, BLOCK) == 2 * BLOCK
    everything = AttachPlan(
        attach_blocks=None,
        reason=Reason.VERIFIED_ALL,
        rejected_blocks=0,
        recomputed_tokens=0,
        attached_blocks=4,
        explanation="",
    )
    untouched = _params()
    apply_plan(everything, untouched)
    assert untouched["remote_block_ids"] == [[10, 11, 12, 13]]


HYBRID = (
    GroupLayout(index=0, spec_name="SlidingWindowSpec", kind=GroupKind.SLIDING, sliding_window=BLOCK),
    GroupLayout(index=1, spec_name="FullAttentionSpec", kind=GroupKind.FULL),
)


def _hybrid_params() -> dict[str, Any]:
    """The offer of 69 tokens in 5 blocks; the window group sends its last 2 (positions 3, 4)."""
    return {**_params(), "remote_block_ids": [[23, 24], [10, 11, 12, 13, 14]]}


def test_a_hybrid_plan_cuts_each_group_by_its_own_rule() -> None:
    params = _hybrid_params()
    plan = plan_attach(_prompt("abcd", tail=(7, 8, 9, 10, 99)), params, CONTRACT, 0, decide_pull=_never, groups=HYBRID)
    assert (plan.attach_blocks, plan.attached_blocks, plan.reason) == (4, 4, Reason.TOKEN_MISMATCH)
    apply_plan(plan, params)
    assert params["remote_block_ids"] == [[23], [10, 11, 12, 13]]  # the window's block 3; blocks 0-3


def test_a_hybrid_prefix_whose_window_the_peer_freed_is_recomputed() -> None:
    params = _hybrid_params()
    plan = plan_attach(_prompt("abXd"), params, CONTRACT, 0, decide_pull=_never, groups=HYBRID)
    assert (plan.attach_blocks, plan.attached_blocks) == (0, 0)
    assert (plan.reason, plan.rejected_blocks, plan.recomputed_tokens) == (Reason.TOKEN_MISMATCH, 4, 69)
    assert "KV cache group 0 (SlidingWindowSpec, window 16)" in plan.explanation
    apply_plan(plan, params)
    assert params["remote_block_ids"] == [[], []]  # still sent: the peer frees its blocks
