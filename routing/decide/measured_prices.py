"""The local-vs-remote verdict and the session options priced on the measured rates: each
path's predicted TTFT (queue, prefill, D's read of the KV it moves, D's first step and the
path's own measured overhead: :func:`kvpilot.routing.decide.rates.predict_ttft`), the terms
the ``X-KVPilot-Predicted-TTFT`` header gives. Pure."""

from __future__ import annotations

import dataclasses

from kvpilot.policies.disaggregation import DecodeState, MeasuredTimes, PromptState
from kvpilot.policies.session_options import OptionPrice
from kvpilot.routing.decide.ledger import PromptLoads
from kvpilot.routing.decide.rates import RateEstimator, predict_ttft
from kvpilot.routing.ids import WorkerId


def path_times(
    rates: RateEstimator, p: WorkerId, d: WorkerId, prompt: PromptState, decode: DecodeState
) -> MeasuredTimes:
    """The predicted TTFTs of the local prefill on ``d`` and of the remote path through ``p``
    (each term measured where it can be, else its prior), and the stall a local prefill
    imposes on D's running streams: its prefill beyond D's own step."""
    local = predict_ttft(
        rates,
        d,
        d,
        new=prompt.effective_tokens,
        cached=prompt.d_cached_tokens,
        queued=0,
        transfer_tokens=0,
        streams=decode.running_streams,
    )
    remote = predict_ttft(
        rates,
        p,
        d,
        new=prompt.prompt_tokens - prompt.p_cached_tokens,
        cached=prompt.p_cached_tokens,
        queued=prompt.p_queued_tokens,
        transfer_tokens=prompt.effective_tokens,
        streams=decode.running_streams,
    )
    stall = max(0.0, local.prefill_s - local.first_step.seconds)  # the streams' own step runs anyway
    return MeasuredTimes(local.seconds, remote.seconds, stall)


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
    predicted = predict_ttft(
        rates,
        worker,
        d,
        new=price.prefill_tokens,
        cached=prompt_tokens - price.prefill_tokens,
        queued=loads[worker].active_prefill_blocks * block_size,
        transfer_tokens=price.moved_tokens if worker != d else 0,
        streams=streams,
    )
    seconds = predicted.seconds
    why = f"{price.why}; measured rates: TTFT {seconds * 1e3:.2f} ms"
    return dataclasses.replace(price, seconds=seconds, why=why)
