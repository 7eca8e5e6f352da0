"""The compiled core (routing/native) against the Python router, request by request, on the
simulator's traces: every block key, every worker's match per medium, every candidate's
overlap and cost, and the chosen worker (the Python router's pick must be one of the C core's
lowest-cost eligible rows; where one row is cheapest, the same row). Both indexes are fed the
same simulated KV events (GPU and host tiers), and the C core prices with the Python ledger's
loads, so any difference in hash, index, match or cost fails the test."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.fleet.trace import TRACES_DIR, load_trace
from benchmarks.sim.engine import EngineSpec
from benchmarks.sim.fleet import DEFAULT_SPEC, simulate
from benchmarks.sim.kvpilot import KvpilotPlacement
from kvpilot.routing.index import chain
from kvpilot.routing.index.events import BlockRemoved, BlockStored

native = pytest.importorskip("kvpilot.routing.native")
try:
    native.load()
except native.NativeUnavailable as exc:  # pragma: no cover - make setup builds it
    pytest.skip(str(exc), allow_module_level=True)

MASK64 = (1 << 64) - 1


def _cost_config(cfg: Any) -> native.CostConfig:
    fields = {name: getattr(cfg, name) for name, _ in native.CostConfig._fields_}
    return native.CostConfig(**fields)


class Mirror:
    """Feeds a NativeIndex the events the Python index gets and checks each route."""

    def __init__(self, placement: KvpilotPlacement) -> None:
        self.placement = placement
        router = placement.router
        self.media = list(router.config.index.tiers)
        self.classes = np.array([native.TIER_CLASSES[router.config.index.tiers[m].value] for m in self.media])
        bs = placement.block_size
        self.index = native.NativeIndex(
            bs, len(placement.names), self.media, chain._lanes(bs), int(chain._POSITION_LANE)
        )
        self.worker = {name: i for i, name in enumerate(placement.names)}
        self.stats: Counter[str] = Counter()
        self._apply, self._route = placement.index.apply, router.route
        placement.index.apply = self.apply  # type: ignore[method-assign]
        router.route = self.route  # type: ignore[method-assign]

    def apply(self, worker: Any, event: Any) -> str:
        outcome = self._apply(worker, event)
        w, m = self.worker[worker], self.media.index(event.medium)
        hashes = np.array([h & MASK64 for h in event.block_hashes], dtype=np.uint64)
        if isinstance(event, BlockStored):
            parent = None if event.parent_block_hash is None else event.parent_block_hash & MASK64
            ours = self.index.store(w, m, hashes, parent, event.block_size, np.asarray(event.token_ids))
        else:
            assert isinstance(event, BlockRemoved)
            ours = self.index.remove(w, m, hashes)
        assert ours == outcome or (outcome == "applied" and ours == "applied"), (event, outcome, ours)
        self.stats[f"event_{ours}"] += 1
        return outcome

    def route(self, token_ids: Sequence[int], request_id: str, **kwargs: Any) -> Any:
        route = self._route(token_ids, request_id, **kwargs)
        tokens = np.asarray(token_ids, dtype=np.uint32)
        keys = self.index.chain_keys(tokens)
        assert keys.tolist() == route.chain.keys(len(keys))[: len(keys)], request_id
        depths = self.index.match(tokens)
        theirs = {w: dict(t) for w, t in route.match.blocks.items()}
        ours = {
            self.placement.names[w]: {self.media[m]: int(d) for m, d in enumerate(row) if d}
            for w, row in enumerate(depths)
            if row.any()
        }
        assert ours == theirs, (request_id, ours, theirs)
        table = route.decision.table
        rows = [self.worker[name] for name in table.names]
        overlap = native.tier_overlaps(depths, self.classes)[rows]
        assert np.array_equal(overlap, table.overlap), (request_id, overlap, table.overlap)
        loads = [
            native.Load(
                *table.load[i], table.pair_penalty_blocks[i], table.resident_blocks[i], bool(table.session_affinity[i])
            )
            for i in range(len(table))
        ]
        costs, ties = native.price(_cost_config(self.placement.router.cost.cfg), route.prompt_blocks, overlap, loads)
        assert np.array_equal(costs, route.decision.columns.cost), (request_id, costs, route.decision.columns.cost)
        assert route.decision.index in ties, (request_id, route.decision.index, ties)
        self.stats["routes"] += 1
        self.stats["unique_choice" if len(ties) == 1 else "tied_choice"] += 1
        self.stats["matched_routes"] += bool(ours)
        self.stats["host_credited"] += bool(overlap[:, 1].any())
        return route


def _run(trace: list[Any], workers: int, spec: EngineSpec = DEFAULT_SPEC) -> Counter[str]:
    placement = KvpilotPlacement(workers, spec)
    mirror = Mirror(placement)
    simulate(trace, workers, placement, spec=spec)
    return mirror.stats


@pytest.mark.parametrize("trace", ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"])
def test_the_c_core_decides_as_the_python_router_on_the_mooncake_traces(trace: str, tmp_path: Path) -> None:
    lines = (TRACES_DIR / trace).read_text().splitlines()[:600]
    path = tmp_path / trace
    path.write_text("\n".join(lines) + "\n")
    stats = _run(load_trace(path), 8)
    assert stats["routes"] == 600
    assert stats["matched_routes"] > 30 and stats["unique_choice"] > 60, stats  # the test bites
    assert stats["event_applied"] > 1000, stats


def test_the_c_core_decides_as_the_python_router_on_a_memory_pressured_fleet(tmp_path: Path) -> None:
    """Few GPU blocks and a host tier: prefixes evicted to host are credited at the host weight."""
    lines = (TRACES_DIR / "mooncake_conversation_trace.jsonl").read_text().splitlines()[:600]
    path = tmp_path / "slice.jsonl"
    path.write_text("\n".join(lines) + "\n")
    spec = replace(DEFAULT_SPEC, num_gpu_blocks=1200, num_host_blocks=20_000, kv_bytes_per_token=131_072)
    stats = _run(load_trace(path), 8, spec)
    assert stats["routes"] == 600
    assert stats["host_credited"] > 50 and stats["unique_choice"] > 100, stats


def test_the_c_core_decides_as_the_python_router_on_agent_sessions() -> None:
    """Sessions: the affinity credit, the residency charge and ``eligible``'s rows."""
    from benchmarks.agent.trace import AgentShape, agent_trace

    trace = agent_trace(AgentShape(sessions=16, steps=6, shared_prefix=16_000, session_gap_s=0.5))
    stats = _run(trace, 8)
    assert stats["routes"] == len(trace)
    assert stats["unique_choice"] > len(trace) // 2, stats
