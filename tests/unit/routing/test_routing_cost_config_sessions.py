"""Table-driven tests of kvpilot.routing.decide.cost, kvpilot.routing.config and kvpilot.routing.decide.sessions."""

from __future__ import annotations

import argparse
import random

import msgspec
import pytest

from kvpilot.policies.session_options import Option
from kvpilot.policies.typed_config import convert
from kvpilot.routing.config import (
    ConfigError,
    CostConfig,
    ForcedOption,
    IndexBackend,
    RouterConfig,
    TierClass,
)
from kvpilot.routing.config_load import add_cli_flags, load_config
from kvpilot.routing.decide.cost import Candidate, CandidateTable, CostModel, TierOverlap, tier_overlap
from kvpilot.routing.decide.ledger import LoadLedger, WorkerLoad
from kvpilot.routing.decide.sessions import InvalidSessionKey, SessionOffer, SessionStore, scoped, session_key
from kvpilot.routing.ids import SessionId
from kvpilot.routing.index.chain import PromptChain, first_difference

CFG = CostConfig()


@pytest.mark.parametrize(
    ("cfg", "overlap", "load", "affinity", "cost"),
    [
        (CFG, TierOverlap(), WorkerLoad(), False, 100 + 100),
        (CFG, TierOverlap(gpu=60), WorkerLoad(), False, 40 + 100),
        (CFG, TierOverlap(gpu=60, host=20, disk=20), WorkerLoad(), False, 100 - 60 - 15 - 5 + 100),
        (CFG, TierOverlap(shared=10), WorkerLoad(), False, 95 + 100),
        (CFG, TierOverlap(gpu=60), WorkerLoad(30, 50, 2), False, 70 + 150),
        (CFG, TierOverlap(gpu=100), WorkerLoad(), True, 0 + 100 - 16),
        (
            msgspec.structs.replace(CFG, overlap_score_credit_decay=0.01),
            TierOverlap(gpu=100),
            WorkerLoad(100, 0, 0),
            False,
            150 + 100,
        ),  # credit halved at 100 active prefill blocks
        (
            msgspec.structs.replace(CFG, prefill_load_scale=2.0, decode_active_request_weight=5.0),
            TierOverlap(gpu=50),
            WorkerLoad(0, 0, 3),
            False,
            100 + 100 + 15,
        ),
        (msgspec.structs.replace(CFG, overlap_score_credit=3.0), TierOverlap(gpu=50), WorkerLoad(), False, 0 + 100),
    ],
)
def test_cost_table(cfg, overlap, load, affinity, cost):
    decision = CostModel(cfg).decide("r", 100, CandidateTable.of([Candidate("w", overlap, load, affinity)]))
    assert decision.terms[0].cost == pytest.approx(cost)


def test_tier_overlap_fields_are_the_tier_classes_best_first():
    assert TierOverlap._fields == tuple(klass.value for klass in TierClass)


def test_tier_overlap_counts_each_block_once():
    classes = {"GPU": TierClass.GPU, "CPU": TierClass.HOST, "STORAGE": TierClass.DISK}
    assert tier_overlap({"GPU": 30, "CPU": 10}, classes) == TierOverlap(30, 0, 0, 0)
    assert tier_overlap({"GPU": 10, "STORAGE": 40, "X": 99}, classes, shared_depth=50) == TierOverlap(10, 0, 30, 10)


def test_dynamo_s_host_tier_is_credited_as_vllm_s():
    from kvpilot.routing.config import IndexConfig

    classes = IndexConfig().tiers
    assert tier_overlap({"GPU": 10, "CPU_PINNED": 25}, classes) == tier_overlap({"GPU": 10, "CPU": 25}, classes)
    assert tier_overlap({"GPU": 10, "CPU_PINNED": 25}, classes) == TierOverlap(10, 15, 0, 0)


def test_argmin_explain_and_seeded_sampling():
    cands = CandidateTable.of(
        [Candidate("hot", TierOverlap(gpu=90), WorkerLoad(80, 0, 0)), Candidate("cold", TierOverlap(), WorkerLoad())]
    )
    d = CostModel(CFG).decide("r1", 100, cands)
    assert d.chosen == "hot"
    text = d.explain()
    assert text.count("request=r1") == 3 and "worker=hot cost=190.00" in text and "<- chosen" in text
    decayed = CostModel(msgspec.structs.replace(CFG, overlap_score_credit_decay=0.05)).decide("r2", 100, cands)
    assert decayed.chosen == "cold"
    warm = msgspec.structs.replace(CFG, router_temperature=1.0)
    picks = [CostModel(warm, random.Random(7)).decide("r", 100, cands).chosen for _ in range(5)]
    assert len(set(picks)) == 1  # same seed, same draw
    many = CostModel(warm, random.Random(1))
    assert {many.decide("r", 100, cands).chosen for _ in range(200)} == {"hot", "cold"}
    with pytest.raises(ValueError, match="no candidate workers"):
        CostModel(CFG).decide("r", 1, CandidateTable.of([]))


def _chain(blocks: int, base: int = 0, salt: str | None = None) -> PromptChain:
    return PromptChain(list(range(base, base + 2 * blocks)), 2, cache_salt=salt)


def test_load_ledger_lifecycle():
    ledger = LoadLedger()
    ledger.dispatch("r1", "p", "d", _chain(10), cached_blocks=4)
    assert ledger.load("p") == WorkerLoad(6, 0, 0) and ledger.load("d") == WorkerLoad(0, 10, 1)
    with pytest.raises(ValueError, match="already active"):
        ledger.dispatch("r1", "p", "d", _chain(1), 0)
    assert ledger.first_token("r1") and not ledger.first_token("r1")
    assert ledger.load("p") == WorkerLoad()
    assert ledger.complete("r1") and not ledger.fail("r1")
    assert ledger.load("d") == WorkerLoad()
    ledger.dispatch("r2", "w", "w", _chain(5), 0)
    assert ledger.fail("r2") and ledger.load("w") == WorkerLoad()


def test_load_ledger_counts_shared_prefix_blocks_once_per_worker():
    ledger = LoadLedger()
    ledger.dispatch("a", "w", "w", _chain(10), 0)
    ledger.dispatch("b", "w", "w", _chain(12), 0)  # shares a's 10 blocks
    assert ledger.load("w").active_decode_blocks == 12
    assert ledger.load("w", _chain(20)).shared_decode_blocks == 12
    assert ledger.load("w", _chain(20, base=1)).shared_decode_blocks == 0
    assert ledger.load("w", _chain(20, salt="t")).shared_decode_blocks == 0  # another salt shares nothing
    assert ledger.load("other", _chain(20)).shared_decode_blocks == 0
    ledger.complete("b")
    assert ledger.load("w").active_decode_blocks == 10
    assert ledger.load("w", _chain(20)).shared_decode_blocks == 10
    ledger.complete("a")
    assert ledger.load("w", _chain(20)) == WorkerLoad()


def test_load_ledger_loads_of_a_fleet_agree_with_each_worker_s_walk():
    """``prompt_loads`` (the workers whose requests start like the prompt, each searched by
    galloping) gives what walking each worker's held blocks from the front gives, on
    random prefixes of random lengths, as requests come and go; idle workers read zeros."""
    rng = random.Random(7)
    ledger, active = LoadLedger(), []
    for step in range(300):
        if active and rng.random() < 0.4:
            ledger.complete(active.pop(rng.randrange(len(active))))
        else:
            worker = f"w{rng.randrange(6)}"
            ledger.dispatch(f"r{step}", "p", worker, _chain(rng.randrange(0, 40), base=rng.choice((0, 0, 1))), 0)
            active.append(f"r{step}")
        prompt = _chain(rng.randrange(0, 50), base=rng.choice((0, 1, 2)))
        loads = ledger.prompt_loads(prompt)
        for worker in ("p", *(f"w{i}" for i in range(8))):
            held = ledger._held.get(worker, {}).get(prompt.namespace, {})
            walked = next((i for i, key in enumerate(prompt.keys(prompt.num_blocks)) if key not in held), None)
            expected = ledger.load(worker)._replace(
                shared_decode_blocks=prompt.num_blocks if walked is None else walked
            )
            assert loads[worker] == expected, (step, worker)


def test_load_ledger_completes_overlapping_requests_of_no_full_block():
    # the second completion found its namespace deleted by the first (KeyError) when the
    # picker's access log ended them after they overlapped
    ledger = LoadLedger()
    ledger.dispatch("a", "w", "w", _chain(0), 0)
    ledger.dispatch("b", "w", "w", _chain(0), 0)
    assert ledger.complete("a") and ledger.complete("b")
    assert ledger.load("w") == WorkerLoad()


def test_load_ledger_moves_a_failed_prefill_to_decode():
    ledger = LoadLedger()
    ledger.dispatch("r", "p", "d", _chain(10), cached_blocks=2)
    assert ledger.move_prefill("r", "d", cached_blocks=6)
    assert ledger.load("p") == WorkerLoad() and ledger.load("d") == WorkerLoad(4, 10, 1)
    assert ledger.first_token("r") and ledger.load("d") == WorkerLoad(0, 10, 1)
    assert ledger.complete("r") and not ledger.move_prefill("r", "d", 0)


@pytest.mark.parametrize(
    ("yaml_text", "flags", "check"),
    [
        ("", [], lambda c: c.cost.overlap_score_credit == 1.0 and c.cost.host_cache_hit_weight == 0.75),
        ("cost: {overlap_score_credit: 2}", [], lambda c: c.cost.overlap_score_credit == 2.0),
        (
            "cost: {overlap_score_credit: 2}",
            ["--cost-overlap-score-credit", "0.5"],
            lambda c: c.cost.overlap_score_credit == 0.5,
        ),
        (
            "index: {block_size: 32, tiers: {GPU: gpu}}",
            ["--sessions-max-sessions", "5"],
            lambda c: (
                c.index.block_size == 32 and dict(c.index.tiers) == {"GPU": "gpu"} and c.sessions.max_sessions == 5
            ),
        ),
        (
            "disaggregation: {max_local_tokens: 0}",
            [
                "--disaggregation-max-local-tokens",
                "none",
                "--disaggregation-compare-costs",
                "true",
                "--disaggregation-decode-busy-kv-usage",
                "0.5",
                "--sessions-force-option",
                "pull",
            ],
            lambda c: (
                c.disaggregation.max_local_tokens is None
                and c.disaggregation.compare_costs is True
                and c.disaggregation.decode_busy_kv_usage == 0.5
                and c.sessions.force_option == "pull"
            ),
        ),
        (
            "",
            ["--disaggregation-max-local-tokens", "64", "--disaggregation-compare-costs", "false"],
            lambda c: c.disaggregation.max_local_tokens == 64 and c.disaggregation.compare_costs is False,
        ),
        (
            "index: {backend: kvpilot, tiers: {GPU: gpu, NET: shared}}\nsessions: {force_option: pull}",
            ["--index-backend", "dynamo", "--sessions-force-option", ""],
            lambda c: (
                c.index.backend is IndexBackend.DYNAMO
                and c.index.tiers["NET"] is TierClass.SHARED
                and c.sessions.force_option is ForcedOption.CHEAPEST
                and c.sessions.force_option.option is None
            ),
        ),
        ("sessions: {force_option: shared_tier}", [], lambda c: c.sessions.force_option.option is Option.SHARED_TIER),
    ],
)
def test_config_layers(tmp_path, yaml_text, flags, check):
    path = tmp_path / "r.yaml"
    path.write_text(yaml_text)
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    assert check(load_config(path, parser.parse_args(flags)))


@pytest.mark.parametrize(
    "flags",
    [
        ["--disaggregation-compare-costs", "yes"],
        ["--sessions-max-sessions", "none"],
        ["--disaggregation-max-local-tokens", "1.5"],
        ["--index-backend", "redis"],
        ["--sessions-force-option", "teleport"],
    ],
)
def test_a_bad_flag_value_is_refused_by_argparse(flags):
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(flags)


def test_an_unknown_forced_option_names_the_key(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("sessions: {force_option: teleport}")
    with pytest.raises(ConfigError, match=r"sessions\.force_option: must be one of '', 'reprefill', .*got 'teleport'"):
        load_config(path)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("cost: {overlap_score_credt: 1}", "cost.overlap_score_credt"),
        ("routerr: {}", "routerr"),
        ("cost: {router_temperature: -1}", "cost.router_temperature"),
        ("cost: {router_seed: 1.5}", "cost.router_seed: Expected `int`, got `float`"),
        ("disaggregation: {max_local_fraction: -0.5}", "disaggregation.max_local_fraction: must be"),
        ("sessions: {max_sessions: many}", "sessions.max_sessions: Expected `int`, got `str`"),
        ("index: {block_size: 0}", "index.block_size"),
        ("index: {tiers: {GPU: vram}}", "index.tiers.GPU"),
        ("cost: 3", "cost"),
        ("- 1", "top level"),
    ],
)
def test_config_errors_name_the_key(tmp_path, yaml_text, message):
    path = tmp_path / "r.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(path)


W = {"name": "d", "role": "decode", "url": "http://127.0.0.1:1"}


@pytest.mark.parametrize(
    ("data", "key", "problem"),
    [
        ({"cost": {"overlap_score_credt": 1}}, "cost.overlap_score_credt", "unknown key (known: overlap_score_credit,"),
        ({"workers": [W, {**W, "name": "e", "colour": 1}]}, "workers[1].colour", "unknown key (known: name, role,"),
        ({"cost": {"router_seed": 1.5}}, "cost.router_seed", "Expected `int`, got `float`"),
        ({"workers": [{**W, "kv_blocks": "many"}]}, "workers[0].kv_blocks", "Expected `int`, got `str`"),
        ({"index": {"backend": "redis"}}, "index.backend", "must be one of 'kvpilot', 'dynamo', got 'redis'"),
        (
            {"index": {"tiers": {"GPU": "gpu", "CPU": "vram"}}},
            "index.tiers.CPU",
            "must be one of 'gpu', 'host', 'disk', 'shared', got 'vram'",
        ),
        ({"sessions": {"force_option": "teleport"}}, "sessions.force_option", "'shared_tier', 'local', got 'teleport'"),
        ({"workers": [{**W, "role": "mixer"}]}, "workers[0].role", "'decode', 'colocated', got 'mixer'"),
        ({"index": {"block_size": 0}}, "index.block_size", "must be a finite number > 0, got 0"),
        ({"server": {"port": 65536}}, "server.port", "must be a finite number >= 0 and < 65536, got 65536"),
        ({"workers": [{"name": "d", "role": "decode"}]}, "workers[0].url", "missing required key"),
    ],
)
def test_convert_names_the_dotted_key_of_the_router_config(data, key, problem):
    """kvpilot.policies.typed_config.convert on the router's config: unknown keys, types and
    enums at depth, each error a ConfigError naming the key."""
    with pytest.raises(ConfigError) as err:
        convert(data, RouterConfig)
    assert err.value.key == key
    assert problem in err.value.problem


@pytest.mark.parametrize(
    ("body", "headers", "key"),
    [
        ({"conversation_id": "c", "prompt_cache_key": "p"}, {"X-Session-ID": "h"}, "c"),
        ({"prompt_cache_key": "p"}, {"x-session-id": "h"}, "p"),
        ({"conversation_id": None}, {"X-SESSION-ID": "h"}, "h"),
        ({}, {}, None),
    ],
)
def test_session_key_precedence(body, headers, key):
    assert session_key(body, headers) == key


@pytest.mark.parametrize("body", [{"conversation_id": 3}, {"prompt_cache_key": ""}, {"conversation_id": "x" * 300}])
def test_bad_session_keys_name_the_field(body):
    with pytest.raises(InvalidSessionKey, match=next(iter(body))):
        session_key(body, {})


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3], [1, 9, 3], 1), ([1, 2, 3], [1, 2], 2), ([], [5], 0)],
)
def test_first_difference(old, new, expected):
    assert first_difference(old, new) == expected


def test_session_chain_names_only_new_blocks_and_rehashes_from_divergence():
    store = SessionStore(block_size=2, max_sessions=2)
    s = store.get("a")
    s.advance(list(range(10)))
    s.chain.keys(5)
    assert s.chain.named_blocks == 5
    adv = s.advance(list(range(14)))
    assert adv == (10, 4, False) and s.chain.named_blocks == 5  # old names kept
    fresh = list(range(14))
    assert s.chain.keys(7) == __import__("kvpilot.routing.index.chain", fromlist=["chain_keys"]).chain_keys(
        fresh, 2, 0, 0
    )
    adv = s.advance([0, 1, 2, 99, 4, 5])
    assert adv == (3, 3, True) and s.chain.named_blocks == 1  # cut back to the block before token 3
    assert s.advance([0, 1], cache_salt="t").reused_tokens == 0  # another salt: fresh chain
    assert s.extend([5, 6]).reused_tokens == 2 and list(s.chain.tokens) == [0, 1, 5, 6]
    store.get("b"), store.get("c")
    assert len(store) == 2 and store.evicted == 1


def test_session_chains_hold_packed_tokens():
    import numpy as np

    s = SessionStore(block_size=2, max_sessions=2).get("a")
    s.advance(list(range(10)))
    for n in range(12, 3000, 7):  # grows past its first storage
        s.advance(list(range(n)))
    s.advance(list(range(12)))
    assert isinstance(s.chain.tokens, np.ndarray) and s.chain.tokens.dtype == np.uint32
    assert list(s.chain.tokens) == list(range(12))
    with pytest.raises(ValueError, match="2\\*\\*32"):
        s.advance([*list(range(12)), -1])
    assert list(s.chain.tokens) == list(range(12))  # a refused prompt changes nothing


def test_a_session_id_is_scoped_by_salt():
    key = SessionId("agent-1")
    assert scoped(key, None) == key
    assert scoped(key, "tenant-a") != scoped(key, "tenant-b")
    # a salt cannot be spelled so that another (salt, key) pair collides
    assert scoped(SessionId("b:c"), "a") != scoped(SessionId("c"), "a:b")


OFFERED = {
    "do_remote_decode": True,
    "remote_block_ids": [[3, 4]],
    "remote_engine_id": "d",
    "kvpilot_expires_at": 1000.0,
}


@pytest.mark.parametrize(
    ("params", "offered"),
    [
        (OFFERED, True),
        ({**OFFERED, "remote_block_ids": []}, False),  # no blocks held
        ({**OFFERED, "do_remote_decode": False}, False),  # not bidirectional
        (None, False),
        ("params", False),
    ],
)
def test_an_offer_is_read_only_from_params_that_hold_blocks(params, offered):
    assert (SessionOffer.from_response("decode-0", params) is not None) == offered


@pytest.mark.parametrize(("now", "use"), [(900.0, "sent"), (994.9, "sent"), (995.1, "expired"), (1200.0, "expired")])
def test_an_offer_about_to_expire_is_not_sent(now, use):
    offer = SessionOffer.from_response("decode-0", OFFERED)
    assert offer is not None and offer.use(now) == use


def test_an_offer_without_a_wall_clock_hold_is_sent():
    offer = SessionOffer.from_response("decode-0", {**OFFERED, "kvpilot_expires_at": "soon"})
    assert offer is not None and offer.expires_at is None and offer.use(10**12) == "sent"


def test_circuit_opens_after_consecutive_failures_and_closes_on_a_success():
    from kvpilot.routing.health.circuit import CircuitBreaker

    breaker = CircuitBreaker(failures_to_open=3, open_s=10.0)
    assert breaker.allows("d-0", now=0.0)
    assert not breaker.failed("d-0", now=1.0) and not breaker.failed("d-0", now=2.0)
    breaker.succeeded("d-0")  # a success in between: the count starts again
    assert not breaker.failed("d-0", now=3.0) and not breaker.failed("d-0", now=4.0)
    assert breaker.failed("d-0", now=5.0)  # the third in a row opens it
    assert not breaker.allows("d-0", now=14.9) and breaker.allows("d-1", now=6.0)
    assert breaker.allows("d-0", now=15.0)  # half-open: tried again
    assert breaker.failed("d-0", now=15.5)  # one failure re-opens it
    assert not breaker.allows("d-0", now=20.0)
    assert breaker.allows("d-0", now=25.5) and breaker.succeeded("d-0")  # closed by a success
    assert breaker.allows("d-0", now=26.0) and not breaker.succeeded("d-0")
    assert not CircuitBreaker(failures_to_open=0).failed("d-0", now=0.0)  # disabled


def test_a_half_open_circuit_lets_one_probe_through_at_a_time():
    from kvpilot.routing.health.circuit import CircuitBreaker

    breaker = CircuitBreaker(failures_to_open=1, open_s=10.0)
    assert breaker.failed("d-0", now=0.0)
    assert not breaker.dispatched("d-0", now=5.0)  # open: no probe yet
    assert breaker.allows("d-0", now=10.0) and breaker.dispatched("d-0", now=10.0)  # the probe
    assert not breaker.allows("d-0", now=10.1)  # the rest wait for the probe's answer
    assert not breaker.dispatched("d-1", now=10.1)  # a closed circuit has no probe
    breaker.released("d-0")  # the probe ended on the client's 4xx: the next request probes
    assert breaker.allows("d-0", now=10.2) and breaker.dispatched("d-0", now=10.2)
    assert breaker.allows("d-0", now=20.2)  # a probe that never reported frees the slot after open_s
    assert breaker.dispatched("d-0", now=20.2) and breaker.failed("d-0", now=20.3)  # the probe failed: open again
    assert not breaker.allows("d-0", now=30.2) and breaker.allows("d-0", now=30.3)
    assert breaker.dispatched("d-0", now=30.3) and breaker.succeeded("d-0")  # closed by the probe's success
    assert breaker.allows("d-0", now=30.4) and not breaker.dispatched("d-0", now=30.4)


def test_barred_names_exactly_the_workers_the_breaker_refuses():
    from kvpilot.routing.health.circuit import CircuitBreaker

    breaker = CircuitBreaker(failures_to_open=2, open_s=10.0)
    assert breaker.barred(now=0.0) == frozenset()
    breaker.failed("d-0", now=0.0)
    breaker.failed("d-1", now=0.0)
    breaker.failed("d-1", now=1.0)  # opens d-1 only; d-0 has one failure, still closed
    assert breaker.barred(now=2.0) == {"d-1"}
    assert breaker.dispatched("d-1", now=11.0)  # half-open: its probe bars it again
    assert breaker.barred(now=11.5) == {"d-1"}
    breaker.succeeded("d-1")
    assert breaker.barred(now=12.0) == frozenset()
