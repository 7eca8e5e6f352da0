"""The arms :mod:`benchmarks.sim.goodput` sweeps, each run at one offered rate (:class:`Point`)
into its requests' times (:class:`Served`): kvpilot's router in the simulator
(:func:`simulated_arm`, its host tiers as :class:`Tiers` says) and Dynamo's replay
(:func:`dynamo_arm`)."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.fleet.trace import TraceRequest
from benchmarks.sim.compare import RouterMode, replay_rows
from benchmarks.sim.engine import EngineSpec, SimRequest, recompute_ms_per_block, restore_ms_per_block
from benchmarks.sim.fleet import DEFAULT_SPEC, Pools, simulate
from benchmarks.sim.kvpilot import KvpilotPlacement
from benchmarks.sim.slo import arrival_order, request_times
from kvpilot.policies.tier_credit import restore_credit

UNTIERED = "kvpilot_without_tiers"
"""The arm of kvpilot on workers without host tiers, which a tiered run's kvpilot is also held against."""


class Tiers(str, enum.Enum):
    """What a simulated kvpilot arm makes of a fleet with host tiers (``--host-blocks``)."""

    HEARD = "heard"
    """The workers keep their host tiers and the router hears their events (as from vLLM's
    offloading connector or Dynamo's KVBM), crediting a host block by what its restore saves."""
    BLIND = "blind"
    """The workers keep their host tiers; the router hears GPU events only (as from 1.6.1's
    mocker, which Dynamo's replay arms run): what hearing the tier is worth."""
    NONE = "none"
    """The workers have no host tier: kvpilot as it was."""


@dataclass(frozen=True, slots=True)
class Point:
    """One offered rate: the trace both sides run (``path``: as Dynamo's replay reads it) and
    the arrival compression both apply."""

    label: str
    load: float
    """What sets the rate: sessions per worker (the agent) or the arrivals' compression."""
    trace: list[TraceRequest]
    path: Path
    speedup: float

    @property
    def rate_rps(self) -> float:
        span_s = (self.trace[-1].timestamp_ms - self.trace[0].timestamp_ms) / 1e3
        return len(self.trace) / (span_s / self.speedup)


@dataclass(frozen=True, slots=True)
class Served:
    """Per request in :func:`arrival_order`: TTFT (ms), mean ITL (ms; ``None`` for one
    token) and the worker that decoded it."""

    ttft_ms: list[float]
    itl_ms: list[float | None]
    workers: list[int]
    computed_tokens: int
    """Prompt tokens prefilled (the rest were reused from a GPU or host tier)."""
    host_reused_tokens: int
    """Prompt tokens restored from the workers' host tiers."""


Arm = Callable[[Point, Pools], Served]


def turns(trace: Sequence[TraceRequest]) -> list[tuple[str | None, int]]:
    """Each request's session and its place in it (0 first; every request of no session is 0)."""
    seen: Counter[str | None] = Counter()
    out = []
    for entry in trace:
        out.append((entry.session_id, seen[entry.session_id] if entry.session_id is not None else 0))
        if entry.session_id is not None:
            seen[entry.session_id] += 1
    return out


def simulated_arm(cost: dict[str, Any] | None = None, tiers: Tiers = Tiers.HEARD, pressure: bool = True) -> Arm:
    """kvpilot's router in the simulator, its ``cost`` section ``cost`` (its defaults:
    ``None``), on workers whose host tiers (where the fleet has them) are as ``tiers`` says;
    ``pressure`` False: with the mocker's default GPU blocks instead of the fleet's."""

    def run(point: Point, pools: Pools) -> Served:
        requests: list[SimRequest] = []
        spec = pools.spec if tiers is not Tiers.NONE else replace(pools.spec, num_host_blocks=0)
        if not pressure:
            spec = replace(spec, num_gpu_blocks=DEFAULT_SPEC.num_gpu_blocks)
        placement = KvpilotPlacement(
            pools.workers, spec, cost, prefill_workers=pools.prefill_workers, hears_host_tier=tiers is Tiers.HEARD
        )
        simulate(
            point.trace,
            pools.workers,
            placement,
            spec,
            arrival_speedup=point.speedup,
            requests_out=requests,
            prefill_workers=pools.prefill_workers,
            transfer=pools.handoff,
        )
        ordered = [requests[i] for i in arrival_order(point.trace)]
        ttft, itl = request_times(ordered)
        return Served(
            ttft,
            itl,
            [placement.placed[r.rid] for r in ordered],
            sum(r.prompt_len - r.reused_tokens for r in requests),
            sum(r.host_reused_tokens for r in requests),
        )

    return run


def host_credit(spec: EngineSpec) -> dict[str, float]:
    """kvpilot's cost section on workers with ``spec``'s host tier: a host block credited by
    the share of its prefill a restore saves (:func:`kvpilot.policies.tier_credit.restore_credit`),
    not Dynamo's preset 0.75."""
    return {"host_cache_hit_weight": restore_credit(restore_ms_per_block(spec), recompute_ms_per_block(spec))}


def dynamo_arm(mode: RouterMode, router_config: dict[str, Any] | None = None) -> Arm:
    """Dynamo's replay with ``router_mode`` ``mode`` (and KV router options ``router_config``).
    Its records are paired with the trace's requests by session and turn (its arrivals of a
    session's later turns are its own), else by arrival, prompt and output length."""

    def run(point: Point, pools: Pools) -> Served:
        rows = replay_rows(
            point.path,
            pools.workers,
            pools.spec.block_size,
            mode,
            point.speedup,
            router_config,
            prefill_workers=pools.prefill_workers,
            transfer=pools.handoff,
            spec=pools.spec,
        )
        order = arrival_order(point.trace)
        if any(e.session_id for e in point.trace):
            by_turn = {(r["session_id"], r["turn_index"]): r for r in rows}
            keys = turns(point.trace)
            ordered = [by_turn[keys[i]] for i in order]
        else:
            ordered = sorted(
                rows, key=lambda r: (r["arrival_time_ms"], r["input_length"], r["requested_output_length"])
            )
        return Served(
            [r["ttft_ms"] for r in ordered],
            [r["itl_ms"] if r["output_length"] > 1 else None for r in ordered],
            [r["decode_worker_idx"] for r in ordered],
            sum(r["input_length"] - r["reused_input_tokens"] for r in rows),
            sum(r.get("first_admission_host_reused_input_tokens") or 0 for r in rows),
        )

    return run
