"""The sessions living on each worker: where their next steps are expected. Pure: the caller passes the time.

An agent's session runs a step, waits for its tool, and comes back to the worker that
served it (its history is cached there). Between steps a live request count sees that
worker idle, and Dynamo's decode term counts a worker's *unique* blocks, so twelve
sessions on one shared prefix weigh little more than one: a router that prices only
that piles new sessions on the workers holding the prefix, and every session piled
there collides there at each later step (each stream attends its whole context, shared
or not). :class:`Residency` keeps each live session on its worker with the blocks of its
latest prompt, from the step's route until ``horizon_s`` after its latest step ended.
The router adds them to a session's first step's cost (``cost.session_residency_weight``),
so the first step is placed for the later ones.

A session moves when a step is routed elsewhere and leaves ``horizon_s`` after its
latest step (its tool may never return). The router keeps one :class:`Residency` for decode
(and co-located) workers and one for prefill workers: in a disaggregated fleet a session's
later steps prefill on the P that holds its history, and the first steps of many sessions
piled on one P would queue there at every later step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from kvpilot.routing.ids import SessionId, WorkerId


class Residency:
    """Per worker, the blocks of the sessions living on it (see the module doc)."""

    def __init__(self, horizon_s: float) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s}")
        self.horizon_s = horizon_s
        self._sessions: OrderedDict[SessionId, tuple[WorkerId, int, float]] = OrderedDict()
        """Session -> (worker, blocks, when it settled), oldest settle first."""
        self._blocks: dict[WorkerId, int] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def settle(self, session: SessionId, worker: WorkerId, blocks: int, now: float) -> None:
        """``session``'s step of a ``blocks``-block prompt was routed to, or ended on,
        ``worker`` at ``now`` (seconds)."""
        self._leave(session)
        self._sessions[session] = (worker, blocks, now)
        self._blocks[worker] = self._blocks.get(worker, 0) + blocks

    def _leave(self, session: SessionId) -> None:
        """``session`` no longer lives anywhere."""
        entry = self._sessions.pop(session, None)
        if entry is not None:
            self._drop(entry[0], entry[1])

    def blocks(self, now: float | None) -> Mapping[WorkerId, int]:
        """Per worker, the living sessions' blocks (workers with none absent), after
        dropping those settled more than ``horizon_s`` before ``now`` (``None``: none expire)."""
        if now is not None:
            while self._sessions:
                session, (worker, blocks, settled) = next(iter(self._sessions.items()))
                if now - settled <= self.horizon_s:
                    break
                del self._sessions[session]
                self._drop(worker, blocks)
        return self._blocks

    def _drop(self, worker: WorkerId, blocks: int) -> None:
        left = self._blocks[worker] - blocks
        if left:
            self._blocks[worker] = left
        else:
            del self._blocks[worker]
