"""Sessions across pools: P pulls the session's newest KV back from D (vLLM's
bidirectional protocol) through KVPilotConnector, configured as a drop-in for
NixlConnector, and attaches only what verifies against its own tokens; driven
directly, as vLLM's multi-turn proxy does, and through kvpilot's router."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from kvpilot.deploy.client import Completion, complete, wait_for_overlap
from kvpilot.deploy.fleet import Fleet, restart_router
from kvpilot.deploy.fleet_spec import DECODE_HOLD_TTL_S, ROUTER_CONFIG, FleetSpec
from kvpilot.deploy.metrics import delta, scrape
from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.policies.disaggregation import DecodeState
from kvpilot.policies.session_hold import HoldReason
from kvpilot.policies.session_options import Option, PrefillSite, SessionOptionPricer, SessionStep
from kvpilot.routing.config import prior_model
from kvpilot.routing.config_load import add_cli_flags, load_config
from kvpilot.routing.decide.router import policy_from_config
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import SharedFleet
from tests.e2e.scenarios import BLOCK_SIZE, PROMPT_TOKENS, RECOMPUTED, VERIFIED
from tests.e2e.sessions import (
    EDITS,
    GENERATED,
    PULL_DECISIONS,
    Edit,
    block_count,
    colocated,
    colocated_steps,
    common_prefix,
    handshake_both_ways,
    history,
    logprob_diffs,
    numerically_same,
    run_session,
)
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()
# NixlConnector's own keys at the top level; the threshold pinned at 0 (always pull
# what verifies) so that the co-located reference can split its prefill where P does.
DROP_IN = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}
SESSION_OFFERS = "kvpilot_router_session_offers_total"
SESSION_OPTIONS = "kvpilot_router_session_options_total"
SESSION_HOLDS = "kvpilot_router_session_holds_total"
HOLDS_RELEASED = vm.KVPILOT_HOLDS_RELEASED.total


@pytest.fixture(scope="module")
def shared(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, shared_fleet: SharedFleet, tokenizer: PromptTokenizer
) -> tuple[FleetSpec, Fleet]:
    """The fleet ``test_pull_policy_live`` goes on to use (``tests/e2e/conftest.py``)."""
    spec, started = shared_fleet.get(
        FleetSpec(
            model_dir=model_dir,
            run_dir=tmp_path_factory.mktemp("session-fleet"),
            disaggregation="always",
            connector_extra_config=DROP_IN,
            **PORTS,
        )
    )
    handshake_both_ways(*_urls(started), tokenizer)
    return spec, started


@pytest.fixture(scope="module")
def spec(shared: tuple[FleetSpec, Fleet]) -> FleetSpec:
    return shared[0]


@pytest.fixture(scope="module")
def fleet(shared: tuple[FleetSpec, Fleet]) -> Fleet:
    return shared[1]


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

    # D's hold on its blocks, in Unix time: decoder_kv_blocks_ttl (the fleet's) after it answered.
    assert turn.d_params["kvpilot_expires_at"] == pytest.approx(turn.d_params_at + DECODE_HOLD_TTL_S, abs=30)
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

    turn = run_session(
        prefill,
        decode,
        tokenizer,
        seed=300,
        edit=EDITS["unedited"],
        mutate_params=lambda p: {**p, "kvpilot_expires_at": p["kvpilot_expires_at"] - 10_000},
    )
    assert delta(turn.p_after, turn.p_before, VERIFIED) == 0
    assert delta(turn.p_after, turn.p_before, RECOMPUTED, reason="lease_expired") > 0
    reference = colocated(decode, turn.x, turn.x2, block_count(len(turn.x)))
    assert turn.p_out.logprobs[0] == reference.logprobs[0]


OPTIONS = ("reprefill", "pull", "affinity", "local")


def _router_choosing(spec: FleetSpec, flags: list[str]) -> str:
    """The fleet's router restarted with ``flags`` (the engines keep running; the
    index is rebuilt from their replay and fresh events); its URL."""
    return restart_router(spec, flags).router.url


def _agent_steps(
    router: str,
    x: list[int],
    tokenizer: PromptTokenizer,
    session: str,
    edit_step3: Edit = EDITS["unedited"],
    gap_before_step2_s: float = 0.0,
) -> list[tuple[list[int], Completion]]:
    """Three steps of one agent session through ``router``: each resends the whole
    history, D's tool call and a new tool output appended (``edit_step3`` edits the
    history before step 3; step 2 waits ``gap_before_step2_s`` more, a tool call's
    gap); returns each step's prompt and answer."""
    steps, prompt = [], x
    for n, max_tokens in enumerate((GENERATED, GENERATED, 8)):
        if n == 1:
            time.sleep(gap_before_step2_s)
        out = complete(
            router, prompt, max_tokens=max_tokens, ignore_eos=True, return_token_ids=True, conversation_id=session
        )
        steps.append((prompt, out))
        # D holds the step's prompt now: the next step is routed once the router's index
        # shows it (D's KV events lag on a loaded box, and a stale index prices D cold).
        wait_for_overlap(router, prompt, "decode-0", len(prompt) // BLOCK_SIZE)
        tool = tokenizer.text_token_ids(f" tool: step {n} ok, {n + 3} tests pass")
        edit = edit_step3 if n == 1 else EDITS["unedited"]
        prompt = edit(prompt, list(out.token_ids)) + tool
    return steps


@pytest.mark.parametrize("option", OPTIONS)
def test_a_session_served_by_each_forced_option_answers_like_colocated(
    spec: FleetSpec, fleet: Fleet, tokenizer: PromptTokenizer, option: str
) -> None:
    """The article's options 1, 2, 3 and 5 (section 9.2), each forced by config: a
    client resending the whole history with a ``conversation_id`` gets answers equal
    to a co-located run, token for token and logprob for logprob."""
    # forced local: Dynamo's thresholds alone (no cost checks), so that the option stays available
    local_flags = ["--disaggregation-max-local-tokens", "2048", "--disaggregation-compare-costs", "false"]
    flags = ["--sessions-force-option", option] + (local_flags if option == "local" else [])
    router = _router_choosing(spec, flags)
    prefill, decode = _urls(fleet)
    x = history(tokenizer, 600 + OPTIONS.index(option))
    router_before, p_before = scrape(router), scrape(prefill)
    steps = _agent_steps(router, x, tokenizer, f"forced-{option}")
    router_after, p_after = scrape(router), scrape(prefill)  # the router counts before it answers

    assert delta(router_after, router_before, SESSION_OPTIONS, option=option) == 2  # steps 2 and 3
    routes = [out.headers["X-KVPilot-Route"] for _, out in steps]
    assert routes == ["remote_prefill"] + ["local_prefill" if option == "local" else "remote_prefill"] * 2
    sent = delta(router_after, router_before, SESSION_OFFERS, outcome="sent")
    assert sent == (2 if option == "pull" else 0)
    if option == "pull":  # P loads D's blocks beyond its own cache of the last prompt, at each step
        (x1, _), (x2, _), _ = steps
        pulled = [block_count(len(prev) + GENERATED - 1) - block_count(len(prev)) for prev in (x1, x2)]
        assert delta(p_after, p_before, VERIFIED) == sum(pulled)
    else:
        assert delta(p_after, p_before, VERIFIED) == 0
    # reprefill and affinity re-prefill on P the tokens D decoded (the reference decodes
    # them): equal up to that noise; local and pull reuse D's own KV: bit-identical
    same = Completion.same_output if option in ("local", "pull") else numerically_same
    for n, ((_, out), ref) in enumerate(zip(steps, colocated_steps(decode, steps), strict=True), start=1):
        diffs = sorted(round(d, 5) for d in logprob_diffs(out, ref))
        assert same(out, ref), f"step {n}: divergence {out.divergence(ref)}, |logprob diffs| {diffs}"


def test_d_holds_a_step_only_for_a_session_expected_back_within_the_horizon(
    spec: FleetSpec, fleet: Fleet, tokenizer: PromptTokenizer
) -> None:
    """``sessions.hold: priced`` (:mod:`kvpilot.policies.session_hold`), live: the router
    counts a session as living on D for 2 s here, and step 2 comes 3 s after step 1. Step 1
    is held (no gap measured yet) and its offer is pulled by step 2; step 2 is released:
    D frees its blocks at once and offers nothing, so step 3 takes another option. Every
    release the router decides is one D made, and the answers are the co-located run's."""
    router = _router_choosing(spec, ["--sessions-force-option", "pull", "--sessions-resident-s", "2"])
    decode = _urls(fleet)[1]
    router_before, d_before = scrape(router), scrape(decode)
    steps = _agent_steps(router, history(tokenizer, 800), tokenizer, "held-or-not", gap_before_step2_s=3.0)
    router_after, d_after = scrape(router), scrape(decode)

    assert delta(router_after, router_before, SESSION_HOLDS, decision="hold", reason="first_step") == 1
    # step 2 (3 s > 2 s); step 3's median gap may or may not be within 2 s
    assert delta(router_after, router_before, SESSION_HOLDS, decision="release", reason="outlasts_hold") >= 1
    released = sum(
        delta(router_after, router_before, SESSION_HOLDS, decision="release", reason=why.value) for why in HoldReason
    )
    assert delta(d_after, d_before, HOLDS_RELEASED) == released
    assert delta(router_after, router_before, SESSION_OFFERS, outcome="sent") == 1  # step 1's, to step 2's P
    for n, ((_, out), ref) in enumerate(zip(steps, colocated_steps(decode, steps), strict=True), start=1):
        diffs = sorted(round(d, 5) for d in logprob_diffs(out, ref))
        assert numerically_same(out, ref), f"step {n}: divergence {out.divergence(ref)}, |logprob diffs| {diffs}"


def _priced_independently(spec: FleetSpec, flags: list[str], step: SessionStep) -> dict[str, float]:
    """``step``'s options priced by :mod:`kvpilot.policies.session_options` under the router's
    config as the fleet wrote it (its YAML, then ``flags``), not read back from it."""
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    config = load_config(spec.run_dir / ROUTER_CONFIG, parser.parse_args(flags))
    pricer = SessionOptionPricer(policy_from_config(config.disaggregation, prior_model(config)))
    return {p.option.value: p.seconds for p in pricer.price(step) if p.available}


def test_unforced_the_router_takes_the_cheapest_option_and_edits_stay_correct(
    spec: FleetSpec, fleet: Fleet, tokenizer: PromptTokenizer
) -> None:
    """By cost, on a setup where one option must win at each step: a truncated history
    (section 5) at step 3 is still answered correctly.

    Step 2 and step 4 go local: D holds every block of the prompt that any P holds or
    D offers, plus its own generated ones, on the same hardware, and every other option
    adds a handoff to D. Step 3 is re-prefilled: the truncated history matches no cached
    block, so local prefill fails the 70% share guard, D's offer holds none of it, and
    step 2 had no P for affinity. Step 4's prices are recomputed here from the fleet's
    config and the blocks each engine must hold."""
    flags = [
        "--disaggregation-max-local-tokens",
        "2048",
        "--disaggregation-measured-rates",
        "false",
    ]  # the roofline's prices, recomputed below
    router = _router_choosing(spec, flags)
    decode = _urls(fleet)[1]
    x = history(tokenizer, 700)
    before = scrape(router)
    steps = _agent_steps(router, x, tokenizer, "by-cost", edit_step3=EDITS["history truncated"])
    after = scrape(router)
    assert [out.headers["X-KVPilot-Route"] for _, out in steps] == ["remote_prefill", "local_prefill", "remote_prefill"]
    assert delta(after, before, SESSION_OPTIONS, option="local") == 1
    assert delta(after, before, SESSION_OPTIONS, option="reprefill") == 1

    (x3, out3) = steps[-1]
    x4 = x3 + list(out3.token_ids)
    p_cached = block_count(len(x3)) * 32  # P prefilled step 3's prompt
    d_cached = block_count(len(x3) + len(out3.tokens) - 1) * 32  # D: that prompt and its generated KV
    priced = wait_for_overlap(router, x4, "decode-0", d_cached // 32, conversation_id="by-cost")
    assert priced["overlap"]["decode-0"]["GPU"] == d_cached // 32 and priced["overlap"]["prefill-0"]["GPU"] == (
        p_cached // 32
    )
    prefill_0 = PrefillSite("prefill-0", p_cached)
    step4 = SessionStep(len(x4), prefill_0, "decode-0", d_cached, DecodeState(), last_p=prefill_0, last_d_chosen=True)
    expected = _priced_independently(spec, flags, step4)
    assert min(expected, key=expected.__getitem__) == Option.LOCAL.value
    reported = {o["option"]: o["ttft_s"] for o in priced["options"] if o["available"]}
    for option in ("local", "reprefill", "affinity"):
        assert reported[option] == pytest.approx(expected[option], rel=1e-9), option
    assert priced["session_option"] == "local"
    assert {o["option"]: o["available"] for o in priced["options"]}["shared_tier"] is False
    before = scrape(router)
    complete(router, x4, max_tokens=8, conversation_id="by-cost")
    assert delta(scrape(router), before, SESSION_OPTIONS, option="local") == 1
    for n, ((_, out), ref) in enumerate(zip(steps, colocated_steps(decode, steps), strict=True), start=1):
        assert out.same_output(ref), f"step {n}: max logprob diff {out.max_logprob_diff(ref)}"
