"""Dynamo's worker cost and explainable decisions. Pure.

For a request of ``prompt_blocks`` full blocks and a candidate worker (all in blocks)::

    gpu_credit      = overlap_score_credit / (1 + overlap_score_credit_decay * active_prefill_blocks)
    credit_blocks   = gpu_credit * gpu_overlap
                    + host_cache_hit_weight   * host_overlap     # beyond the GPU prefix
                    + disk_cache_hit_weight   * disk_overlap     # beyond GPU and host
                    + shared_cache_multiplier * shared_overlap   # beyond all of them
    adjusted_prefill_blocks = max(0, active_prefill_blocks + prompt_blocks - credit_blocks)
    potential_decode_blocks = active_decode_blocks + prompt_blocks - shared_decode_blocks
    cost = prefill_load_scale * adjusted_prefill_blocks
         + potential_decode_blocks
         + decode_active_request_weight * active_requests
         + session_residency_weight * resident_session_blocks   # kvpilot's own, a session's
                                      # first step only: the blocks of the sessions living
                                      # on the worker (kvpilot.routing.decide.residency)
         - session_affinity_credit * [worker served this session last]
         + pair_penalty_blocks        # kvpilot's own: a (P, D) pair's recent transfer
                                      # failures and transfer time (kvpilot.routing.health.pair_health)

This is the formula of the article's section 4.4 (Dynamo's routing concepts). A session's
later step is picked only among the rows :func:`eligible` allows (kvpilot's own: it
stays on its worker unless another would start it sooner). With
``cost.objective: predicted_ttft`` a candidate's cost is instead its predicted TTFT in
seconds (:attr:`Candidate.predicted_ttft_s`, from the measured rates); the block terms
are still computed and shown.
The load comes from :class:`kvpilot.routing.decide.ledger.LoadLedger`; as in Dynamo, decode
blocks are unique blocks, so the prompt's leading blocks that the worker's
active requests already hold (``shared_decode_blocks``) add nothing.
The decay form is ours (Dynamo does not publish one): hyperbolic in the
worker's active prefill blocks, so ``decay = 0`` is Dynamo's default (no
decay), and ``decay = 0.01`` halves the GPU credit of a worker already
prefilling 100 blocks: the cache-rich but busy worker stops winning every hot
prefix. Affinity is a soft credit, never a pin.

The cost is computed for every candidate at once, over columns (:class:`CandidateTable`).

``router_temperature = 0`` picks the lowest cost (ties broken by the seeded
RNG); above 0 it samples ``softmax(-normalized_cost / T)``, where costs are
min-max normalized to [0, 1], with the seeded RNG.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvpilot.routing.config import CostConfig, CostObjective, TierClass
from kvpilot.routing.decide.ledger import WorkerLoad
from kvpilot.routing.ids import Tier


class TierOverlap(NamedTuple):
    """Blocks creditable per tier class, each counted only beyond the better tiers."""

    gpu: int = 0
    host: int = 0
    disk: int = 0
    shared: int = 0


_TIER_ORDER = tuple(TierClass)
"""TierClass's members, best first (iterating the enum itself is slow on a per-worker path)."""


def tier_overlap(
    depths: Mapping[Tier, int], tier_classes: Mapping[str, TierClass], shared_depth: int = 0
) -> TierOverlap:
    """Fold a worker's per-tier prefix depths into :class:`TierOverlap`.

    ``depths`` is one worker's entry of :attr:`kvpilot.routing.index.kvindex.Match.blocks`;
    ``tier_classes`` maps a medium to its :class:`~kvpilot.routing.config.TierClass`
    (unknown media earn nothing). ``shared_depth`` is the deepest prefix any
    worker reported in a ``shared`` tier: a shared cache serves every worker.

    >>> tier_overlap({"GPU": 10, "CPU": 25}, {"GPU": TierClass.GPU, "CPU": TierClass.HOST})
    TierOverlap(gpu=10, host=15, disk=0, shared=0)
    """
    if len(depths) == 1:  # the common case, once per matched worker: GPU alone
        ((tier, depth),) = depths.items()
        if tier_classes.get(tier) is TierClass.GPU:
            return TierOverlap(depth, 0, 0, max(0, shared_depth - depth))
    best = dict.fromkeys(_TIER_ORDER, 0)
    for tier, depth in depths.items():
        klass = tier_classes.get(tier)
        if klass is not None:
            best[klass] = max(best[klass], depth)
    best[TierClass.SHARED] = max(best[TierClass.SHARED], shared_depth)
    covered, out = 0, []
    for klass in _TIER_ORDER:  # best first, as TierOverlap's fields
        out.append(max(0, best[klass] - covered))
        covered = max(covered, best[klass])
    return TierOverlap(*out)


class Candidate(NamedTuple):
    """One option as a row: a worker (or a P->D pair named by the caller) and what it faces
    (:meth:`CandidateTable.of` stacks rows into the table :meth:`CostModel.decide` reads)."""

    name: str
    overlap: TierOverlap
    load: WorkerLoad
    session_affinity: bool = False
    pair_penalty_blocks: float = 0.0
    resident_blocks: int = 0
    predicted_ttft_s: float | None = None
    """The candidate's predicted TTFT (``cost.objective: predicted_ttft``; ``None`` otherwise)."""


@dataclass(frozen=True, slots=True)
class CandidateTable:
    """Every option of one request as columns, one row per candidate, so the cost is a
    few numpy passes however large the fleet (the router fills the columns from its
    sparse per-worker state). ``overlap`` holds :class:`TierOverlap`'s fields and
    ``load`` :class:`~kvpilot.routing.decide.ledger.WorkerLoad`'s, each row in that order (for a
    pair: P's overlap and active prefill blocks, D's decode blocks and requests)."""

    names: Sequence[str]
    overlap: np.ndarray
    """Shape ``(n, 4)``: gpu, host, disk, shared blocks."""
    load: np.ndarray
    """Shape ``(n, 4)``: active prefill blocks, active decode blocks, active requests, shared decode blocks."""
    session_affinity: np.ndarray
    """Shape ``(n,)``, bool: the candidate's D served the session last."""
    pair_penalty_blocks: np.ndarray
    """Shape ``(n,)``."""
    resident_blocks: np.ndarray
    """Shape ``(n,)``: the blocks of the sessions living on the candidate's D (0 for a session's later step)."""
    predicted_ttft_s: np.ndarray | None = None
    """Shape ``(n,)``, or ``None`` when the objective does not price by predicted TTFT."""

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of(cls, rows: Sequence[Candidate]) -> CandidateTable:
        """The table of ``rows`` (a few candidates named one by one)."""
        predicted = [row.predicted_ttft_s for row in rows]
        return cls(
            [row.name for row in rows],
            np.array([row.overlap for row in rows], dtype=float).reshape(len(rows), 4),
            np.array([row.load for row in rows], dtype=float).reshape(len(rows), 4),
            np.array([row.session_affinity for row in rows], dtype=bool),
            np.array([row.pair_penalty_blocks for row in rows], dtype=float),
            np.array([row.resident_blocks for row in rows], dtype=float),
            None if any(p is None for p in predicted) else np.array(predicted, dtype=float),
        )


class Terms(NamedTuple):
    name: str
    gpu_credit: float
    credit_blocks: float
    adjusted_prefill_blocks: float
    potential_decode_blocks: int
    active_request_cost: float
    affinity_credit: float
    pair_penalty: float
    residency_cost: float
    cost: float
    predicted_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class _TermColumns:
    """:class:`Terms`' fields as columns over a :class:`CandidateTable`."""

    gpu_credit: np.ndarray
    credit_blocks: np.ndarray
    adjusted_prefill_blocks: np.ndarray
    potential_decode_blocks: np.ndarray
    active_request_cost: np.ndarray
    affinity_credit: np.ndarray
    residency_cost: np.ndarray
    cost: np.ndarray


def _term_columns(cfg: CostConfig, prompt_blocks: int, table: CandidateTable) -> _TermColumns:
    """The cost of sending a ``prompt_blocks`` request to each candidate, term by term
    (the module doc's formula, one numpy pass per term)."""
    prefill, decode_blocks, requests, shared_decode = table.load.T
    gpu, host, disk, shared = table.overlap.T
    gpu_credit = cfg.overlap_score_credit / (1.0 + cfg.overlap_score_credit_decay * prefill)
    credit = (
        gpu_credit * gpu
        + cfg.host_cache_hit_weight * host
        + cfg.disk_cache_hit_weight * disk
        + cfg.shared_cache_multiplier * shared
    )
    adjusted = np.maximum(0.0, prefill + prompt_blocks - credit)
    decode = decode_blocks + prompt_blocks - shared_decode
    request_cost = cfg.decode_active_request_weight * requests
    affinity = np.where(table.session_affinity, cfg.session_affinity_credit, 0.0)
    residency = cfg.session_residency_weight * table.resident_blocks
    cost = cfg.prefill_load_scale * adjusted + decode + request_cost + residency - affinity + table.pair_penalty_blocks
    if cfg.objective is CostObjective.PREDICTED_TTFT:
        if table.predicted_ttft_s is None:
            raise ValueError("cost.objective is predicted_ttft and the candidates have no prediction")
        cost = table.predicted_ttft_s
    return _TermColumns(gpu_credit, credit, adjusted, decode, request_cost, affinity, residency, cost)


@dataclass(frozen=True)
class Decision:
    request_id: str
    prompt_blocks: int
    index: int
    """The chosen candidate's row in ``table``."""
    table: CandidateTable
    columns: _TermColumns
    probabilities: tuple[float, ...] | None
    config: CostConfig
    eligible: np.ndarray | None = None
    """The rows the pick was made among (:func:`eligible`); ``None``: all."""

    @property
    def chosen(self) -> str:
        """The chosen candidate's name."""
        return self.table.names[self.index]

    @property
    def terms(self) -> tuple[Terms, ...]:
        """Each candidate's :class:`Terms` (built on demand: a large fleet's decision
        reads only the columns)."""
        t, table = self.columns, self.table
        predicted = table.predicted_ttft_s
        return tuple(
            Terms(
                name,
                float(t.gpu_credit[i]),
                float(t.credit_blocks[i]),
                float(t.adjusted_prefill_blocks[i]),
                int(t.potential_decode_blocks[i]),
                float(t.active_request_cost[i]),
                float(t.affinity_credit[i]),
                float(table.pair_penalty_blocks[i]),
                float(t.residency_cost[i]),
                float(t.cost[i]),
                None if predicted is None else float(predicted[i]),
            )
            for i, name in enumerate(table.names)
        )

    def explain(self) -> str:
        """One line per candidate, term by term, tagged with the request id."""
        c = self.config
        head = (
            f"request={self.request_id} prompt_blocks={self.prompt_blocks} chosen={self.chosen} "
            f"temperature={c.router_temperature} objective={c.objective.value}"
        )
        lines = [head]
        for i, t in enumerate(self.terms):
            p = f" p={self.probabilities[i]:.3f}" if self.probabilities else ""
            blocks = (
                f"prefill_load_scale({c.prefill_load_scale}) * adjusted_prefill_blocks"
                f"({t.adjusted_prefill_blocks:.2f}; credit={t.credit_blocks:.2f} "
                f"gpu_credit/block={t.gpu_credit:.3f}) + potential_decode_blocks"
                f"({t.potential_decode_blocks}) + active_request_cost({t.active_request_cost:.2f})"
                + (f" + residency_cost({t.residency_cost:.2f})" if t.residency_cost else "")
                + f" - session_affinity_credit({t.affinity_credit:.2f})"
                + (f" + pair_penalty({t.pair_penalty:.2f})" if t.pair_penalty else "")
            )
            if t.predicted_ttft_s is not None and c.objective is CostObjective.PREDICTED_TTFT:
                cost = f"cost=predicted_ttft({t.predicted_ttft_s * 1e3:.2f} ms); in blocks: {blocks}"
            else:
                cost = f"cost={t.cost:.2f} = {blocks}"
            barred = self.eligible is not None and not self.eligible[i]
            lines.append(
                f"request={self.request_id} worker={t.name} {cost}{p}"
                + (" (barred: the session's worker starts it as soon)" if barred else "")
                + (" <- chosen" if t.name == self.chosen else "")
            )
        return "\n".join(lines)


class CostModel:
    """Scores a :class:`CandidateTable` (the module doc's cost) and picks one (seeded RNG)."""

    def __init__(self, cfg: CostConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self._rng = rng if rng is not None else random.Random(cfg.router_seed)

    def decide(self, request_id: str, prompt_blocks: int, table: CandidateTable) -> Decision:
        """Pick a candidate among :func:`eligible` ones; raises ValueError if ``table`` is empty."""
        if not len(table):
            raise ValueError(f"request {request_id}: no candidate workers")
        columns = _term_columns(self.cfg, prompt_blocks, table)
        allowed = eligible(self.cfg, table, columns)
        rows = np.flatnonzero(allowed) if allowed is not None else np.arange(len(table))
        costs = columns.cost[rows]
        probabilities = None
        if self.cfg.router_temperature > 0:
            lo = float(costs.min())
            span = float(costs.max()) - lo
            weights = np.exp(-((costs - lo) / span if span else np.zeros_like(costs)) / self.cfg.router_temperature)
            drawn = np.zeros(len(table))
            drawn[rows] = weights / weights.sum()
            probabilities = tuple(drawn.tolist())
            index = self._rng.choices(range(len(table)), weights=probabilities)[0]
        else:
            ties = rows[costs == costs.min()]
            index = int(ties[self._rng.randrange(len(ties))])
        return Decision(request_id, prompt_blocks, index, table, columns, probabilities, self.cfg, allowed)


def eligible(cfg: CostConfig, table: CandidateTable, columns: _TermColumns) -> np.ndarray | None:
    """With ``cost.session_stays_unless_sooner`` and a session's later step (rows whose D
    served its last step): those rows, unless other rows would start the step sooner;
    then only those. Sooner: less prefill before the first token (the queue plus what the
    candidate lacks of the prompt, ``prefill_load_scale * adjusted_prefill_blocks``; with
    ``objective: predicted_ttft``, the predicted TTFT). ``None``: every row is eligible.

    Dynamo's decode term counts a busy home's unique blocks against it, so a session
    leaves the worker holding its history for one holding only the shared prefix and
    prefills its whole history again (a long prefill that stalls every stream there);
    this rule moves it only when that history's prefill would still be the faster start."""
    home = table.session_affinity
    if not cfg.session_stays_unless_sooner or not home.any():
        return None
    if cfg.objective is CostObjective.PREDICTED_TTFT and table.predicted_ttft_s is not None:
        start = table.predicted_ttft_s
    else:
        start = cfg.prefill_load_scale * columns.adjusted_prefill_blocks
    sooner = start < start[home].min()
    return sooner if sooner.any() else home
