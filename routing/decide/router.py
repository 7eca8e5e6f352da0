"""The routing decision: token ids in, a :class:`Route` out. No I/O, no clock.

For one request the :class:`Router`:

1. names the prompt's blocks: a fresh :class:`~kvpilot.routing.index.chain.PromptChain`, or
   the session's incremental one (:class:`~kvpilot.routing.decide.sessions.SessionStore`), so a
   session's next step names only its new blocks;
2. matches it in the index (:class:`~kvpilot.routing.index.kvindex.KVIndex`: per worker, per tier);
3. builds the candidates' cost columns (:class:`~kvpilot.routing.decide.cost.CandidateTable`),
   one row per (P, D) pair and per co-located worker, from the sparse per-worker
   overlaps and loads (a large fleet's idle workers cost one array fill). A pair
   is named ``"P->D"``; it is credited with P's overlap (P prefills), loaded with
   P's active prefill blocks and D's decode blocks and requests, earns the session credit if D served the session
   last (after a step the newest KV lives on D, article section 9.2), and is
   charged its recent transfer failures and transfer time (``pair_penalty``); a session's
   first step (and a request of no session) is charged the blocks of the sessions living on
   D and, for a pair, on P (:mod:`~kvpilot.routing.decide.residency`: placed for its later
   steps, which prefill on P where D does not);
4. asks :class:`~kvpilot.routing.decide.cost.CostModel` to pick one (seeded RNG; a
   session's later step stays on its worker unless another starts it sooner:
   :func:`~kvpilot.routing.decide.cost.eligible`);
5. for a pair, asks ``kvpilot.policies.disaggregation`` whether to prefill locally on D
   (D's cached prefix, P's cached prefix and queue, D's KV usage from the
   ledger or D's own ``/metrics``, the larger, and D's running streams: the ledger's
   plus those D's ``/metrics`` counts beyond them) or remotely on P (conditional
   disaggregation, article section 7);
6. for a session's later step on a pair, prices the article's five options
   instead (:mod:`kvpilot.policies.session_options`: re-prefill on P, pull D's offer
   into P, the last P and D again, a shared tier, local on D) and takes the
   cheapest, or the one ``sessions.force_option`` names while it is available.

:meth:`Router.route` does not touch the :class:`~kvpilot.routing.decide.ledger.LoadLedger`; the
caller dispatches (:meth:`Route.prefill_worker` and :attr:`Route.cached_blocks`
say what to count) and records the session's decode worker with
:meth:`Router.served` once the request succeeded. Not thread-safe: the thread
that owns the index (the router's event loop) makes every call.

What it returns is :mod:`~kvpilot.routing.decide.route`'s (``Route``, ``Kind``,
``NoHealthyWorker``, imported here too); the candidates' rows are
:mod:`~kvpilot.routing.decide.candidate_rows`'s, the prices it reads for a chosen pair
:mod:`~kvpilot.routing.decide.session_step`'s, and what it builds from the config
:mod:`~kvpilot.routing.decide.from_config`'s (``policy_from_config``, imported here too).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING

import numpy as np

from kvpilot.kvconnectors.pull_params import LEASE_MARGIN_S
from kvpilot.policies.disaggregation import LocalVsRemotePolicy, Where
from kvpilot.policies.session_hold import HoldDecision, decide_hold
from kvpilot.policies.session_options import Option, OptionPrice, SessionOptionPricer, choose
from kvpilot.routing.config import CostObjective, HoldMode, RouterConfig, TierClass, Worker
from kvpilot.routing.decide.candidate_rows import CandidateRows
from kvpilot.routing.decide.cost import CandidateTable, CostModel, TierOverlap, tier_overlap
from kvpilot.routing.decide.from_config import effective_cost, policy_from_config
from kvpilot.routing.decide.ledger import LoadLedger, PromptLoads
from kvpilot.routing.decide.measured_prices import FleetLoad, predict_path
from kvpilot.routing.decide.rates import RateEstimator
from kvpilot.routing.decide.residency import Residency
from kvpilot.routing.decide.route import Kind, NoHealthyWorker, Route
from kvpilot.routing.decide.session_step import cache_path, measured_times, policy_inputs, price_session_step
from kvpilot.routing.decide.sessions import OfferUse, SessionOffer, SessionStore
from kvpilot.routing.fleet import Fleet
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.kvindex import KVIndex, Match

if TYPE_CHECKING:
    from kvpilot.routing.health.view import FleetHealth

__all__ = ["Kind", "NoHealthyWorker", "Route", "Router", "policy_from_config"]


class Router:
    """Decides (P, D) or the co-located worker for each request; see the module doc."""

    def __init__(
        self,
        fleet: Fleet,
        config: RouterConfig,
        index: KVIndex,
        ledger: LoadLedger,
        sessions: SessionStore,
        policy: LocalVsRemotePolicy | None,
        rng: random.Random | None = None,
        *,
        health: FleetHealth | None = None,
        rates: RateEstimator | None = None,
    ) -> None:
        """``health``: who is fit to serve (:class:`~kvpilot.routing.health.view.FleetHealth`):
        the workers whose circuits are open are not routed to, those whose KV events stopped
        get no overlap credit (load only), each (P, D) pair's recent transfers add to its
        cost, and D's self-reported running streams beyond this router's count in its load.
        Its verdicts are asked once per request and name only the few workers and pairs with
        a record, so no decision spends Python per worker of the fleet. ``None``: every
        worker is fit, and only this router's own load is known.
        ``rates``: the measured rates the policy and the session options price with when
        ``disaggregation.measured_rates`` is on."""
        if fleet.prefill and policy is None:
            raise ValueError("a fleet with prefill workers needs a local-vs-remote policy")
        self.fleet = fleet
        self.config = config
        self.index = index
        self.ledger = ledger
        self.sessions = sessions
        self.policy = policy
        self.health = health
        self.engine_load = health.engine_load if health is not None else None
        self._routed_at_poll: dict[WorkerId, int] = {}
        """Per worker, this router's requests on it when its gauges were last read (:meth:`engine_polled`)."""
        self.pricer = SessionOptionPricer(policy) if policy is not None else None
        self.rates = rates if config.disaggregation.measured_rates else None
        self._by_ttft = config.cost.objective is CostObjective.PREDICTED_TTFT
        if self._by_ttft and self.rates is None:
            raise ValueError("cost.objective predicted_ttft needs the measured rates")
        self._forced = config.sessions.force_option.option
        self.cost = CostModel(
            effective_cost(config, fleet), rng if rng is not None else random.Random(config.cost.router_seed)
        )
        self._tiers = config.index.tiers
        self._options = CandidateRows.of(fleet)
        self.residency = Residency(config.sessions.resident_s)
        """The sessions living on each decode worker (a session's first step is charged for them)."""
        self._hold_s: dict[WorkerId, float] = {}
        """Per decode worker, the hold its latest offer stated (seconds from its answer to its lease's end)."""
        self.prefill_residency = Residency(config.sessions.resident_s)
        """The sessions whose latest step a prefill worker prefilled: its later steps' history
        is cached there, and a pair's P is charged for them as D is for its own."""

    def barred(self) -> Set[WorkerId]:
        """The workers not to route to now (their circuits are open)."""
        return self.health.barred() if self.health is not None else frozenset()

    def set_fleet(self, fleet: Fleet) -> None:
        """Route over ``fleet`` from the next request on (workers joined or left the
        deployment). A session whose last workers left keeps its chain and is routed as
        if they had never served it. Raises ValueError as ``__init__`` does."""
        if fleet.prefill and self.policy is None:
            raise ValueError("a fleet with prefill workers needs a local-vs-remote policy")
        self.fleet = fleet
        self._options = CandidateRows.of(fleet)
        self.cost.cfg = effective_cost(self.config, fleet)

    def route(
        self,
        token_ids: Sequence[int],
        request_id: str,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        session: SessionId | None = None,
        dry_run: bool = False,
        now: float | None = None,
        exclude: frozenset[WorkerId] = frozenset(),
    ) -> Route:
        """Choose where ``token_ids`` goes. Does not modify the index or the ledger.

        With ``session`` and not ``dry_run``, the session's chain advances to
        ``token_ids`` (only new blocks are named). A ``dry_run`` names a fresh
        chain and leaves the session's chain as it was (it may create an empty
        session entry). ``now`` (Unix seconds) dates the session's offer; ``None``
        ignores its expiry. ``exclude``: decode workers not to use (a retry's
        failed ones). Raises ValueError for an empty prompt, :class:`NoHealthyWorker`
        when no decode worker is left.
        """
        if not token_ids:
            raise ValueError("empty prompt")
        last: WorkerId | None = None
        state = self.sessions.get(session) if session is not None else None
        reused_tokens = 0  # of the session's last prompt: its holder D has their KV
        if state is not None:
            last = state.last_worker
        if state is not None and not dry_run:
            reused_tokens = state.advance(token_ids, lora_name=lora_name, cache_salt=cache_salt).reused_tokens
            chain = state.chain
            assert chain is not None
        elif state is not None:  # a dry run leaves the chain: a preview names only the new blocks
            chain, reused_tokens = state.preview(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        else:
            chain = PromptChain(token_ids, self.index.block_size, lora_name=lora_name, cache_salt=cache_salt)
        match = self.index.match(chain)
        overlaps = self._overlaps(match)
        load = self.fleet_load(self.ledger.prompt_loads(chain))
        opts = self._options
        barred = self.barred()
        usable = np.ones(len(opts.workers), bool)
        usable[[row for w in barred | exclude if (row := opts.rows.get(w)) is not None]] = False
        kept = np.flatnonzero(usable[opts.decode_rows])
        if not kept.size:
            raise NoHealthyWorker(
                "no decode or co-located worker is available: every circuit is open"
                + (f" or it failed this request ({', '.join(sorted(exclude))})" if exclude else "")
            )
        table = self._candidates(kept, overlaps, load, last, len(token_ids), now)
        decision = self.cost.decide(request_id, chain.num_blocks, table)
        p, d = opts.pairs[int(kept[decision.index])]
        local_remote = None
        kind = Kind.COLOCATED
        option: Option | None = None
        prices: tuple[OptionPrice, ...] = ()
        if p is not None and state is not None and state.last_worker is not None:
            assert self.pricer is not None
            prices = price_session_step(
                self.pricer,
                self.rates,
                load,
                p,
                d,
                len(token_ids),
                overlaps,
                state=state,
                reused_tokens=reused_tokens,
                now=now,
                barred=barred,
                prefill_workers=self.fleet.prefill,
                fleet_workers=opts.rows,
                kv_usage=self.kv_usage(d, load.booked[d.name].active_decode_blocks),
            )
            chosen = choose(prices, self._forced)
            option = chosen.option
            p = None if option is Option.LOCAL else self.fleet.by_name(WorkerId(chosen.prefill_worker or ""))
            kind = Kind.LOCAL_PREFILL if p is None else Kind.REMOTE_PREFILL
        elif p is not None and p.name in barred:  # P's circuit is open: D prefills (option 5)
            p, kind = None, Kind.LOCAL_PREFILL
        elif p is not None:
            assert self.policy is not None
            usage = self.kv_usage(d, load.booked[d.name].active_decode_blocks)
            prompt, decode = policy_inputs(load, p, d, len(token_ids), overlaps, usage)
            local_remote = self.policy.decide(
                prompt, decode, measured_times(self.rates, load, p, d, len(token_ids), overlaps)
            )
            kind = Kind.REMOTE_PREFILL if local_remote.where is Where.REMOTE else Kind.LOCAL_PREFILL
            if kind is Kind.LOCAL_PREFILL:
                p = None
        prefiller = p if p is not None else d
        if session is not None and not dry_run and now is not None:
            self._settle(session, p, d, chain.num_blocks, now)
        return Route(
            request_id=request_id,
            kind=kind,
            prefill=p,
            decode=d,
            prompt_tokens=len(token_ids),
            prompt_blocks=chain.num_blocks,
            chain=chain,
            cached_blocks=overlaps[prefiller.name].gpu,
            decode_cached_blocks=overlaps[d.name].gpu,
            overlap=overlaps[prefiller.name],
            match=match,
            decision=decision,
            local_remote=local_remote,
            option=option,
            options=prices,
        )

    def commit(
        self,
        route: Route,
        token_ids: Sequence[int],
        *,
        session: SessionId | None,
        now: float | None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Take a ``dry_run`` :meth:`route` of ``token_ids`` as the decision, with no second
        decision: the session's chain advances to ``token_ids`` and it settles on the route's
        workers, as the same call without ``dry_run`` would have left them on the same state."""
        if session is None:
            return
        self.sessions.get(session).advance(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        if now is not None:
            self._settle(session, route.prefill, route.decode, route.prompt_blocks, now)

    def _settle(self, session: SessionId, p: Worker | None, d: Worker, blocks: int, now: float) -> None:
        """``session`` (its latest prompt ``blocks`` long) lives on ``d`` and, prefilled
        remotely, on ``p`` from ``now`` (:attr:`residency`, :attr:`prefill_residency`)."""
        self.residency.settle(session, d.name, blocks, now)
        if p is not None:
            self.prefill_residency.settle(session, p.name, blocks, now)

    def served(
        self, session: SessionId | None, route: Route, decode_params: object = None, now: float | None = None
    ) -> None:
        """Record that ``route``'s decode worker now holds the session's newest KV (the
        session lives there, :attr:`residency`, until ``sessions.resident_s`` after ``now``,
        Unix seconds), and, when its returned ``decode_params`` offer that KV to a peer
        (vLLM's bidirectional mode), the offer for the session's next step."""
        if session is None:
            return
        state = self.sessions.get(session)
        offer = SessionOffer.from_response(route.decode.name, decode_params)
        if now is not None:
            self._settle(session, route.prefill, route.decode, route.prompt_blocks, now)
            state.ended_at = now
            if offer is not None and offer.expires_at is not None:
                self._hold_s[route.decode.name] = offer.expires_at - now
        state.steps += 1
        state.last_worker = route.decode.name
        state.last_prefill = route.prefill.name if route.prefill is not None else None
        if offer is not None:
            state.offer = offer

    def hold(self, session: SessionId | None, route: Route, now: float) -> HoldDecision | None:
        """Whether ``route``'s D holds the step's KV for the session's next step once it
        finishes (:mod:`kvpilot.policies.session_hold`), the step's gap noted as arrived at
        ``now`` (Unix seconds). The horizon is ``sessions.resident_s``, or less the hold D's
        offers state (their lease less :data:`LEASE_MARGIN_S`). ``None`` without a session
        or under ``sessions.hold: always``."""
        if session is None:
            return None
        state = self.sessions.get(session)
        state.arrived(now)
        config = self.config.sessions
        if config.hold is HoldMode.ALWAYS:
            return None
        d = route.decode
        horizon = config.resident_s
        stated = self._hold_s.get(d.name)
        if stated is not None:
            horizon = min(horizon, stated - LEASE_MARGIN_S)
        usage = self.kv_usage(d, self.ledger.load(d.name).active_decode_blocks)
        return decide_hold(state.gaps_s, horizon, usage, config.hold_release_kv_usage)

    def take_session_offer(
        self, session: SessionId | None, route: Route, now: float
    ) -> tuple[SessionOffer | None, OfferUse]:
        """The session's offer for P to pull when ``route`` chose option ``pull``
        (``"sent"``), else ``None`` with why: ``"expired"`` (its hold ends before P
        could read it, whichever option was chosen), ``"unused"`` (another option was
        chosen) or ``"none"``. The
        offer is taken either way: D's next answer brings a fresh one."""
        if session is None:
            return None, "none"
        state = self.sessions.get(session)
        offer, state.offer = state.offer, None
        if offer is None:
            return None, "none"
        use = offer.use(now)
        if use == "sent" and route.option is not Option.PULL:
            use = "unused"
        return (offer if use == "sent" else None), use

    def gpu_overlap(self, match: Match, worker: WorkerId) -> int:
        """The prompt's leading blocks ``worker`` holds in GPU by ``match`` (0 while its KV events are stale)."""
        return self._overlaps(match)[worker].gpu

    def _overlaps(self, match: Match) -> defaultdict[WorkerId, TierOverlap]:
        """Each worker's creditable overlap, built for the workers the match names (a
        large fleet's others are idle: the ``defaultdict``'s default, which holds only
        the shared tier). A worker whose events stopped gets the default too."""
        shared = max(
            (
                depth
                for tiers in match.blocks.values()
                for tier, depth in tiers.items()
                if self._tiers.get(tier) is TierClass.SHARED
            ),
            default=0,
        )
        idle = tier_overlap({}, self._tiers, shared)
        return defaultdict(
            lambda: idle,
            {
                worker: tier_overlap(tiers, self._tiers, shared)
                for worker, tiers in match.blocks.items()
                if self.health is None or not self.health.events_stale(worker)
            },
        )

    def _candidates(
        self,
        kept: np.ndarray,
        overlaps: defaultdict[WorkerId, TierOverlap],
        load: FleetLoad,
        last: WorkerId | None,
        prompt_tokens: int,
        now: float | None,
    ) -> CandidateTable:
        """The ``kept`` options (rows of
        :class:`~kvpilot.routing.decide.candidate_rows.CandidateRows`) as cost columns: per
        worker, arrays filled from the sparse overlaps, loads and living sessions, then gathered
        per option (a pair: P's overlap and active prefill blocks, D's decode load and, unless
        this is a session's later step, the sessions living on D and on P; its session credit
        if D served the session last, its ``pair_penalty``)."""
        opts = self._options
        idle = overlaps.default_factory
        assert idle is not None
        per_worker_overlap = np.empty((len(opts.workers), 4))
        per_worker_overlap[:] = idle()
        for worker, overlap in overlaps.items():
            row = opts.rows.get(worker)
            if row is not None:  # not a worker that left the fleet
                per_worker_overlap[row] = overlap
        per_worker_load = np.zeros((len(opts.workers), 4))
        per_worker_load[:, :3] = self.ledger.counts(self.ledger.rows(opts.worker_names))
        for worker, depth in load.booked.shared.items():
            row = opts.rows.get(worker)
            if row is not None:
                per_worker_load[row, 3] = depth
        per_worker_resident = np.zeros(len(opts.workers))
        if last is None:  # a session's later step is not charged for the sessions living on D or P
            for residency in (self.residency, self.prefill_residency):
                for worker, blocks in residency.blocks(now).items():
                    row = opts.rows.get(worker)
                    if row is not None:
                        per_worker_resident[row] += blocks
        prefill_rows, decode_rows = opts.prefill_rows[kept], opts.decode_rows[kept]
        resident = per_worker_resident[decode_rows]  # D's, and a pair's P's
        resident += np.where(prefill_rows != decode_rows, per_worker_resident[prefill_rows], 0.0)
        candidate_load = per_worker_load[decode_rows]
        candidate_load[:, 0] = per_worker_load[prefill_rows, 0]
        last_row = opts.rows.get(last) if last is not None else None
        per_option_penalty = np.zeros(len(opts.names))
        for pair, penalty_blocks in (self.health.pair_penalties() if self.health is not None else {}).items():
            option = opts.pair_options.get(pair)
            if option is not None:  # not a pair of the fleet any more
                per_option_penalty[option] = penalty_blocks
        penalty = per_option_penalty[kept]
        predicted = None
        if self._by_ttft:
            chosen_pairs = [opts.pairs[option] for option in kept]
            predicted = np.array([self._predicted_ttft_s(p, d, prompt_tokens, overlaps, load) for p, d in chosen_pairs])
        return CandidateTable(
            [opts.names[option] for option in kept],
            per_worker_overlap[prefill_rows],
            candidate_load,
            decode_rows == (last_row if last_row is not None else -1),
            penalty,
            resident,
            predicted,
        )

    def _predicted_ttft_s(
        self,
        p: Worker | None,
        d: Worker,
        prompt_tokens: int,
        overlaps: Mapping[WorkerId, TierOverlap],
        load: FleetLoad,
    ) -> float:
        """The candidate's predicted TTFT from the measured rates: the prefilling worker's
        (P's, else D's) prefill queue and the prefill of what it lacks in GPU, D's read of
        what D lacks (a pair), D's first step beside its running streams."""
        assert self.rates is not None
        prefiller = p if p is not None else d
        return predict_path(self.rates, cache_path(load, prefiller, d, prompt_tokens, overlaps)).seconds

    def engine_polled(self, worker: WorkerId) -> None:
        """``worker``'s gauges were just read (``engine_load``'s newest sample): remember how
        many of this router's requests were on it then."""
        self._routed_at_poll[worker] = self.ledger.load(worker).active_requests

    def fleet_load(self, booked: PromptLoads | None = None) -> FleetLoad:
        """The load every price reads now (:class:`FleetLoad`): the ledger (``booked``, one
        prompt's view of it; by default the ledger's own) and D's requests beyond it."""
        if booked is None:
            booked = PromptLoads(self.ledger, {})
        return FleetLoad(booked, self._unbooked_streams, self.index.block_size)

    def _unbooked_streams(self, d: WorkerId) -> int:
        """The requests D's own gauge counted beyond this router's requests on it when it was
        read (traffic that bypassed this router); 0 without gauges. The gauge is up to a poll
        interval (``server.engine_metrics_interval_s``) old: taken whole, a session's step
        that had finished since would still count as a running stream, and price the next
        step's local prefill with a stall it does not cause."""
        reported = self.engine_load(d) if self.engine_load is not None else None
        if reported is None:
            return 0
        return max(0, int(reported.running) - self._routed_at_poll.get(d, 0))

    def kv_usage(self, d: Worker, active_decode_blocks: int) -> float:
        """D's KV usage: its ``active_decode_blocks`` booked here over its ``kv_blocks``, or
        D's own gauge when higher (it also counts traffic that bypassed this router)."""
        usage = min(1.0, active_decode_blocks / d.kv_blocks) if d.kv_blocks else 0.0
        reported = self.engine_load(d.name) if self.engine_load is not None else None
        return usage if reported is None else max(usage, reported.kv_usage)
