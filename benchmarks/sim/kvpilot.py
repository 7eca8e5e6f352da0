"""kvpilot's router in the simulation: the live router's
:class:`~kvpilot.routing.core.RouterCore`, wired by the same constructor with the virtual time
as its clock and never started. Its index is fed the simulated workers' KV events (vLLM's
``BlockStored`` / ``BlockRemoved`` structs, as a live router reads them) and its
:class:`~kvpilot.routing.decide.lifecycle.Lifecycle` books each request as the relay and
Envoy's picker book it (the ledger's dispatch, end of prefill at the first token and
completion; circuits, pair health, session offers and the session's new state at its end).

A request of a session is routed with its session id (the router's session state, affinity
and resting sessions).

A request's tokens are what Dynamo's replay synthesizes: each trace hash id repeated
``tokens_per_hash`` times, cut at the prompt's length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from benchmarks.fleet.trace import TRACE_BLOCK_TOKENS
from benchmarks.sim.engine import EngineSpec, PassResult, SimEngine, SimRequest, Stored
from benchmarks.sim.fleet import Placed
from kvpilot.routing.config import RouterConfig
from kvpilot.routing.core import RouterCore
from kvpilot.routing.decide.lifecycle import Clock, Ticket
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.index.events import BlockRemoved, BlockStored

GPU_MEDIUM = "GPU"
HOST_MEDIUM = "CPU_PINNED"
"""The medium of a worker's host-tier events, as Dynamo's publishers name it
(``StorageTier::HostPinned``; the router's ``index.tiers`` counts it as ``host``)."""
SESSIONS = 100_000
"""Sessions the router keeps (more than any trace here names), with no limit per client."""
NO_POLLS: dict[str, Any] = {"engine_metrics_interval_s": 0.0}
"""The ``server`` section: the simulated workers have no ``/metrics`` to poll."""
PRIORS: dict[str, Any] = {"measured_rates": False}
"""The ``disaggregation`` section's rates: the router prices its choices by the config's
priors, not by rates it learns (the lifecycle still predicts each request's TTFT)."""
DISAGGREGATED: dict[str, Any] = {"max_local_tokens": 0}
"""A disaggregated fleet's ``disaggregation`` section: every request prefilled on P, as
Dynamo's replay and frontend serve one (kvpilot's local prefill on D is the roofline's call
on an H100 preset here, not the mocker's timing, so it is left out of the comparison)."""


def _row(name: str, role: str) -> dict[str, str]:
    return {"name": name, "role": role, "url": f"http://127.0.0.1:1/{name}"}


class KvpilotPlacement:
    """``workers`` co-located workers routed by kvpilot's router with ``cost`` (the config's
    ``cost`` section: Dynamo's names and defaults unless given); with ``prefill_workers``,
    ``workers`` decode workers behind that many prefill workers, every request prefilled on
    P (:data:`DISAGGREGATED`)."""

    def __init__(
        self,
        workers: int,
        spec: EngineSpec,
        cost: Mapping[str, Any] | None = None,
        seed: int = 0,
        tokens_per_hash: int = TRACE_BLOCK_TOKENS,
        prefill_workers: int = 0,
        hears_host_tier: bool = True,
    ) -> None:
        if prefill_workers:
            rows = [_row(f"p{i}", "prefill") for i in range(prefill_workers)]
            rows += [_row(f"d{i}", "decode") for i in range(workers)]
        else:
            rows = [_row(f"w{i}", "colocated") for i in range(workers)]
        sections: dict[str, Any] = {
            "index": {"block_size": spec.block_size},
            "cost": {**(cost or {}), "router_seed": seed},
            "sessions": {"max_sessions": SESSIONS, "max_sessions_per_client": 0},
            "server": NO_POLLS,
            "disaggregation": {**PRIORS, **(DISAGGREGATED if prefill_workers else {})},
            "workers": rows,
        }
        config = msgspec.convert(sections, RouterConfig)
        self.names = [WorkerId(row["name"]) for row in rows]
        self._position = {name: i for i, name in enumerate(self.names)}
        self._prefill_workers = prefill_workers
        self._now_s = 0.0
        self.core = RouterCore(config, fleet_from_config(config), clock=Clock(monotonic=self._clock, wall=self._clock))
        self.index = self.core.index
        self.lifecycle = self.core.lifecycle
        self.router = self.core.router
        self.hears_host_tier = hears_host_tier
        """Whether the index is told what the workers' host tiers store and evict (a vLLM
        engine's offloading connector and Dynamo's KVBM publish it; 1.6.1's mocker does not)."""
        self.block_size = spec.block_size
        self.tokens_per_hash = tokens_per_hash
        self._tokens: dict[int, np.ndarray] = {}
        self._tickets: dict[int, Ticket] = {}
        self.placed: dict[int, int] = {}
        """Each request's worker (its index), by request id."""

    def tokens(self, request: SimRequest) -> np.ndarray:
        """``request``'s synthesized prompt (kept from its placement to its end)."""
        tokens = self._tokens.get(request.rid)
        if tokens is None:
            ids = np.asarray(request.hash_ids, dtype=np.uint32)
            tokens = np.repeat(ids, self.tokens_per_hash)[: request.prompt_len]
        return tokens

    def _clock(self) -> float:
        """The virtual time of the event being simulated, in seconds."""
        return self._now_s

    def place(self, request: SimRequest, prefill: Sequence[SimEngine], decode: Sequence[SimEngine]) -> Placed:
        tokens = self._tokens[request.rid] = self.tokens(request)
        session = SessionId(request.session) if request.session is not None else None
        self._now_s = request.arrival_ms / 1e3
        route = self.router.route(
            tokens.tolist(), str(request.rid), session=session, now=self._now_s
        )  # the HTTP front hands it ints
        ticket = self._tickets[request.rid] = self.lifecycle.dispatch(route, session)
        d = self.placed[request.rid] = self._position[route.decode.name] - self._prefill_workers
        remote = ticket.prefilled_on != route.decode.name
        return (self._position[ticket.prefilled_on] if remote else None), d

    def place_decode(self, request: SimRequest, decode: Sequence[SimEngine]) -> int:
        """The decode worker chosen with the prefill worker on arrival (the router prices the pair)."""
        return self.placed[request.rid]

    def kv_events(self, worker: int, changes: PassResult) -> None:
        name = self.names[worker]
        self._apply(name, changes.stored, changes.evicted, GPU_MEDIUM)
        if self.hears_host_tier:
            self._apply(name, changes.host_stored, changes.host_evicted, HOST_MEDIUM)

    def _apply(self, name: WorkerId, stored: list[Stored], evicted: list[object], medium: str) -> None:
        """One ``BlockStored`` per run of consecutive blocks of one request, then one
        ``BlockRemoved``, in ``medium``."""
        bs = self.block_size
        runs: list[tuple[SimRequest, int, int]] = []  # (request, first block, last block): one event each
        for request, block in stored:
            if runs and runs[-1][0] is request and runs[-1][2] == block - 1:
                runs[-1] = (request, runs[-1][1], block)
            else:
                runs.append((request, block, block))
        for request, first, last in runs:
            tokens = self.tokens(request)[first * bs : (last + 1) * bs]
            parent = request.blocks[first - 1] if first else None
            hashes = [request.blocks[j] for j in range(first, last + 1)]
            event = BlockStored(hashes, parent, tokens.tolist(), bs, medium=medium)  # type: ignore[arg-type]
            self.index.apply(name, event)
        if evicted:
            self.index.apply(name, BlockRemoved(list(evicted), medium=medium))  # type: ignore[arg-type]

    def first_token(self, request: SimRequest) -> None:
        """``request``'s prefill is over (P's copy finished, or D's first token)."""
        self.lifecycle.prefill_over(self._tickets[request.rid])

    def finished(self, request: SimRequest) -> None:
        self._now_s = request.token_ms[-1] / 1e3
        self.lifecycle.finished(self._tickets.pop(request.rid), answered=True)
        self._tokens.pop(request.rid, None)
