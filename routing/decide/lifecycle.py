"""One request's life, booked: the state machine every front drives. No I/O; the
caller passes the clock (:class:`Clock`).

A routed request (:class:`~kvpilot.routing.decide.router.Route`) goes::

    dispatch ──> [remote prefill] ──> prefilled ──────────────┐
       │              └─> prefill_failed ──> OTHER_PREFILL ───┤ (P again, once)
       │                         ├─────────> LOCAL (fallback) ┤
       │                         └─────────> FAIL ──> failed  │
       └──> [local prefill, co-located] ───────────────────> first_token ──> finished
                                                               (or decode_failed)

:class:`Lifecycle` owns every booking of it: the load ledger (dispatch, end of prefill,
a prefill moved to another worker, completion), the session's owner (its client, for
``sessions.max_sessions_per_client``: :meth:`Lifecycle.claim_session`), its new state and
D's offer (:meth:`~kvpilot.routing.decide.router.Router.served`, only for an answered
request: a broken stream does not pin the session to its D), each worker's circuit (a half-open
circuit's single probe included), each pair's health, D's jitter budget, the KV events
the prefilling worker must publish, and the rates it learns from (P's prefill, each
path's overhead). Its methods return outcomes as data (:class:`CircuitChange`, the
prediction ratios); the fronts record metrics and logs from them.

The live fronts, the relay (:mod:`kvpilot.routing.serve.proxy`) and Envoy's endpoint picker
(:mod:`kvpilot.routing.gateway.picker`), call it through one request driver
(:mod:`kvpilot.routing.serve.driver`); they and the fleet simulator
(``benchmarks/sim/kvpilot.py``) hold no booking of their own.

Every predicted TTFT is built and priced as the router's own prices are
(:mod:`~kvpilot.routing.decide.measured_prices`, on the router's
:meth:`~kvpilot.routing.decide.router.Router.fleet_load`), so a route's prediction (the
header, the TTFT SLO, ``/debug/route``) is the price the router chose it by on the same state.
A failed prefill is decided by :func:`kvpilot.policies.failure.recover` on those
predictions: another prefill worker, D itself within its jitter budget, or a fast error.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvpilot.policies.failure import (
    KVPILOT_DEFAULT,
    FailurePolicyConfig,
    JitterWindow,
    Recovery,
    RecoveryCosts,
    RecoveryDecision,
    recover,
)
from kvpilot.policies.session_hold import HoldDecision
from kvpilot.policies.session_options import OptionPrice
from kvpilot.routing.config import Worker
from kvpilot.routing.decide.measured_prices import PathInputs, option_path, predict_path
from kvpilot.routing.decide.rates import PrefillPath, RateEstimator, TTFTPrediction
from kvpilot.routing.decide.router import Kind, Route, Router
from kvpilot.routing.decide.sessions import OfferUse
from kvpilot.routing.ids import SessionId, WorkerId

MAX_PREFILL_ATTEMPTS = 2
"""P's prefill is tried on at most this many prefill workers before D or an error takes over."""


class Clock(NamedTuple):
    """``monotonic`` times circuits, pair health, KV-event watches and jitter; ``wall``
    (Unix seconds) dates sessions and their offers. The simulator passes its virtual time."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


REAL_TIME = Clock()
"""The live fronts' clock."""


class InFlight(ValueError):
    """A request id already in flight."""


class Phase(str, enum.Enum):
    """Where a request is in its life."""

    PREFILLING = "prefilling"  # dispatched; its prefill (on P, or on D within D's call) runs
    DECODING = "decoding"  # its prefill is over (P answered, or D's first token came)
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class CircuitChange:
    """A worker's circuit ``opened`` (for ``open_s`` seconds) or closed."""

    worker: WorkerId
    opened: bool
    open_s: float


@dataclass(slots=True)
class Ticket:
    """One request in flight. ``route`` is where it goes now (its prefill worker may
    change after a failure); ``kind`` how it is served (a remote prefill whose P failed
    is :attr:`~kvpilot.routing.decide.router.Kind.FALLBACK`); ``prefilled_on`` the worker that
    prefills; ``offer`` D's offer of the session's KV that P pulls with (``None``: P
    prefills with a fresh handoff request); ``deferred``: P prefills within D's call."""

    route: Route
    session: SessionId | None
    kind: Kind
    prefilled_on: WorkerId
    prediction: TTFTPrediction | None
    offer: dict[str, Any] | None
    offer_use: OfferUse
    phase: Phase = Phase.PREFILLING
    deferred: bool = False
    prefill_attempts: int = 0
    tried_prefill: set[WorkerId] = dataclasses.field(default_factory=set)
    probes: set[WorkerId] = dataclasses.field(default_factory=set)
    refused_by: WorkerId | None = None
    """The prefill worker that answered 4xx to this request's body, if one did."""
    hold: HoldDecision | None = None
    """Whether D holds the step's KV for the session's next step (``None``: no session, or
    vLLM's own hold): P's handoff carries it to D (:func:`~kvpilot.kvconnectors.pull_params.with_hold`)."""

    @property
    def request_id(self) -> str:
        return self.route.request_id

    @property
    def fell_back(self) -> bool:
        return self.kind is Kind.FALLBACK


@dataclass(frozen=True, slots=True)
class PrefillFailed:
    """What a failed prefill led to: ``decision`` (another P, D, or an error), the circuit it
    changed, and for :attr:`~kvpilot.policies.failure.Recovery.OTHER_PREFILL` the new prefill worker."""

    decision: RecoveryDecision
    circuit: CircuitChange | None
    next_prefill: Worker | None = None


@dataclass(frozen=True, slots=True)
class Ended:
    """A request's end: the circuit it closed or opened, and whether the session's state changed
    (the shared session store then writes it)."""

    circuit: CircuitChange | None
    session_changed: bool


class Lifecycle:
    """Books requests through their life (see the module doc) on ``router`` (its index,
    ledger and sessions, which it and the router's event loop alone change) and the router's
    :class:`~kvpilot.routing.health.view.FleetHealth` (circuits, pair health, the KV-event
    watch). ``rates``: predicts each route's TTFT and learns P's prefill and each path's
    overhead; ``None`` predicts nothing. ``prefills_timed_here``: the engines' own prefill
    timings are not read, so a prefill that ends at D's first token (D's own, or P's within
    D's call) is timed by it when nothing was queued ahead of it. Not thread-safe: one event
    loop drives it. Raises ValueError for a router without health records."""

    def __init__(
        self,
        router: Router,
        *,
        rates: RateEstimator | None = None,
        prefills_timed_here: bool = False,
        failure: FailurePolicyConfig = KVPILOT_DEFAULT,
        clock: Clock = REAL_TIME,
    ) -> None:
        if router.health is None:
            raise ValueError("the lifecycle books the router's health records: build the Router with health=")
        self.router = router
        self.health = router.health
        self.rates = rates
        self.prefills_timed_here = prefills_timed_here
        self.failure = failure
        self.clock = clock
        self.jitter = JitterWindow()
        self._ledger = router.ledger

    # ---- predictions ------------------------------------------------------------
    def predict(self, route: Route) -> TTFTPrediction | None:
        """``route``'s predicted TTFT on the load now (``None`` without rates): the session
        option it took (:meth:`predict_option`), else its prefilling worker prefilling what
        its GPU cache lacks, and D reading what D lacks (nothing for a local prefill). Before
        :meth:`dispatch` books it, on the state it was routed on, this is the price the router
        chose it by (a local option taken despite its stall: without the stall)."""
        chosen = next((price for price in route.options if price.option is route.option), None)
        if chosen is not None and chosen.prefill_worker == route.prefill_worker.name:
            return self.predict_option(route, chosen)
        d = route.decode.name
        load = self.router.fleet_load()
        return self._predict(
            load.cache_path(
                route.prefill_worker.name,
                d,
                route.prompt_tokens,
                prefiller_blocks=route.cached_blocks,
                d_blocks=route.decode_cached_blocks,
            )
        )

    def predict_option(self, route: Route, price: OptionPrice) -> TTFTPrediction | None:
        """A session option's predicted TTFT on the load now, as the router priced it
        (``None`` for an unavailable option, or without rates)."""
        path = option_path(self.router.fleet_load(), price, route.prompt_tokens, route.decode.name)
        return None if path is None else self._predict(path)

    def _predict(self, path: PathInputs) -> TTFTPrediction | None:
        return None if self.rates is None else predict_path(self.rates, path)

    @property
    def _block_size(self) -> int:
        return self.router.index.block_size

    def _cached_tokens(self, route: Route) -> int:
        """The prompt tokens ``route``'s prefilling worker holds (its GPU prefix, at most the prompt)."""
        return min(route.prompt_tokens, route.cached_blocks * self._block_size)

    def prefill_timeout_s(self, ticket: Ticket, floor_s: float) -> float:
        """How long to wait for P: ``floor_s``, or k x its predicted queue and prefill if longer."""
        return floor_s if ticket.prediction is None else ticket.prediction.prefill_timeout_s(floor_s)

    # ---- the life ---------------------------------------------------------------
    def claim_session(self, session: SessionId | None, client: str) -> None:
        """``client`` (the requester's address as the front sees it) owns ``session``: past
        ``sessions.max_sessions_per_client`` the client's least recently claimed session is
        dropped, never another client's (:meth:`~kvpilot.routing.decide.sessions.SessionStore.claim`).
        A no-op without a session."""
        if session is not None:
            self.router.sessions.claim(session, client)

    def dispatch(self, route: Route, session: SessionId | None, *, parallel_samples: bool = False) -> Ticket:
        """Book ``route`` as sent: the ledger, the half-open probes, the pair's use, and
        the session's offer (taken once: P pulls with it when ``route`` chose ``pull``).
        A remote prefill of a request for several samples is moved to D (vLLM would fan
        its samples out into requests that each read P's one handoff). Raises
        :class:`InFlight` for a request id already in flight."""
        rid, d = route.request_id, route.decode.name
        prediction = self.predict(route)
        try:
            self._ledger.dispatch(rid, route.prefill_worker.name, d, route.chain, route.cached_blocks)
        except ValueError:
            raise InFlight(f"X-Request-Id {rid!r} is already in flight") from None
        wall = self.clock.wall()
        offer, use = self.router.take_session_offer(session, route, wall)
        hold = self.router.hold(session, route, wall)
        kind, prefiller = route.kind, route.prefill_worker.name
        if route.prefill is not None and parallel_samples:
            self._ledger.move_prefill(rid, d, route.decode_cached_blocks)
            kind, prefiller = Kind.LOCAL_PREFILL, d
        offered = None if offer is None else dict(offer.params)
        ticket = Ticket(route, session, kind, prefiller, prediction, offered, use, hold=hold)
        now = self.clock.monotonic()
        if kind is Kind.REMOTE_PREFILL:
            assert route.prefill is not None
            self.health.pair_health.routed(route.prefill.name, d, now)
            ticket.tried_prefill.add(route.prefill.name)
        elif kind is Kind.LOCAL_PREFILL:
            self._charge_stall(route, now)
        for worker in {prefiller, d}:
            if self.health.breaker.dispatched(worker, now):
                ticket.probes.add(worker)
        return ticket

    def prefilled(
        self, ticket: Ticket, elapsed_s: float, *, deferred: bool
    ) -> tuple[CircuitChange | None, float | None]:
        """P answered with D's handoff after ``elapsed_s``: its circuit's success, and, unless
        P prefills within D's call (``deferred``), the end of its prefill and what its time
        teaches (not a pull's: a pull is not a prefill). Returns the circuit change and the
        observed over predicted prefill (``None``: nothing predicted, or deferred)."""
        route = ticket.route
        assert route.prefill is not None
        if deferred:  # P prefills within D's call: its prefill ends at D's first token
            ticket.deferred = True
            return None, None
        change = self._answered(ticket, route.prefill)
        self._ledger.first_token(ticket.request_id)
        ticket.phase = Phase.DECODING
        prediction = ticket.prediction
        ratio = elapsed_s / prediction.prefill_s if prediction is not None and prediction.prefill_s > 0 else None
        if self.rates is not None and ticket.offer is None:
            self._learn_prefill(route, elapsed_s)
        return change, ratio

    def prefill_failed(self, ticket: Ticket, *, engine_fault: bool, refused: bool = False) -> PrefillFailed:
        """P's prefill gave D nothing (``engine_fault``: P's fault, counted against its circuit
        and the pair). Decides live (:func:`~kvpilot.policies.failure.recover`) between
        another prefill worker (once), D prefilling (the request becomes a fallback) and
        a fast error, and books it. ``refused``: P answered 4xx to the client's own body;
        D is asked as it is (another P would refuse it alike; D's answer is the engine's
        verdict on it, a 4xx the client gets as vLLM gives it)."""
        route = ticket.route
        p, d = route.prefill, route.decode
        assert p is not None
        now = self.clock.monotonic()
        ticket.prefill_attempts += 1
        change = None
        if engine_fault:
            change = self._failed(ticket, p, now)
            self.health.pair_health.failed(p.name, d.name, now)
        else:
            self._release(ticket, p.name)
        other: Worker | None = None
        if refused:
            ticket.refused_by = p.name
            decision = RecoveryDecision(
                Recovery.LOCAL, "P refused the request's body: D answers it as the engine would"
            )
        else:
            other, other_s = (
                self._other_prefill(ticket) if ticket.prefill_attempts < MAX_PREFILL_ATTEMPTS else (None, None)
            )
            decision = recover(self._recovery_costs(route, other_s, now), self.failure)
        if decision.action is Recovery.OTHER_PREFILL:
            assert other is not None  # recover() offers it only when there is one
            gpu = self.router.gpu_overlap(route.match, other.name)
            ticket.route = dataclasses.replace(route, prefill=other, cached_blocks=gpu)
            ticket.tried_prefill.add(other.name)
            ticket.prefilled_on = other.name
            self._ledger.move_prefill(ticket.request_id, other.name, gpu)
            self.health.pair_health.routed(other.name, d.name, now)
            if self.health.breaker.dispatched(other.name, now):
                ticket.probes.add(other.name)
            return PrefillFailed(decision, change, other)
        if decision.action is Recovery.LOCAL:
            ticket.kind, ticket.prefilled_on = Kind.FALLBACK, d.name
            self._ledger.move_prefill(ticket.request_id, d.name, route.decode_cached_blocks)
            self._charge_stall(route, now)
            return PrefillFailed(decision, change)
        return PrefillFailed(decision, change)

    def _other_prefill(self, ticket: Ticket) -> tuple[Worker | None, float | None]:
        """The prefill worker not yet tried whose circuit allows it and whose predicted TTFT
        is lowest, with that TTFT (the first such, priced 0, without rates); ``(None, None)``
        when there is none."""
        now = self.clock.monotonic()
        candidates = [
            w
            for w in self.router.fleet.prefill
            if w.name not in ticket.tried_prefill and self.health.breaker.allows(w.name, now)
        ]
        if not candidates:
            return None, None
        priced = [(self._remote_s(ticket.route, w), i) for i, w in enumerate(candidates)]
        seconds, best = min(priced)
        return candidates[best], seconds

    def _remote_s(self, route: Route, p: Worker) -> float:
        """``route`` prefilled on ``p`` instead: its predicted TTFT (0 without rates)."""
        path = self.router.fleet_load().cache_path(
            p.name,
            route.decode.name,
            route.prompt_tokens,
            prefiller_blocks=self.router.gpu_overlap(route.match, p.name),
            d_blocks=route.decode_cached_blocks,
        )
        predicted = self._predict(path)
        return predicted.seconds if predicted is not None else 0.0

    def _local(self, route: Route) -> tuple[TTFTPrediction | None, int]:
        """``route`` prefilled on D itself: its prediction (``None`` without rates) and D's
        other running streams, which its prefill pauses (this request is booked on D too;
        D's gauge adds those that bypassed this router)."""
        d, blocks = route.decode.name, route.decode_cached_blocks
        path = self.router.fleet_load().cache_path(d, d, route.prompt_tokens, prefiller_blocks=blocks, d_blocks=blocks)
        return self._predict(path), max(0, path.streams - 1)

    def _recovery_costs(self, route: Route, other_s: float | None, now: float) -> RecoveryCosts:
        local, streams = self._local(route)
        if local is None:  # nothing predicted: D serves it unless another P can
            return RecoveryCosts(0.0, 0.0, 0, other_s)
        return RecoveryCosts(local.seconds, local.stall_s, streams, other_s, self.jitter.spent(route.decode.name, now))

    def _charge_stall(self, route: Route, now: float) -> None:
        """D prefills ``route`` beside its running streams: their pause goes on D's jitter budget."""
        local, streams = self._local(route)
        if local is not None and streams:
            self.jitter.charge(route.decode.name, local.stall_s * streams, now)

    def first_token(self, ticket: Ticket, since_sent_s: float, ttft_s: float) -> float | None:
        """D's first token came ``since_sent_s`` after D's request was sent and ``ttft_s``
        after the request arrived: the ledger's end of prefill, the prefill timed by it
        (:attr:`prefills_timed_here`) and the path's overhead, unless D fell back to
        prefilling. Returns the observed over predicted TTFT (``None``: nothing predicted)."""
        prediction, route = ticket.prediction, ticket.route
        if prediction is not None and self.rates is not None and not ticket.fell_back:
            timed_here = route.prefill is None or ticket.deferred
            if self.prefills_timed_here and prediction.queue.seconds == 0 and timed_here:
                self._learn_prefill(route, since_sent_s)
            if prediction.modelled_measured:
                path = PrefillPath.LOCAL if route.prefill is None else PrefillPath.REMOTE
                self.rates.observe_overhead(route.decode.name, path, ttft_s - prediction.modelled_s)
        self._ledger.first_token(ticket.request_id)
        ticket.phase = Phase.DECODING
        return ttft_s / prediction.seconds if prediction is not None and prediction.seconds > 0 else None

    def prefill_over(self, ticket: Ticket) -> None:
        """The request's prefill is over, untimed: a front that does not see D's first token
        (Envoy streams it; the picker takes it at the predicted TTFT), or the simulator at its
        simulated prefill's end. D's load counts it as decoding from then."""
        if ticket.phase is Phase.PREFILLING:
            self._ledger.first_token(ticket.request_id)
            ticket.phase = Phase.DECODING

    def finished(self, ticket: Ticket, *, answered: bool, decode_params: object = None) -> Ended:
        """The request ended. ``answered``: D's answer reached the client whole; then the
        session lives on D (its state, D's offer in ``decode_params``), D's circuit
        succeeds and the prefilling worker must publish the blocks it lacked. A request that
        was not answered (a broken stream, the client gone) books no session step: the
        session stays where its last answered step left it."""
        change, session_changed = None, False
        if answered:
            self.router.served(ticket.session, ticket.route, decode_params, now=self.clock.wall())
            session_changed = ticket.session is not None
            change = self._answered(ticket, ticket.route.decode)
            self._expect_events(ticket)
        self._end(ticket)
        return Ended(change, session_changed)

    def decode_failed(self, ticket: Ticket, *, engine_fault: bool) -> CircuitChange | None:
        """D failed the request (``engine_fault``: no answer, a 5xx, a broken stream; not the
        client's 4xx): D's circuit, and the request's end."""
        change = self._failed(ticket, ticket.route.decode, self.clock.monotonic()) if engine_fault else None
        self._end(ticket)
        return change

    def failed(self, ticket: Ticket) -> None:
        """The request ends without D's call (its prefill failed past recovery, or D's
        destination could not be built)."""
        self._end(ticket)

    def _end(self, ticket: Ticket) -> None:
        if ticket.phase is Phase.ENDED:
            return
        ticket.phase = Phase.ENDED
        self._ledger.complete(ticket.request_id)
        for worker in ticket.probes:
            self.health.breaker.released(worker)
        ticket.probes.clear()

    # ---- circuits, events, learning ------------------------------------------------
    def _answered(self, ticket: Ticket, worker: Worker) -> CircuitChange | None:
        ticket.probes.discard(worker.name)
        if self.health.breaker.succeeded(worker.name):
            return CircuitChange(worker.name, False, self.health.breaker.open_s)
        return None

    def _failed(self, ticket: Ticket, worker: Worker, now: float) -> CircuitChange | None:
        ticket.probes.discard(worker.name)
        if self.health.breaker.failed(worker.name, now):
            return CircuitChange(worker.name, True, self.health.breaker.open_s)
        return None

    def _release(self, ticket: Ticket, worker: WorkerId) -> None:
        if worker in ticket.probes:
            ticket.probes.discard(worker)
            self.health.breaker.released(worker)

    def _learn_prefill(self, route: Route, seconds: float) -> None:
        """``route``'s prefilling worker took ``seconds`` for its uncached tokens."""
        assert self.rates is not None
        cached = self._cached_tokens(route)
        self.rates.observe_prefill(route.prefill_worker.name, route.prompt_tokens - cached, cached, seconds)

    def _expect_events(self, ticket: Ticket) -> None:
        """The prefilling worker served the prompt; blocks it did not hold must show up as events."""
        if not self.health.event_watch.enabled:
            return
        route, prefilled_on = ticket.route, ticket.prefilled_on
        cached = route.cached_blocks if prefilled_on == route.prefill_worker.name else route.decode_cached_blocks
        batches = self.health.event_batches()
        if route.prompt_blocks > cached and prefilled_on in batches:
            self.health.event_watch.expect(prefilled_on, batches[prefilled_on], self.clock.monotonic())
