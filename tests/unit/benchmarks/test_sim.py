"""The simulator's engines against Dynamo's own offline replay (Dynamo 1.6.1's mocker model),
the same trace slice, the same engine parameters, round robin on both sides."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fleet.trace import TRACES_DIR, load_trace
from benchmarks.sim.engine import EngineSpec, PassResult, SimEngine, SimRequest, prefill_ms
from benchmarks.sim.fleet import RoundRobin, simulate


def test_one_request_alone_pays_its_prefill_then_one_decode_step_a_token() -> None:
    engine = SimEngine(EngineSpec())
    request = SimRequest(0, 4834, 3, [object() for _ in range(4834 // 64)], 0.0)
    engine.submit(request)
    first = engine.run_pass(0.0)
    assert first.end_ms == pytest.approx(prefill_ms(4834)) == pytest.approx(99.7359, abs=1e-3)  # Dynamo's replay
    engine.finish_pass(first)
    second = engine.run_pass(first.end_ms)
    assert second.end_ms - first.end_ms == pytest.approx(
        5.74 + 54.01 * (4835 / (16384 * 64)) - 25.74 * (4835 / (16384 * 64)) ** 2
    )


@pytest.mark.parametrize("trace", ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"])
def test_round_robin_matches_dynamo_s_replay_within_one_percent(trace: str, tmp_path: Path) -> None:
    replay = pytest.importorskip("dynamo.replay")  # kvpilot[dynamo]: make setup installs it
    lines = (TRACES_DIR / trace).read_text().splitlines()[:600]
    path = tmp_path / trace
    path.write_text("\n".join(lines) + "\n")
    ours = simulate(load_trace(path), 4, RoundRobin()).summary()
    report = replay.run_trace_replay(
        str(path),
        extra_engine_args={"engine": {"block_size": 64}},
        num_workers=4,
        router_mode="round_robin",
        capture_per_request=True,
    )
    rows = report.per_request
    theirs = {
        "mean_ttft_ms": report.summary["mean_ttft_ms"],
        "mean_itl_ms": statistics.fmean(r["itl_ms"] for r in rows if r["output_length"] > 1),
        "reuse": sum(r["reused_input_tokens"] for r in rows) / sum(r["input_length"] for r in rows),
    }
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=0.01), (key, ours[key], value)


@pytest.mark.parametrize("trace", ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"])
def test_kvpilot_s_router_in_the_simulator_matches_dynamo_s_kv_router_within_five_percent(
    trace: str, tmp_path: Path
) -> None:
    """The router side: kvpilot's ``Router`` (Dynamo's cost and weights, its own index fed the
    simulated workers' KV events) against Dynamo's KV router in its replay. Dynamo's breaks ties
    at random, so its own replays differ (ITL by up to 6% on this slice): kvpilot's figure must
    lie within 5% of the range of five replays."""
    pytest.importorskip("dynamo.replay")
    from benchmarks.sim.compare import DYNAMO_WEIGHTS, dynamo_replay
    from benchmarks.sim.fleet import DEFAULT_SPEC
    from benchmarks.sim.kvpilot import KvpilotPlacement

    lines = (TRACES_DIR / trace).read_text().splitlines()[:2000]
    path = tmp_path / trace
    path.write_text("\n".join(lines) + "\n")
    ours = simulate(load_trace(path), 8, KvpilotPlacement(8, DEFAULT_SPEC, DYNAMO_WEIGHTS)).summary()
    replays = [dynamo_replay(path, 8, DEFAULT_SPEC.block_size, "kv_router") for _ in range(5)]
    for key in ("mean_ttft_ms", "mean_itl_ms", "reuse"):
        low, high = min(r[key] for r in replays), max(r[key] for r in replays)
        assert 0.95 * low <= ours[key] <= 1.05 * high, (key, ours[key], low, high)
    assert ours["reuse"] > simulate(load_trace(path), 8, RoundRobin()).summary()["reuse"]  # it routes by prefix


@pytest.mark.parametrize("routing", ["round_robin", "kv_router"])
def test_a_disaggregated_fleet_matches_dynamo_s_replay(routing: str, tmp_path: Path) -> None:
    """2 P + 4 D, each handoff moving 128 KiB a token (llama-8b's KV in bf16) at 50 GB/s, its
    delay priced as the mocker prices it: round robin within 1%; kvpilot's router (every
    request prefilled on P, as Dynamo's), the mean of three seeds, within 5% of the range of
    five of Dynamo's KV router replays (both break ties at random; its decode router weighs
    load alone, kvpilot's the pair's cost)."""
    pytest.importorskip("dynamo.replay")
    from benchmarks.sim.compare import DYNAMO_WEIGHTS, replay_rows
    from benchmarks.sim.fleet import DEFAULT_SPEC, KvTransfer
    from benchmarks.sim.kvpilot import KvpilotPlacement

    lines = (TRACES_DIR / "mooncake_conversation_trace.jsonl").read_text().splitlines()[:600]
    path = tmp_path / "slice.jsonl"
    path.write_text("\n".join(lines) + "\n")
    transfer = KvTransfer(bandwidth_gb_s=50.0, bytes_per_token=131072)
    keys = ("mean_ttft_ms", "mean_itl_ms", "reuse")
    runs = [
        simulate(load_trace(path), 4, placement, prefill_workers=2, transfer=transfer).summary()
        for placement in (
            [RoundRobin()]
            if routing == "round_robin"
            else [KvpilotPlacement(4, DEFAULT_SPEC, DYNAMO_WEIGHTS, seed=seed, prefill_workers=2) for seed in range(3)]
        )
    ]
    ours = {key: statistics.fmean(run[key] for run in runs) for key in keys}
    replays = []
    for _ in range(1 if routing == "round_robin" else 5):
        rows = replay_rows(path, 4, DEFAULT_SPEC.block_size, routing, prefill_workers=2, transfer=transfer)  # type: ignore[arg-type]
        replays.append(
            {
                "mean_ttft_ms": statistics.fmean(r["ttft_ms"] for r in rows),
                "mean_itl_ms": statistics.fmean(r["itl_ms"] for r in rows if r["output_length"] > 1),
                "reuse": sum(r["reused_input_tokens"] for r in rows) / sum(r["input_length"] for r in rows),
            }
        )
    slack = 0.01 if routing == "round_robin" else 0.05
    for key in keys:
        low, high = min(r[key] for r in replays), max(r[key] for r in replays)
        assert (1 - slack) * low <= ours[key] <= (1 + slack) * high, (key, ours[key], low, high)


def test_goodput_is_the_highest_rate_met_by_90_percent_and_every_slower_one() -> None:
    from benchmarks.fleet.goodput import SweepPoint, goodput
    from benchmarks.sim.goodput import Floor, attainment

    def sweep(*points: tuple[float, float]) -> list[SweepPoint]:
        return [SweepPoint(rate, share) for rate, share in points]

    assert goodput(sweep((1.0, 0.99), (2.0, 0.95), (4.0, 0.91), (8.0, 0.5))) == 4.0
    assert goodput(sweep((1.0, 0.99), (2.0, 0.85), (4.0, 0.95))) == 1.0  # a miss ends the sweep
    assert goodput(sweep((1.0, 0.5))) == 0.0
    base = Floor([100.0, 100.0, 100.0, 100.0], [6.0, 6.0, 6.0, 6.0])
    # TTFT 5x and ITL 2x are met; one request over each; one output token has no ITL to miss
    assert attainment([500.0, 501.0, 100.0, 100.0], [12.0, 6.0, 12.1, None], base) == 0.5


def test_a_request_s_floor_is_its_new_tokens_prefill_alone() -> None:
    from benchmarks.fleet.trace import TraceRequest
    from benchmarks.sim.goodput import floor

    first = TraceRequest(0, 1024, 8, (1, 2))
    second = TraceRequest(5, 1536, 8, (1, 2, 3))  # shares 1,024 tokens with the first
    base = floor([first, second])
    assert base.ttft_ms[0] == pytest.approx(prefill_ms(1024))
    assert base.ttft_ms[1] == pytest.approx(prefill_ms(512))


def _placements(cost: dict[str, object]) -> dict[str, list[int]]:
    """Each session's workers, step by step, for 16 agents on 8 simulated workers."""
    from benchmarks.agent.trace import AgentShape, agent_trace
    from benchmarks.sim.fleet import DEFAULT_SPEC
    from benchmarks.sim.kvpilot import KvpilotPlacement

    trace = agent_trace(AgentShape(sessions=16, steps=6, shared_prefix=16_000, session_gap_s=0.5))
    placement = KvpilotPlacement(8, DEFAULT_SPEC, cost)
    simulate(trace, 8, placement)
    steps: dict[str, list[int]] = {}
    for rid, entry in enumerate(trace):
        assert entry.session_id is not None
        steps.setdefault(entry.session_id, []).append(placement.placed[rid])
    return steps


def test_kvpilot_places_each_agent_for_its_later_steps_and_keeps_it_there() -> None:
    """kvpilot's session terms: the 16 agents spread two per worker and never move. With
    Dynamo's cost (kvpilot's session terms off) they pile on the workers that hold the prefix
    and leave them when busy, prefilling their history again elsewhere."""
    from benchmarks.sim.compare import DYNAMO_WEIGHTS

    ours = _placements({})
    assert all(len(set(workers)) == 1 for workers in ours.values())
    assert sorted(Counter(workers[0] for workers in ours.values()).values()) == [2] * 8
    dynamos = _placements(DYNAMO_WEIGHTS)
    moved = sum(len(set(workers)) > 1 for workers in dynamos.values())
    crowded = max(Counter(workers[0] for workers in dynamos.values()).values())
    assert moved > 0 and crowded > 2, (moved, crowded)


def test_a_live_run_is_predicted_arm_by_arm_on_its_scaled_trace(tmp_path: Path) -> None:
    """``sim_live.py`` on a fleet results file: its trace scaled as the run scaled it, each
    arm predicted by its counterpart, next to what the run measured."""
    from benchmarks.agent.trace import AgentShape, agent_trace, to_jsonl
    from benchmarks.sim.live import predict, table

    trace = tmp_path / "agent.jsonl"
    trace.write_text(to_jsonl(agent_trace(AgentShape(sessions=4, steps=3, shared_prefix=4096))))
    measured = {
        "ttft_mean_s": 0.05,
        "itl_mean_s": 0.002,
        "frontend_ttft_mean_s": 0.04,
        "slo_attainment": 0.95,
        "offered_rps": 3.0,
    }
    results = {
        "run": {
            "argv": ["benchmarks/bench_fleet.py", "--rate-scale", "2"],
            "workload": {"trace": str(trace), "requests": 12, "tokens_per_hash": 128, "block_size": 32},
            "fleet": {"workers": 2},
            "speedup": 1.0,
            "kvpilot_cost": {},
            "slo": {"ttft_x_floor": 5.0},
        },
        "kvpilot": measured,
        "dynamo_round_robin": measured,
        "dynamo_kv": measured,
    }
    rows = predict(results, tmp_path)
    assert [r["arm"] for r in rows] == ["kvpilot", "dynamo_round_robin", "dynamo_kv"]
    for row in rows:
        assert 0 < row["predicted"]["mean_ttft_ms"] < 10_000 and row["live"]["mean_ttft_ms"] == 50.0
        assert 0.0 <= row["predicted"]["attainment"] <= 1.0 and row["live"]["attainment"] == 0.95
    assert "kvpilot's router, simulated" in table(rows)
    # An absolute SLO is not predicted (the simulator judges by the floor).
    absolute = predict({**results, "run": {**results["run"], "slo": {"ttft_s": 0.2}}}, tmp_path)
    assert all(r["predicted"]["attainment"] is None for r in absolute)


def test_a_sweep_of_live_runs_gives_each_arm_s_goodput_live_and_predicted() -> None:
    from benchmarks.sim.live import goodputs

    def row(arm: str, rate: float, live: float, predicted: float) -> dict[str, Any]:
        return {"arm": arm, "live": {"offered_rps": rate, "attainment": live}, "predicted": {"attainment": predicted}}

    runs = [
        [row("kvpilot", 5.0, 0.95, 0.97), row("dynamo_kv", 5.0, 0.92, 0.85)],
        [row("kvpilot", 10.0, 0.93, 0.91), row("dynamo_kv", 10.0, 0.7, 0.8)],
    ]
    assert goodputs(runs) == {
        "dynamo_kv": {"live": 5.0, "predicted": 0.0},
        "kvpilot": {"live": 10.0, "predicted": 10.0},
    }


def test_placement_stats_count_moves_and_the_most_crowded_worker() -> None:
    from benchmarks.fleet.trace import TraceRequest
    from benchmarks.sim.goodput import placement_stats, turns

    def step(at: int, session: str) -> TraceRequest:
        return TraceRequest(at, 100, 10, (1,), session)

    trace = [step(0, "a"), step(1, "b"), step(2, "a"), step(3, "b"), step(4, "a")]
    assert turns(trace) == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]
    # a: 0 -> 0 -> 1 (one move); b: 0 -> 2 (one move); both first steps on worker 0
    assert placement_stats(trace, [0, 0, 0, 2, 1]) == {"moved_steps": 2, "most_sessions_on_one_worker": 2}


def test_kvpilot_is_held_against_dynamo_s_best_arm_a_tie_going_to_the_tuned_one() -> None:
    from benchmarks.fleet.goodput import GoodputBounds
    from benchmarks.sim.goodput import best_dynamo_arm

    inf = float("inf")

    def arms(**brackets: tuple[float, float]) -> dict[str, GoodputBounds]:
        return {name: GoodputBounds(lo, hi, True) for name, (lo, hi) in brackets.items()}

    tie = arms(kvpilot=(5, inf), dynamo_kv=(3, 4), dynamo_kv_tuned=(3, 4), dynamo_round_robin=(0, 1))
    assert best_dynamo_arm(tie, tuned=True) == "dynamo_kv_tuned"
    tuned_worse = arms(kvpilot=(5, inf), dynamo_kv=(4, 5), dynamo_kv_tuned=(3, 4), dynamo_cost_pinned=(4, 5))
    assert best_dynamo_arm(tuned_worse, tuned=True) == "dynamo_kv"  # the default beats the tuned one here
    # held against the arm whose goodput may be highest: the higher upper end, not the higher lower end
    wider = arms(kvpilot=(5, inf), dynamo_kv=(3, 8), dynamo_cost_pinned=(4, 5))
    assert best_dynamo_arm(wider, tuned=False) == "dynamo_kv"
    assert (
        best_dynamo_arm(arms(kvpilot=(1, 2), dynamo_kv=(0, 1), dynamo_round_robin=(0, 1)), tuned=False) == "dynamo_kv"
    )
    variants = arms(kvpilot=(1, 2), kvpilot_without_tiers=(3, 4), kvpilot_tier_blind=(3, 4), dynamo_kv=(0.5, 1))
    assert best_dynamo_arm(variants, tuned=False) == "dynamo_kv"  # kvpilot's own variants are not Dynamo's


def test_a_goodput_bracket_and_the_ratio_it_supports() -> None:
    from benchmarks.fleet.goodput import SweepPoint, at_least, at_most, bounds

    ours = bounds([SweepPoint(5.2, 0.95), SweepPoint(10.5, 0.96), SweepPoint(22.4, 0.95)])
    assert (ours.lower, ours.upper, ours.monotone) == (22.4, float("inf"), True)
    tuned = bounds([SweepPoint(5.2, 0.856), SweepPoint(10.5, 0.984), SweepPoint(22.4, 0.5)])
    assert (tuned.lower, tuned.upper, tuned.monotone) == (0.0, 5.2, False)  # met again above its first miss
    defaults = bounds([SweepPoint(5.2, 0.95), SweepPoint(10.5, 0.88)])
    assert at_least(ours, defaults) == 22.4 / 10.5  # our lower end over their upper end, not 22.4 / 5.2
    assert at_least(defaults, ours) is None  # ours never missed: no ratio to claim against it
    assert at_most(defaults, ours) == 10.5 / 22.4


def test_bisection_narrows_a_closed_bracket_to_the_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.sim.goodput as module

    capacity = 7.3  # an arm that meets the SLOs below this rate and misses from it on

    def row(rate: float) -> dict[str, float]:
        return {"rate_rps": rate, "load": rate, "attainment": 0.95 if rate < capacity else 0.5}

    @dataclass
    class Point:
        rate_rps: float

    measured: list[float] = []

    def measure(point: Point, pools: object, arms: dict[str, object]) -> dict[str, dict[str, float]]:
        measured.append(point.rate_rps)
        return {name: row(point.rate_rps) for name in arms}

    monkeypatch.setattr(module, "measure", measure)
    rows = [row(r) for r in (2.0, 4.0, 16.0)]
    module.bisect(rows, "kvpilot", lambda point, pools: None, Point, None, resolution=0.05)
    found = module.arm_bounds(rows)
    assert found.lower < capacity <= found.upper and found.resolution <= 0.05
    assert 0 < len(measured) <= 8 and [r["rate_rps"] for r in rows] == sorted(r["rate_rps"] for r in rows)
    open_above = [row(1.0), row(2.0)]
    module.bisect(open_above, "kvpilot", lambda point, pools: None, Point, None, resolution=0.05)
    assert len(open_above) == 2  # never missed: nothing to bisect


@pytest.mark.parametrize(("host_blocks", "gb_s"), [(4800, 4.0), (3200, 8.0)])
def test_the_host_tier_matches_dynamo_s_replay_with_host_offload_within_five_percent(
    host_blocks: int, gb_s: float, tmp_path: Path
) -> None:
    """32 agents of 8 steps on 2 workers of 1,600 GPU blocks (sessions return after other
    traffic evicted their history from the GPU; no request waits for blocks, none is
    preempted), each worker with a host tier of 3x (no host eviction) or 2x (evicting) its GPU
    blocks, 128 KiB a token (llama-8b, bf16) at 4 or 8 GB/s, so restores cost real time; round
    robin on both sides. Mean TTFT, mean ITL, reuse (GPU and host hits) and the host-reused
    tokens within 5% of Dynamo's replay; and the host tier changes the result: without it
    reuse falls and no token is restored."""
    pytest.importorskip("dynamo.replay")
    from benchmarks.agent.trace import AgentShape, agent_trace, to_jsonl
    from benchmarks.sim.compare import replay_rows, summarize

    path = tmp_path / "agents.jsonl"
    path.write_text(to_jsonl(agent_trace(AgentShape(sessions=32, steps=8, shared_prefix=2048, tool_output=1000))))
    spec = EngineSpec(
        num_gpu_blocks=1600,
        cache_generated_blocks=True,
        num_host_blocks=host_blocks,
        kv_bytes_per_token=131072,
        h2d_gb_s=gb_s,
        d2h_gb_s=gb_s,
    )
    report = simulate(load_trace(path), 2, RoundRobin(), spec=spec)
    assert report.blocked_admissions == 0  # the simulator does not preempt: no request waited for blocks
    ours = report.summary()
    rows = replay_rows(path, 2, spec.block_size, "round_robin", spec=spec)
    assert not any(r["readmission_count"] for r in rows)  # nor did the replay preempt one
    theirs = summarize(rows)
    for key in ("mean_ttft_ms", "mean_itl_ms", "reuse", "host_reused_tokens"):
        assert ours[key] == pytest.approx(theirs[key], rel=0.05), (key, ours[key], theirs[key])
    without = simulate(
        load_trace(path), 2, RoundRobin(), spec=EngineSpec(num_gpu_blocks=1600, cache_generated_blocks=True)
    )
    assert ours["host_reused_tokens"] > 0.05 * ours["reuse"] * sum(r["input_length"] for r in rows)
    assert without.summary()["host_reused_tokens"] == 0.0
    assert ours["reuse"] > 1.1 * without.summary()["reuse"], (ours["reuse"], without.summary()["reuse"])


def test_the_host_tier_s_events_reach_kvpilot_s_index_as_its_host_tier() -> None:
    """On workers whose host tiers evict (2x the GPU's blocks), every block a host tier
    stores or evicts is an event of medium ``CPU_PINNED`` that kvpilot's index applies (none
    is dropped for an unknown parent), so the index holds exactly what the tiers hold; a
    router that does not hear the tier (``hears_host_tier=False``) holds none of it."""
    from benchmarks.agent.trace import AgentShape, agent_trace
    from benchmarks.sim.kvpilot import HOST_MEDIUM, KvpilotPlacement
    from kvpilot.routing.ids import Tier

    class Tally(KvpilotPlacement):
        def __init__(self, workers: int, spec: EngineSpec) -> None:
            super().__init__(workers, spec)
            self.held: Counter[int] = Counter()
            self.host_evictions = 0

        def kv_events(self, worker: int, changes: PassResult) -> None:
            super().kv_events(worker, changes)
            self.held[worker] += len(changes.host_stored) - len(changes.host_evicted)
            self.host_evictions += len(changes.host_evicted)

    trace = agent_trace(AgentShape(sessions=32, steps=8, shared_prefix=2048, tool_output=1000))
    spec = EngineSpec(num_gpu_blocks=1600, cache_generated_blocks=True, num_host_blocks=1600, kv_bytes_per_token=131072)
    heard = Tally(2, spec)
    simulate(trace, 2, heard, spec=spec)
    assert heard.host_evictions > 0
    counts = [heard.index.block_count(name, Tier(HOST_MEDIUM)) for name in heard.names]
    assert counts == [heard.held[0], heard.held[1]] and min(counts) > 0 and max(counts) <= 1600, counts
    assert heard.index.counters["unknown_parent"] == 0
    blind = KvpilotPlacement(2, spec, hears_host_tier=False)
    simulate(trace, 2, blind, spec=spec)
    assert [blind.index.block_count(name, Tier(HOST_MEDIUM)) for name in blind.names] == [0, 0]
