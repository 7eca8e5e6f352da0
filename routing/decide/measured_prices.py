"""Every predicted TTFT the router builds, from the measured rates: a path's queue,
prefill, D's read of the KV it moves, D's first step and the path's own measured
overhead (:func:`kvpilot.routing.decide.rates.predict_ttft`), the terms the
``X-KVPilot-Predicted-TTFT`` header gives. :func:`predict_path` is the one place a
path's arguments are built; the candidates' prices, the local-vs-remote verdict, the
session options and each request's prediction all call it. Pure."""

from __future__ import annotations

import dataclasses

from kvpilot.policies.disaggregation import DecodeState, MeasuredTimes, PromptState
from kvpilot.policies.session_options import OptionPrice
from kvpilot.routing.decide.ledger import PromptLoads
from kvpilot.routing.decide.rates import RateEstimator, TTFTPrediction, predict_ttft
from kvpilot.routing.ids import WorkerId


def predict_path(
    rates: RateEstimator,
    prefiller: WorkerId,
    d: WorkerId,
    *,
    prompt_tokens: int,
    cached_tokens: int,
    queued_tokens: int,
    moved_tokens: int,
    streams: int,
) -> TTFTPrediction:
    """The TTFT of a prompt of ``prompt_tokens`` that ``prefiller`` (P, or D itself)
    prefills beyond its ``cached_tokens`` behind ``queued_tokens`` of prefill, after which
    D reads ``moved_tokens`` of KV (none when D prefilled) and runs its first step beside
    ``streams`` running ones."""
    return predict_ttft(
        rates,
        prefiller,
        d,
        new=prompt_tokens - cached_tokens,
        cached=cached_tokens,
        queued=queued_tokens,
        transfer_tokens=moved_tokens if prefiller != d else 0,
        streams=streams,
    )


def path_times(
    rates: RateEstimator, p: WorkerId, d: WorkerId, prompt: PromptState, decode: DecodeState
) -> MeasuredTimes:
    """The predicted TTFTs of the local prefill on ``d`` and of the remote path through ``p``
    (each term measured where it can be, else its prior), and the stall a local prefill
    imposes on D's running streams: its prefill beyond D's own step."""
    streams = decode.running_streams
    local = predict_path(
        rates,
        d,
        d,
        prompt_tokens=prompt.prompt_tokens,
        cached_tokens=prompt.d_cached_tokens,
        queued_tokens=0,
        moved_tokens=0,
        streams=streams,
    )
    remote = predict_path(
        rates,
        p,
        d,
        prompt_tokens=prompt.prompt_tokens,
        cached_tokens=prompt.p_cached_tokens,
        queued_tokens=prompt.p_queued_tokens,
        moved_tokens=prompt.effective_tokens,
        streams=streams,
    )
    return MeasuredTimes(local.seconds, remote.seconds, local.stall_s)


def option_price(
    rates: RateEstimator,
    price: OptionPrice,
    prompt_tokens: int,
    d: WorkerId,
    loads: PromptLoads,
    block_size: int,
    streams: int,
) -> OptionPrice:
    """``price`` (a session option for a step decoded on ``d``) with its seconds the predicted
    TTFT, its prefill queued behind its worker's active prefill blocks in ``loads``; as it is
    when the option is unavailable or prefills nowhere."""
    if not price.available or price.prefill_worker is None:
        return price
    worker = WorkerId(price.prefill_worker)
    predicted = predict_path(
        rates,
        worker,
        d,
        prompt_tokens=prompt_tokens,
        cached_tokens=prompt_tokens - price.prefill_tokens,
        queued_tokens=loads[worker].active_prefill_blocks * block_size,
        moved_tokens=price.moved_tokens,
        streams=streams,
    )
    seconds = predicted.seconds
    why = f"{price.why}; measured rates: TTFT {seconds * 1e3:.2f} ms"
    return dataclasses.replace(price, seconds=seconds, why=why)
