"""One price per path: what a predicted TTFT reads (:class:`PathInputs`), built in one
place (:meth:`FleetLoad.path`), priced by one function (:func:`predict_path`: a path's
queue, prefill, D's read of the KV it moves, D's first step and the path's own measured
overhead, :func:`kvpilot.routing.decide.rates.predict_ttft`, the terms the
``X-KVPilot-Predicted-TTFT-Ms`` header gives). The candidates' prices, the
local-vs-remote verdict, the session options, each request's prediction (the header,
the TTFT SLO, ``/debug/route``) and a failed prefill's recovery all price through these
two, so on one state they give one number. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.policies.disaggregation import MeasuredTimes
from kvpilot.policies.session_options import OptionPrice
from kvpilot.routing.decide.ledger import PromptLoads
from kvpilot.routing.decide.rates import RateEstimator, TTFTPrediction, predict_ttft
from kvpilot.routing.ids import WorkerId


@dataclass(frozen=True, slots=True)
class PathInputs:
    """What one path's predicted TTFT reads: ``prefiller`` (P, or D itself) prefills
    ``prompt_tokens`` beyond its ``cached_tokens`` behind ``queued_tokens`` of prefill,
    after which ``d`` reads ``moved_tokens`` of KV (0 when D prefilled) and runs its first
    step beside ``streams`` running requests."""

    prefiller: WorkerId
    d: WorkerId
    prompt_tokens: int
    cached_tokens: int
    queued_tokens: int
    moved_tokens: int
    streams: int


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """The workers' load as a price reads it, at one moment (a decision, a dispatch, a
    recovery): ``booked``, the router's own ledger
    (:class:`~kvpilot.routing.decide.ledger.LoadLedger`); ``unbooked_streams(d)``, the
    requests D's own gauge counted beyond this router's when it was last read (traffic
    that bypassed this router: another replica's, direct clients'; 0 without gauges:
    :meth:`kvpilot.routing.decide.router.Router.fleet_load`); ``block_size``, the index's."""

    booked: PromptLoads
    unbooked_streams: Callable[[WorkerId], int]
    block_size: int

    def streams(self, d: WorkerId) -> int:
        """D's running requests: the ledger's, plus those D's gauge reported beyond them."""
        return self.booked[d].active_requests + self.unbooked_streams(d)

    def path(
        self, prefiller: WorkerId, d: WorkerId, prompt_tokens: int, *, cached_tokens: int, moved_tokens: int
    ) -> PathInputs:
        """The one place a path's inputs are built. From the caller: ``prefiller`` and ``d``
        (the route's or the option's), ``cached_tokens`` (the prefiller's GPU prefix by the
        index's KV events, or what an option loads into it first; at most the prompt) and
        ``moved_tokens`` (the KV D lacks, plus what an option loads into P; none when D
        prefills). From this load: the prefiller's queue (its active prefill blocks in the
        ledger) and D's running requests (:meth:`streams`)."""
        return PathInputs(
            prefiller,
            d,
            prompt_tokens,
            min(prompt_tokens, cached_tokens),
            self.booked[prefiller].active_prefill_blocks * self.block_size,
            moved_tokens if prefiller != d else 0,
            self.streams(d),
        )

    def cache_path(
        self, prefiller: WorkerId, d: WorkerId, prompt_tokens: int, *, prefiller_blocks: int, d_blocks: int
    ) -> PathInputs:
        """:meth:`path` where ``prefiller`` prefills what its GPU cache lacks (it holds the
        prompt's leading ``prefiller_blocks``) and D reads what its own lacks (``d_blocks``):
        a candidate, either side of the local-vs-remote verdict, a route that took no
        session option."""
        bs = self.block_size
        d_cached = min(prompt_tokens, d_blocks * bs)
        return self.path(
            prefiller, d, prompt_tokens, cached_tokens=prefiller_blocks * bs, moved_tokens=prompt_tokens - d_cached
        )


def predict_path(rates: RateEstimator, path: PathInputs) -> TTFTPrediction:
    """The one price of a path: its predicted TTFT, each term measured where it can be, else its prior."""
    return predict_ttft(
        rates,
        path.prefiller,
        path.d,
        new=path.prompt_tokens - path.cached_tokens,
        cached=path.cached_tokens,
        queued=path.queued_tokens,
        transfer_tokens=path.moved_tokens,
        streams=path.streams,
    )


def path_times(rates: RateEstimator, local: PathInputs, remote: PathInputs) -> MeasuredTimes:
    """The predicted TTFTs of the ``local`` prefill on D and of the ``remote`` path through
    P, and the stall a local prefill imposes on D's running streams: its prefill beyond
    D's own step."""
    local_s = predict_path(rates, local)
    return MeasuredTimes(local_s.seconds, predict_path(rates, remote).seconds, local_s.stall_s)


def option_path(load: FleetLoad, price: OptionPrice, prompt_tokens: int, d: WorkerId) -> PathInputs | None:
    """The path of ``price``, a session option for a step decoded on ``d``: its worker
    prefills its ``prefill_tokens`` after the rest of the prompt, and a remote one moves
    its ``moved_tokens`` into D. ``None`` for an option that is unavailable or prefills nowhere."""
    if not price.available or price.prefill_worker is None:
        return None
    return load.path(
        WorkerId(price.prefill_worker),
        d,
        prompt_tokens,
        cached_tokens=prompt_tokens - price.prefill_tokens,
        moved_tokens=price.moved_tokens,
    )


def option_price(rates: RateEstimator, price: OptionPrice, path: PathInputs | None) -> OptionPrice:
    """``price`` with its seconds its ``path``'s predicted TTFT (:func:`option_path`); as it
    is without one."""
    if path is None:
        return price
    seconds = predict_path(rates, path).seconds
    why = f"{price.why}; measured rates: TTFT {seconds * 1e3:.2f} ms"
    return dataclasses.replace(price, seconds=seconds, why=why)
