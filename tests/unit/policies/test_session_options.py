"""The five options for a session's next step (reference article, section 9.2), priced."""

from __future__ import annotations

import math

import pytest

from kvpilot.policies.disaggregation import (
    KVPILOT_DEFAULT,
    DecodeState,
    LocalPrefillConfig,
    LocalVsRemotePolicy,
    MeasuredTimes,
)
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset
from kvpilot.policies.session_options import Option, PrefillSite, SessionOptionPricer, SessionStep, choose
from kvpilot.routing.config import ForcedOption


def pricer(link: str = "rdma", config: LocalPrefillConfig = KVPILOT_DEFAULT) -> SessionOptionPricer:
    h100 = hardware_preset("h100")
    policy = LocalVsRemotePolicy(
        model_preset("llama-70b"), kv_format_preset("bf16"), h100, h100, link_preset(link), config
    )
    return SessionOptionPricer(policy)


# Step 20 of the article's agent: a 63,000-token prompt; P holds the shared prefix
# and step 19's prompt, D the whole session but the new 1,500-token tool output.
STEP = SessionStep(
    prompt_tokens=63_000,
    p=PrefillSite("p0", cached_tokens=61_350),
    d_name="d0",
    d_cached_tokens=61_500,
    decode=DecodeState(kv_usage=0.3, running_streams=0),
    last_p=PrefillSite("p0", cached_tokens=61_350),
    last_d_chosen=True,
    offer_tokens=61_500,
    offer_time_left_s=400.0,
)


def by_option(step: SessionStep, **kw) -> dict[Option, object]:
    return {price.option: price for price in pricer(**kw).price(step)}


def test_the_config_names_are_the_options() -> None:
    assert [forced.option for forced in ForcedOption] == [None, *Option]
    assert all(forced.value == forced.option.value for forced in ForcedOption if forced.option is not None)
    assert [o.article_number for o in Option] == [1, 2, 3, 4, 5]


def test_an_idle_d_holding_the_session_prefills_the_increment_locally() -> None:
    prices = by_option(STEP)
    assert choose(tuple(prices.values())).option is Option.LOCAL
    # Local skips both P's queue and the handoff of the new blocks.
    assert prices[Option.LOCAL].seconds < prices[Option.AFFINITY].seconds
    assert not prices[Option.SHARED_TIER].available


def test_a_busy_d_sends_the_step_to_p_and_the_pull_pays_only_for_what_p_lacks() -> None:
    busy = SessionStep(**{**_fields(STEP), "decode": DecodeState(kv_usage=0.95, running_streams=40)})
    prices = by_option(busy)
    assert not prices[Option.LOCAL].available and "guard" in prices[Option.LOCAL].why
    chosen = choose(tuple(prices.values()))
    # P lacks only D's 150 generated tokens: pulling them costs a NIXL post, recomputing them
    # a pass that attends over 61K tokens; the affinity path recomputes them.
    assert chosen.option in (Option.PULL, Option.AFFINITY)
    assert prices[Option.AFFINITY].seconds == prices[Option.REPREFILL].seconds  # same P, same D


def test_a_p_holding_only_the_shared_prefix_pulls_over_nvlink_but_not_over_slow_tcp() -> None:
    cold = {
        **_fields(STEP),
        "p": PrefillSite("p1", cached_tokens=2_000),
        "last_d_chosen": True,
        "decode": DecodeState(kv_usage=0.95, running_streams=40),
    }
    step = SessionStep(**cold)
    fast = by_option(step, link="nvlink")
    assert choose(tuple(fast.values())).option is Option.PULL  # 59,500 tokens of recompute avoided
    assert fast[Option.PULL].seconds < fast[Option.REPREFILL].seconds
    slow = by_option(step, link="tcp")
    assert slow[Option.PULL].seconds > fast[Option.PULL].seconds


@pytest.mark.parametrize(
    ("change", "option", "why"),
    [
        ({"offer_tokens": None}, Option.PULL, "no offer"),
        ({"offer_time_left_s": 3.0}, Option.PULL, "expires"),
        ({"offer_tokens": 61_000}, Option.PULL, "already holds"),
        ({"last_p": None}, Option.AFFINITY, "no prefill worker"),
        ({"last_d_chosen": False}, Option.AFFINITY, "moved the session"),
        ({"last_p": PrefillSite("p0", 61_350, available=False)}, Option.AFFINITY, "unavailable"),
        ({"p": None}, Option.REPREFILL, "no prefill worker"),
    ],
)
def test_an_option_that_cannot_serve_says_why(change: dict, option: Option, why: str) -> None:
    price = by_option(SessionStep(**{**_fields(STEP), **change}))[option]
    assert not price.available and math.isinf(price.seconds)
    assert why in price.why and "unavailable" in price.explain()


def test_a_forced_option_wins_while_available_and_the_cheapest_otherwise() -> None:
    prices = pricer().price(STEP)
    assert choose(prices, Option.PULL).option is Option.PULL
    no_offer = pricer().price(SessionStep(**{**_fields(STEP), "offer_tokens": None}))
    assert choose(no_offer, Option.PULL).option is Option.LOCAL


def test_a_shared_tier_is_priced_only_when_it_holds_more_than_p() -> None:
    step = SessionStep(**{**_fields(STEP), "p": PrefillSite("p1", 2_000), "shared_tokens": 61_500})
    price = by_option(step)[Option.SHARED_TIER]
    assert price.available and "restore 59500 tokens" in price.why


def test_without_a_p_d_serves_the_step_whatever_its_thresholds_say() -> None:
    never_local = LocalPrefillConfig(max_local_tokens=0)
    prices = pricer(config=never_local).price(SessionStep(**{**_fields(STEP), "p": None, "last_p": None}))
    assert [p.option for p in prices if p.available] == [Option.LOCAL]


def test_no_option_available_is_an_error_naming_each() -> None:
    prices = tuple(p for p in pricer().price(STEP) if not p.available)
    with pytest.raises(ValueError, match="option 4 shared_tier: unavailable"):
        choose(prices)


def _fields(step: SessionStep) -> dict:
    return {name: getattr(step, name) for name in SessionStep.__slots__}


# One of four sessions stepping at once on one D (bench_agent's lockstep): D already
# runs another session's step, its local prefill of the 140-token increment measured
# at 0.5 s (over the 50 ms stall budget), and P, which last saw the session at step 1,
# would re-prefill 1,068 tokens in 4.4 s.
LOCKSTEP = SessionStep(
    prompt_tokens=2_200,
    p=PrefillSite("p0", cached_tokens=1_088),
    d_name="d0",
    d_cached_tokens=2_060,
    decode=DecodeState(kv_usage=0.01, running_streams=1),
    last_p=None,
    last_d_chosen=True,
    measured=MeasuredTimes(local_s=0.5, remote_s=4.4, local_stall_s=0.5),
)


@pytest.mark.parametrize(
    ("streams", "best_other_s", "local_kept"),
    [
        (1, 4.4, True),  # 0.5 s + one stream paused 0.5 s = 1.0 s, against 4.4 s on P
        (4, 2.2, False),  # 0.5 s + 4 x 0.5 s = 2.5 s: the step moves off D (test_predicted_ttft's case)
        (0, 4.4, False),  # nothing stalled: local was not ruled out by the stall, nothing to add
    ],
)
def test_the_stall_budget_does_not_send_a_step_to_a_slower_option(streams, best_other_s, local_kept) -> None:
    step = SessionStep(**{**_fields(LOCKSTEP), "decode": DecodeState(kv_usage=0.01, running_streams=streams)})
    policy_pricer = pricer()
    if streams:
        assert not by_option(step)[Option.LOCAL].available  # the budget alone rules it out
    despite = policy_pricer.local_despite_stall(step, best_other_s)
    assert (despite is not None) is local_kept
    if despite is not None:
        assert despite.option is Option.LOCAL and despite.prefill_worker == "d0"
        assert despite.seconds == pytest.approx(0.5 + 0.5 * streams)
        assert f"with the stall on {streams} streams" in despite.why


def test_a_failed_guard_is_not_priced_away() -> None:
    full = SessionStep(**{**_fields(LOCKSTEP), "decode": DecodeState(kv_usage=0.95, running_streams=1)})
    assert pricer().local_despite_stall(full, 100.0) is None  # D's KV usage over the guard: never local


# A session's 1,500-token increment on the CPU fleet's scale: D prefills it in 60 ms (its
# streams' steps pause 40 ms each, within the 50 ms budget); P, holding the session's
# history, in 120 ms with the handoff.
INCREMENT = SessionStep(
    prompt_tokens=4_000,
    p=PrefillSite("p0", cached_tokens=2_500),
    d_name="d0",
    d_cached_tokens=2_500,
    decode=DecodeState(kv_usage=0.1, running_streams=0),
    last_p=PrefillSite("p0", cached_tokens=2_500),
    last_d_chosen=True,
    measured=MeasuredTimes(local_s=0.06, remote_s=0.12, local_stall_s=0.04),
)


@pytest.mark.parametrize(("streams", "stays_on_d"), [(0, True), (1, True), (4, False)])
def test_a_busy_d_sends_the_step_to_p(streams, stays_on_d) -> None:
    """Article section 9.2, option 5: local is good while D is lightly loaded, poor when D is
    full. Its price is its TTFT plus the stall on each of D's running streams (4 x 40 ms here)."""
    step = SessionStep(**{**_fields(INCREMENT), "decode": DecodeState(kv_usage=0.1, running_streams=streams)})
    prices = by_option(step)
    local = prices[Option.LOCAL]
    if streams < 4:
        assert local.seconds == pytest.approx(0.06 + 0.04 * streams)
    chosen = choose(tuple(prices.values()))
    assert (chosen.option is Option.LOCAL) is stays_on_d, chosen.explain()
    if not stays_on_d:
        assert chosen.prefill_worker == "p0" and local.seconds > 0.06 + 0.04 * streams - 1e-9
