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
         - session_affinity_credit * [worker served this session last]
         + pair_penalty_blocks        # kvpilot's own: a (P, D) pair's recent transfer
                                      # failures and transfer time (routing.health.pair_health)

This is the formula of the article's section 4.4 (Dynamo's routing concepts). With
``cost.objective: predicted_ttft`` a candidate's cost is instead its predicted TTFT in
seconds (:attr:`Candidate.predicted_ttft_s`, from the measured rates); the block terms
are still computed and shown.
The load comes from :class:`routing.decide.ledger.LoadLedger`; as in Dynamo, decode
blocks are unique blocks, so the prompt's leading blocks that the worker's
active requests already hold (``shared_decode_blocks``) add nothing.
The decay form is ours (Dynamo does not publish one): hyperbolic in the
worker's active prefill blocks, so ``decay = 0`` is Dynamo's default (no
decay), and ``decay = 0.01`` halves the GPU credit of a worker already
prefilling 100 blocks: the cache-rich but busy worker stops winning every hot
prefix. Affinity is a soft credit, never a pin.

``router_temperature = 0`` picks the lowest cost (ties broken by the seeded
RNG); above 0 it samples ``softmax(-normalized_cost / T)``, where costs are
min-max normalized to [0, 1], with the seeded RNG.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from routing.config import CostConfig, CostObjective, TierClass
from routing.decide.ledger import WorkerLoad
from routing.ids import Tier


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

    ``depths`` is one worker's entry of :attr:`routing.index.kvindex.Match.blocks`;
    ``tier_classes`` maps a medium to its :class:`~routing.config.TierClass`
    (unknown media earn nothing). ``shared_depth`` is the deepest prefix any
    worker reported in a ``shared`` tier: a shared cache serves every worker.

    >>> tier_overlap({"GPU": 10, "CPU": 25}, {"GPU": TierClass.GPU, "CPU": TierClass.HOST})
    TierOverlap(gpu=10, host=15, disk=0, shared=0)
    """
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
    """One option: a worker (or a P->D pair named by the caller) and what it faces."""

    name: str
    overlap: TierOverlap
    load: WorkerLoad
    session_affinity: bool = False
    pair_penalty_blocks: float = 0.0
    predicted_ttft_s: float | None = None
    """The candidate's predicted TTFT (``cost.objective: predicted_ttft``; ``None`` otherwise)."""


class Terms(NamedTuple):
    name: str
    gpu_credit: float
    credit_blocks: float
    adjusted_prefill_blocks: float
    potential_decode_blocks: int
    active_request_cost: float
    affinity_credit: float
    pair_penalty: float
    cost: float
    predicted_ttft_s: float | None = None


def worker_terms(cfg: CostConfig, prompt_blocks: int, cand: Candidate) -> Terms:
    """The cost of sending a ``prompt_blocks`` request to ``cand``, term by term."""
    load, ov = cand.load, cand.overlap
    gpu_credit = cfg.overlap_score_credit / (1.0 + cfg.overlap_score_credit_decay * load.active_prefill_blocks)
    credit = (
        gpu_credit * ov.gpu
        + cfg.host_cache_hit_weight * ov.host
        + cfg.disk_cache_hit_weight * ov.disk
        + cfg.shared_cache_multiplier * ov.shared
    )
    adjusted = max(0.0, load.active_prefill_blocks + prompt_blocks - credit)
    decode = load.active_decode_blocks + prompt_blocks - load.shared_decode_blocks
    requests = cfg.decode_active_request_weight * load.active_requests
    affinity = cfg.session_affinity_credit if cand.session_affinity else 0.0
    cost = cfg.prefill_load_scale * adjusted + decode + requests - affinity + cand.pair_penalty_blocks
    predicted = cand.predicted_ttft_s
    if cfg.objective is CostObjective.PREDICTED_TTFT:
        if predicted is None:
            raise ValueError(f"candidate {cand.name}: cost.objective is predicted_ttft and it has no prediction")
        cost = predicted
    penalty = cand.pair_penalty_blocks
    return Terms(cand.name, gpu_credit, credit, adjusted, decode, requests, affinity, penalty, cost, predicted)


@dataclass(frozen=True)
class Decision:
    request_id: str
    prompt_blocks: int
    chosen: str
    terms: tuple[Terms, ...]
    probabilities: tuple[float, ...] | None
    config: CostConfig

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
                f" - session_affinity_credit({t.affinity_credit:.2f})"
                + (f" + pair_penalty({t.pair_penalty:.2f})" if t.pair_penalty else "")
            )
            if t.predicted_ttft_s is not None and c.objective is CostObjective.PREDICTED_TTFT:
                cost = f"cost=predicted_ttft({t.predicted_ttft_s * 1e3:.2f} ms); in blocks: {blocks}"
            else:
                cost = f"cost={t.cost:.2f} = {blocks}"
            lines.append(
                f"request={self.request_id} worker={t.name} {cost}{p}" + (" <- chosen" if t.name == self.chosen else "")
            )
        return "\n".join(lines)


class CostModel:
    """Scores candidates with :func:`worker_terms` and picks one (seeded RNG)."""

    def __init__(self, cfg: CostConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self._rng = rng if rng is not None else random.Random(cfg.router_seed)

    def decide(self, request_id: str, prompt_blocks: int, cands: Sequence[Candidate]) -> Decision:
        """Pick a candidate; raises ValueError if ``cands`` is empty."""
        if not cands:
            raise ValueError(f"request {request_id}: no candidate workers")
        terms = tuple(worker_terms(self.cfg, prompt_blocks, c) for c in cands)
        costs = [t.cost for t in terms]
        probabilities = None
        if self.cfg.router_temperature > 0:
            lo, hi = min(costs), max(costs)
            span = hi - lo
            weights = [math.exp(-((x - lo) / span if span else 0.0) / self.cfg.router_temperature) for x in costs]
            total = sum(weights)
            probabilities = tuple(w / total for w in weights)
            index = self._rng.choices(range(len(terms)), weights=probabilities)[0]
        else:
            best = min(costs)
            index = self._rng.choice([i for i, x in enumerate(costs) if x == best])
        return Decision(request_id, prompt_blocks, terms[index].name, terms, probabilities, self.cfg)
