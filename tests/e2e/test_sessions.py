"""Sessions across pools: P pulls the session's newest KV back from D (vLLM's
bidirectional protocol) through KVPilotConnector, configured as a drop-in for
NixlConnector, and attaches only what verifies against its own tokens; driven
directly, as vLLM's multi-turn proxy does, and through kvpilot's router."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.client import complete
from deploy.fleet import Fleet
from deploy.fleet_spec import FleetSpec
from deploy.metrics import delta, scrape
from fleets import running_fleet
from routing.tokenizer import PromptTokenizer
from scenarios import PROMPT_TOKENS, RECOMPUTED, VERIFIED, settle
from sessions import (
    EDITS, GENERATED, PULL_DECISIONS, block_count, colocated, common_prefix, handshake_both_ways, history,
    run_session,
)  # fmt: skip

pytestmark = pytest.mark.e2e

PORTS = {"engine_port": 8710, "side_channel_port": 6110, "events_port": 6710, "router_port": 8700}
# NixlConnector's own keys at the top level; the threshold pinned at 0 (always pull
# what verifies) so that the co-located reference can split its prefill where P does.
DROP_IN = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}
SESSION_OFFERS = "kvpilot_router_session_offers_total"


@pytest.fixture(scope="module")
def spec(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FleetSpec:
    return FleetSpec(model_dir=model_dir, run_dir=tmp_path_factory.mktemp("session-fleet"), disaggregation="always",
                     connector_extra_config=DROP_IN, **PORTS)  # fmt: skip


@pytest.fixture(scope="module")
def fleet(spec: FleetSpec, tokenizer: PromptTokenizer) -> Iterator[Fleet]:
    with running_fleet(spec) as started:
        handshake_both_ways(*_urls(started), tokenizer)
        yield started


def _urls(fleet: Fleet) -> tuple[str, str]:
    return fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url


@pytest.mark.parametrize("edit", list(EDITS), ids=str)
def test_p_pulls_only_what_verifies_and_answers_like_colocated(
    fleet: Fleet, tokenizer: PromptTokenizer, edit: str
) -> None:
    prefill, decode = _urls(fleet)
    turn = run_session(prefill, decode, tokenizer, seed=100 + list(EDITS).index(edit), edit=EDITS[edit])
    # P holds x's full blocks from turn 1; D offers x + its generated tokens (the
    # last one has no KV yet); both offers and prompts are compared block by block.
    offered = turn.x + turn.gen[: GENERATED - 1]
    local_hit = block_count(common_prefix(turn.x, turn.x2))
    verified = min(block_count(common_prefix(offered, turn.x2)), block_count(len(offered)))
    pulled = max(0, verified - local_hit)
    recomputed = min(len(offered), len(turn.x2)) - max(verified, local_hit) * 32
    reason = "partial_tail" if verified == block_count(len(offered)) else "token_mismatch"

    reference = colocated(decode, turn.x, turn.x2, max(verified, local_hit))
    assert turn.p_out.logprobs[0] == reference.logprobs[0], "P's first token differs from the co-located run"
    assert turn.d_out.same_output(reference), f"max logprob diff {turn.d_out.max_logprob_diff(reference)}"

    # D's hold on its blocks, in Unix time: decoder_kv_blocks_ttl (480 s) after it answered.
    assert turn.d_params["kvpilot_expires_at"] == pytest.approx(turn.d_params_at + 480, abs=30)
    after, before = turn.p_after, turn.p_before
    assert delta(after, before, VERIFIED) == pulled
    assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == pulled * 32
    assert delta(after, before, RECOMPUTED, reason=reason) == recomputed
    expected_decisions = 1 if pulled else 0
    assert delta(after, before, PULL_DECISIONS, decision="pull", reason="threshold") == expected_decisions


def test_another_salt_pulls_nothing(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    prefill, decode = _urls(fleet)
    turn = run_session(prefill, decode, tokenizer, seed=200, edit=EDITS["unedited"], turn2_salt="tenant-b")
    reference = colocated(decode, turn.x, turn.x2, reused_blocks=0)
    assert turn.p_out.logprobs[0] == reference.logprobs[0]
    assert turn.d_out.same_output(reference)
    assert delta(turn.p_after, turn.p_before, VERIFIED) == 0
    assert delta(turn.p_after, turn.p_before, PROMPT_TOKENS, source="external_kv_transfer") == 0
    offered = len(turn.x) + GENERATED - 1
    assert delta(turn.p_after, turn.p_before, RECOMPUTED, reason="contract_mismatch") == offered


def test_an_expired_lease_is_recomputed_not_pulled(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """D's params say when its hold ends in wall-clock time; P does not race it."""
    prefill, decode = _urls(fleet)

    turn = run_session(prefill, decode, tokenizer, seed=300, edit=EDITS["unedited"], mutate_params=lambda p: {**p, "kvpilot_expires_at": p["kvpilot_expires_at"] - 10_000})
    assert delta(turn.p_after, turn.p_before, VERIFIED) == 0
    assert delta(turn.p_after, turn.p_before, RECOMPUTED, reason="lease_expired") > 0
    reference = colocated(decode, turn.x, turn.x2, block_count(len(turn.x)))
    assert turn.p_out.logprobs[0] == reference.logprobs[0]


def test_the_router_hands_ds_offer_to_p_at_the_next_step(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """Option 2 of the article's section 9.2 through the router: a client that resends
    the whole history with a ``conversation_id`` gets P's pull of D's KV at step 2,
    with D's answer equal to a co-located run."""
    prefill, decode = _urls(fleet)
    router = fleet.router.url
    x = history(tokenizer, 600)
    step1 = complete(router, x, max_tokens=GENERATED, ignore_eos=True, return_token_ids=True, conversation_id="s600")
    x2 = x + list(step1.token_ids) + tokenizer.prompt_token_ids(" tool: ok, 3 tests pass")
    before, router_before = scrape(prefill), scrape(router)
    step2 = complete(router, x2, max_tokens=8, conversation_id="s600")
    after, router_after = settle(prefill), scrape(router)

    offered = x + list(step1.token_ids)[: GENERATED - 1]
    verified = block_count(len(offered))
    pulled = verified - block_count(len(x))
    assert delta(router_after, router_before, SESSION_OFFERS, outcome="sent") == 1
    assert delta(after, before, VERIFIED) == pulled
    assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == pulled * 32
    reference = colocated(decode, x, x2, verified)
    assert step2.same_output(reference), f"max logprob diff {step2.max_logprob_diff(reference)}"
