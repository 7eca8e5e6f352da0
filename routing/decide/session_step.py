"""The prices the router reads for a chosen (P, D): each path's inputs from the cache it
holds (:func:`cache_path`), both paths' predicted TTFTs (:func:`measured_times`), the
roofline policy's view of P and D (:func:`policy_inputs`), and, for a session's later
step, the article's five options priced (:func:`price_session_step`). Each reads one
:class:`~kvpilot.routing.decide.measured_prices.FleetLoad`, so on one state they give one
number. Pure: nothing here advances any state."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence, Set

from kvpilot.kvconnectors.pull_params import LEASE_MARGIN_S
from kvpilot.policies.disaggregation import DecodeState, MeasuredTimes, PromptState
from kvpilot.policies.session_options import Option, OptionPrice, PrefillSite, SessionOptionPricer, SessionStep
from kvpilot.routing.config import Worker
from kvpilot.routing.decide.cost import TierOverlap
from kvpilot.routing.decide.measured_prices import FleetLoad, PathInputs, option_path, option_price, path_times
from kvpilot.routing.decide.rates import RateEstimator
from kvpilot.routing.decide.sessions import SessionState
from kvpilot.routing.ids import WorkerId


def cache_path(
    load: FleetLoad, prefiller: Worker, d: Worker, prompt_tokens: int, overlaps: Mapping[WorkerId, TierOverlap]
) -> PathInputs:
    """``prefiller`` prefilling for ``d`` beyond its GPU prefix (:meth:`FleetLoad.cache_path`)."""
    return load.cache_path(
        prefiller.name,
        d.name,
        prompt_tokens,
        prefiller_blocks=overlaps[prefiller.name].gpu,
        d_blocks=overlaps[d.name].gpu,
    )


def measured_times(
    rates: RateEstimator | None,
    load: FleetLoad,
    p: Worker,
    d: Worker,
    prompt_tokens: int,
    overlaps: Mapping[WorkerId, TierOverlap],
) -> MeasuredTimes | None:
    """Both paths' predicted TTFTs on the measured rates (:func:`path_times`): D prefilling,
    and P prefilling for D; ``None`` while the rates are off (``rates`` is ``None``)."""
    if rates is None:
        return None
    local = cache_path(load, d, d, prompt_tokens, overlaps)
    return path_times(rates, local, cache_path(load, p, d, prompt_tokens, overlaps))


def policy_inputs(
    load: FleetLoad,
    p: Worker,
    d: Worker,
    prompt_tokens: int,
    overlaps: Mapping[WorkerId, TierOverlap],
    kv_usage: float,
) -> tuple[PromptState, DecodeState]:
    """The roofline policy's view of P and D, read from the same :class:`FleetLoad` as the
    measured prices; ``kv_usage`` is D's (:meth:`~kvpilot.routing.decide.router.Router.kv_usage`)."""
    bs = load.block_size
    prompt = PromptState(
        prompt_tokens=prompt_tokens,
        d_cached_tokens=min(prompt_tokens, overlaps[d.name].gpu * bs),
        p_cached_tokens=min(prompt_tokens, overlaps[p.name].gpu * bs),
        p_queued_tokens=load.booked[p.name].active_prefill_blocks * bs,
    )
    return prompt, DecodeState(kv_usage=kv_usage, running_streams=load.streams(d.name))


def price_session_step(
    pricer: SessionOptionPricer,
    rates: RateEstimator | None,
    load: FleetLoad,
    p: Worker,
    d: Worker,
    prompt_tokens: int,
    overlaps: Mapping[WorkerId, TierOverlap],
    *,
    state: SessionState,
    reused_tokens: int,
    now: float | None,
    barred: Set[WorkerId],
    prefill_workers: Sequence[Worker],
    fleet_workers: Container[WorkerId],
    kv_usage: float,
) -> tuple[OptionPrice, ...]:
    """The five options for a session's later step, with (P, D) the cost model's pair
    (a worker in ``barred`` is not available for any); ``prefill_workers`` and
    ``fleet_workers`` are the fleet's (a session's last P, or its offer's holder, that
    left is not offered), ``kv_usage`` D's.

    D's offer covers the prompt as far as the index says its holder caches it, or
    at least the ``reused_tokens`` it shares with the last prompt (whose KV the
    holder kept), within the blocks offered. With ``rates``, each option is priced on
    the measured rates (:func:`option_price`)."""
    bs = load.block_size

    def site(worker: Worker) -> PrefillSite:
        cached = min(prompt_tokens, overlaps[worker.name].gpu * bs)
        queued = load.booked[worker.name].active_prefill_blocks * bs
        return PrefillSite(worker.name, cached, queued, worker.name not in barred)

    chosen_p = site(p)
    last_p = next((w for w in prefill_workers if w.name == state.last_prefill), None)  # None: it left
    offer_tokens = time_left = None
    offer = state.offer
    if offer is not None and offer.holder not in barred and offer.holder in fleet_workers:
        held = max(overlaps[offer.holder].gpu * bs, reused_tokens // bs * bs)
        offer_tokens = min(prompt_tokens, held, offer.blocks * bs)
        if offer.expires_at is not None and now is not None:
            time_left = offer.expires_at - now
    prompt, decode = policy_inputs(load, p, d, prompt_tokens, overlaps, kv_usage)
    step = SessionStep(
        prompt_tokens=prompt_tokens,
        p=chosen_p if chosen_p.available else None,
        d_name=d.name,
        d_cached_tokens=prompt.d_cached_tokens,
        decode=decode,
        last_p=site(last_p) if last_p is not None else None,
        last_d_chosen=d.name == state.last_worker,
        offer_tokens=offer_tokens,
        offer_time_left_s=time_left,
        offer_margin_s=LEASE_MARGIN_S,
        shared_tokens=min(prompt_tokens, overlaps[p.name].shared * bs),
        measured=measured_times(rates, load, p, d, prompt_tokens, overlaps),
    )
    priced = pricer.price(step)
    prices = (
        priced
        if rates is None
        else tuple(option_price(rates, price, option_path(load, price, prompt_tokens, d.name)) for price in priced)
    )
    local = next(price for price in prices if price.option is Option.LOCAL)
    others = [price.seconds for price in prices if price.available]
    if local.available or not others:
        return prices
    despite = pricer.local_despite_stall(step, min(others))  # measured, with the stall priced in
    return prices if despite is None else tuple(despite if price is local else price for price in prices)
