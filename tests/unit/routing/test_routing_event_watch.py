"""kvpilot.routing.health.event_watch: a worker whose KV events stop after it prefilled new blocks is
flagged, routed on load alone, and cleared by its next batch."""

from __future__ import annotations

import random

import pytest

from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.router import Router
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.event_watch import EventWatch, Transitions
from kvpilot.routing.health.pair_health import PairHealth
from kvpilot.routing.health.view import FleetHealth
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from tests.unit.routing.test_routing_router import COLOCATED, _config, _prompt, _store

W1, W2 = WorkerId("w1"), WorkerId("w2")


@pytest.mark.parametrize(
    ("case", "heard_at", "checked_at", "stale"),
    [
        ("silent past the bound", None, 10.0, True),
        ("silent, not yet past the bound", None, 9.9, False),
        ("heard before the bound", 3.0, 10.0, False),
        ("heard after the bound", 12.0, 12.0, False),
    ],
)
def test_a_worker_silent_after_a_prefill_is_flagged_until_heard(case, heard_at, checked_at, stale):
    watch = EventWatch(stale_after_s=10.0)
    watch.expect(W1, batches=5, now=0.0)
    batches = {W1: 5, W2: 0}
    if heard_at is not None:
        batches[W1] = 6
    watch.update(batches, checked_at)
    assert watch.is_stale(W1) is stale, case
    assert watch.stale == (frozenset({W1}) if stale else frozenset())
    assert not watch.is_stale(W2)  # never expected: never flagged


def test_the_next_batch_clears_a_flag_and_each_episode_is_counted_once():
    watch = EventWatch(stale_after_s=1.0)
    watch.expect(W1, 0, now=0.0)
    assert watch.update({W1: 0}, 5.0) == Transitions(went_stale=(W1,))
    assert watch.update({W1: 0}, 6.0) == Transitions()
    assert watch.is_stale(W1) and watch.went_stale == {W1: 1}
    watch.expect(W1, 0, now=7.0)  # an older expectation is kept: still stale
    assert watch.update({W1: 1}, 7.5) == Transitions(heard_again=(W1,))
    assert not watch.is_stale(W1)
    watch.expect(W1, 1, now=8.0)
    watch.update({W1: 1}, 9.5)
    assert watch.is_stale(W1) and watch.went_stale == {W1: 2}


def test_zero_disables_the_watch_and_negative_is_refused():
    watch = EventWatch(stale_after_s=0.0)
    watch.expect(W1, 0, now=0.0)
    watch.update({W1: 0}, 1e9)
    assert not watch.is_stale(W1)
    with pytest.raises(ValueError, match="stale_after_s"):
        EventWatch(stale_after_s=-1.0)


def test_a_stale_worker_earns_no_overlap_credit():
    """Both workers hold the prompt; the one whose events stopped is scored on load alone."""
    cfg = _config(COLOCATED)
    watch = EventWatch(stale_after_s=1.0)
    router = Router(
        fleet_from_config(cfg),
        cfg,
        BlockIndex(4),
        LoadLedger(),
        SessionStore(4, 16),
        None,
        random.Random(0),
        health=FleetHealth(CircuitBreaker(), PairHealth(cfg.cost), watch),
    )
    prompt = _prompt(10)
    _store(router.index, "w2", prompt[: 8 * 4])
    assert router.route(prompt, "before").decode.name == W2
    watch.expect(W2, 0, now=0.0)
    watch.update({W2: 0}, 2.0)
    route = router.route(prompt, "after")
    assert route.cached_blocks == 0
    assert all(term.credit_blocks == 0 for term in route.decision.terms), route.explain()


def test_the_router_names_a_worker_whose_events_stop_and_the_watch_is_on_by_default(caplog):
    from kvpilot.routing.config import RouterConfig
    from kvpilot.routing.core import RouterCore
    from kvpilot.routing.decide.lifecycle import Clock

    assert RouterConfig().index.events_stale_after_s > 0
    now = [0.0]
    cfg = _config(COLOCATED)
    core = RouterCore(cfg, fleet_from_config(cfg), clock=Clock(monotonic=lambda: now[0]))
    batches = {W1: 3, W2: 5}
    core.event_batches = lambda: batches  # type: ignore[method-assign]
    core.event_watch.expect(W2, 5, now=0.0)
    now[0] = cfg.index.events_stale_after_s
    with caplog.at_level("INFO", logger="kvpilot.routing.core"):
        core.watch_events()
        core.watch_events()  # still silent: said once
        batches[W2] = 6
        core.watch_events()
    said = [r.getMessage() for r in caplog.records if r.name == "kvpilot.routing.core"]
    assert len(said) == 2 and said[0].startswith("worker w2 prefilled blocks and published no KV event"), said
    assert "kvpilot engine-flags" in said[0] and said[1] == "worker w2 publishes KV events again"
