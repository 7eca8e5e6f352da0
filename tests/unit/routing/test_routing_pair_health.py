"""kvpilot.routing.health.pair_health: a (P, D) pair's recent transfer failures and transfer time raise
its cost; failures age out; an engine's counters are shared among the pairs it served."""

from __future__ import annotations

import random

import pytest

from kvpilot.routing.config import ConfigError, CostConfig, prior_model
from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.router import Router, policy_from_config
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.event_watch import EventWatch
from kvpilot.routing.health.pair_health import ATTRIBUTION_WINDOW_S, PairHealth, TransferCounters
from kvpilot.routing.health.view import FleetHealth
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.ingest.engine_metrics import parse_engine_load
from tests.unit.routing.test_routing_router import _config, _prompt, _w

P1, P2, D = WorkerId("p1"), WorkerId("p2"), WorkerId("d")
CFG = CostConfig(pair_failure_cost_blocks=32.0, pair_failure_half_life_s=60.0, pair_transfer_cost_blocks_per_s=64.0)


def test_a_failure_costs_its_blocks_and_halves_every_half_life():
    health = PairHealth(CFG)
    health.failed(P1, D, now=0.0)
    assert health.penalty_blocks(P1, D, 0.0) == pytest.approx(32.0)
    assert health.penalty_blocks(P1, D, 60.0) == pytest.approx(16.0)
    assert health.penalty_blocks(P1, D, 600.0) < 0.05
    assert health.penalty_blocks(P2, D, 0.0) == 0.0  # another pair is untouched
    health.failed(P1, D, now=60.0)
    assert health.penalty_blocks(P1, D, 60.0) == pytest.approx(48.0)
    assert health.penalties(60.0) == {(P1, D): pytest.approx(48.0)}  # only the pairs seen


@pytest.mark.parametrize(
    ("case", "routed", "before", "after", "p1_penalty", "p2_penalty"),
    [
        (
            "D's failed transfer, one pair served: all of it",
            [(P1, D)],
            TransferCounters(),
            TransferCounters(failures=1),
            32.0,
            0.0,
        ),
        (
            "D's failed transfers, two pairs served: shared",
            [(P1, D), (P2, D)],
            TransferCounters(),
            TransferCounters(failures=2),
            32.0,
            32.0,
        ),
        (
            "expired leases count as failures",
            [(P1, D)],
            TransferCounters(),
            TransferCounters(expired_leases=1),
            32.0,
            0.0,
        ),
        (
            "mean transfer time of the interval",
            [(P1, D)],
            TransferCounters(transfer_seconds=1.0, transfers=10),
            TransferCounters(transfer_seconds=3.0, transfers=14),
            64.0 * 0.5,
            0.0,
        ),
        (
            "a counter that went down is a restart: a new baseline",
            [(P1, D)],
            TransferCounters(failures=5),
            TransferCounters(failures=1),
            0.0,
            0.0,
        ),
        ("nothing served since: nothing to blame", [], TransferCounters(), TransferCounters(failures=3), 0.0, 0.0),
    ],
)
def test_an_engines_counters_are_shared_among_the_pairs_it_served(case, routed, before, after, p1_penalty, p2_penalty):
    health = PairHealth(CFG)
    health.observe(D, before, at=0.0)  # the baseline
    for pair in routed:
        health.routed(*pair, now=0.5)
    health.observe(D, after, at=1.0)
    assert health.penalty_blocks(P1, D, 1.0) == pytest.approx(p1_penalty), case
    assert health.penalty_blocks(P2, D, 1.0) == pytest.approx(p2_penalty), case
    health.observe(D, after, at=1.0)  # the same sample again adds nothing
    assert health.penalty_blocks(P1, D, 1.0) == pytest.approx(p1_penalty), case


def test_only_pairs_routed_within_the_window_before_a_sample_are_blamed():
    health = PairHealth(CFG)
    health.observe(D, TransferCounters(), at=0.0)
    health.routed(P1, D, now=1.0)
    health.routed(P2, D, now=1.0 + ATTRIBUTION_WINDOW_S + 5)
    health.observe(D, TransferCounters(failures=1), at=1.0 + ATTRIBUTION_WINDOW_S + 6)
    now = 1.0 + ATTRIBUTION_WINDOW_S + 6
    assert health.penalty_blocks(P1, D, now) == 0.0  # routed too long before the sample
    assert health.penalty_blocks(P2, D, now) == pytest.approx(32.0)


def test_the_engine_poller_reads_the_transfer_counters():
    text = "\n".join(
        [
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0"} 0.25',
            "# TYPE vllm:nixl_num_failed_transfers counter",
            'vllm:nixl_num_failed_transfers_total{engine="0"} 2.0',
            'vllm:nixl_num_failed_transfers_created{engine="0"} 1.7e9',
            'vllm:kvpilot_load_failures_total{action="recompute"} 1.0',
            "vllm:nixl_num_kv_expired_reqs_total 3.0",
            'vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.5',
            'vllm:nixl_xfer_time_seconds_count{engine="0"} 5.0',
            'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1"} 5.0',
        ]
    )
    load = parse_engine_load(text, at=1.0)
    assert load is not None
    # the connector's load_failures count NIXL's failed reads again: one failure is not two
    assert load.transfer == TransferCounters(failures=2.0, expired_leases=3.0, transfer_seconds=0.5, transfers=5.0)
    bare = parse_engine_load("vllm:kv_cache_usage_perc 0.1\n", at=1.0)
    assert bare is not None and bare.transfer == TransferCounters()


def test_a_half_life_of_zero_is_refused():
    with pytest.raises(ConfigError, match="pair_failure_half_life_s"):
        CostConfig(pair_failure_half_life_s=0.0)


def test_a_pair_with_recent_failures_loses_to_an_equal_healthy_pair():
    cfg = _config([_w("p1", "prefill"), _w("p2", "prefill"), _w("d", "decode")])
    health = PairHealth(cfg.cost)
    fleet = fleet_from_config(cfg)
    router = Router(
        fleet,
        cfg,
        BlockIndex(4),
        LoadLedger(),
        SessionStore(4, 16),
        policy_from_config(cfg.disaggregation, prior_model(cfg)),
        random.Random(0),
        health=FleetHealth(CircuitBreaker(), health, EventWatch(0.0), monotonic=lambda: 0.0),
    )
    prompt = _prompt(10)
    chosen = {router.route(prompt, f"r{i}").prefill_worker.name for i in range(20)}
    assert chosen == {P1, P2}  # equal pairs: the seeded tie-break uses both
    health.failed(P1, D, now=0.0)
    for i in range(20):
        route = router.route(prompt, f"after-{i}")
        assert route.prefill_worker.name == P2
    assert "pair_penalty(32.00)" in route.decision.explain()
