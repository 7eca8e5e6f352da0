"""A fleet's candidates as rows (:class:`CandidateRows`): each (P, D) pair and each worker that
serves alone, with the per-worker row of the worker that prefills and of the one that decodes,
so the router gathers a request's cost columns from per-worker arrays in one numpy step.
Built once per fleet (:meth:`CandidateRows.of`); pure."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpilot.routing.config import Worker
from kvpilot.routing.fleet import Fleet
from kvpilot.routing.ids import WorkerId, pair_name


@dataclass(frozen=True, slots=True)
class CandidateRows:
    """Every candidate of a fleet, in rows: each (P, D) pair, each co-located worker, and
    each decode worker of a fleet without prefill workers (it serves like a co-located
    one). A pair is named ``"P->D"``. ``prefill_rows`` and ``decode_rows`` index
    ``workers`` (the prefilling worker: P, or the worker itself), so a request's
    candidate columns are gathered from per-worker arrays in one numpy step."""

    names: list[str]
    pairs: list[tuple[Worker | None, Worker]]
    workers: tuple[Worker, ...]
    worker_names: tuple[WorkerId, ...]
    rows: dict[WorkerId, int]
    """Worker name -> its row in ``workers``."""
    pair_options: dict[tuple[WorkerId, WorkerId], int]
    """(P, D) -> the pair's option (its index in ``names``)."""
    prefill_rows: np.ndarray
    decode_rows: np.ndarray

    @classmethod
    def of(cls, fleet: Fleet) -> CandidateRows:
        """The rows of ``fleet``'s candidates, in the order the cost model sees them."""
        pairs: dict[str, tuple[Worker | None, Worker]] = {
            pair_name(p.name, d.name): (p, d) for p in fleet.prefill for d in fleet.decode
        }
        for worker in fleet.colocated:
            pairs[worker.name] = (None, worker)
        if not fleet.prefill:
            for worker in fleet.decode:
                pairs[worker.name] = (None, worker)
        rows = {w.name: i for i, w in enumerate(fleet.workers)}
        return cls(
            list(pairs),
            list(pairs.values()),
            fleet.workers,
            tuple(w.name for w in fleet.workers),
            rows,
            {(p.name, d.name): i for i, (p, d) in enumerate(pairs.values()) if p is not None},
            np.array([rows[(p if p is not None else d).name] for p, d in pairs.values()], dtype=np.intp),
            np.array([rows[d.name] for _, d in pairs.values()], dtype=np.intp),
        )
