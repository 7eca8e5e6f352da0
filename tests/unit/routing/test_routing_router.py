"""Table-driven tests of kvpilot.routing.decide.router (the decision glue) and kvpilot.routing.fleet (the fleet)."""

from __future__ import annotations

import json
import random
import re
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset
from kvpilot.policies.roofline import kv_bytes, prefill
from kvpilot.policies.session_options import Option
from kvpilot.policies.tier_credit import host_block_credit
from kvpilot.routing.config import ConfigError, Role, RouterConfig, prior_model
from kvpilot.routing.config_load import load_config
from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.rates import RateEstimator, RolePriors
from kvpilot.routing.decide.router import Kind, Router, policy_from_config
from kvpilot.routing.decide.sessions import SessionOffer, SessionStore
from kvpilot.routing.fleet import fleet_from_config, kv_events_config
from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.event_watch import EventWatch
from kvpilot.routing.health.pair_health import PairHealth
from kvpilot.routing.health.view import FleetHealth
from kvpilot.routing.ids import SessionId, WorkerId, pair_name
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.events import BlockStored

BS = 4


def _config(workers: list[dict], **sections: dict) -> RouterConfig:
    """The config a YAML file with these sections loads to (through load_config)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump({"index": {"block_size": BS}, "workers": workers, **sections}))
        return load_config(path)


def _w(name: str, role: str, **extra: object) -> dict:
    return {"name": name, "role": role, "url": f"http://127.0.0.1:1/{name}", **extra}


def _prompt(n_blocks: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def _store(index: BlockIndex, worker: str, tokens: list[int], salt: str | None = None) -> None:
    n = len(tokens) // BS
    hashes = [f"{worker}-{tokens[0]}-{salt}-{i}".encode() for i in range(n)]
    extra = [[salt] if salt else None] + [None] * (n - 1)
    index.apply(WorkerId(worker), BlockStored(hashes, None, tokens[: n * BS], BS, medium="GPU", extra_keys=extra))


def _router(cfg: RouterConfig, seed: int = 0) -> Router:
    fleet = fleet_from_config(cfg)
    policy = policy_from_config(cfg.disaggregation, prior_model(cfg)) if fleet.prefill else None
    return Router(fleet, cfg, BlockIndex(BS), LoadLedger(), SessionStore(BS, 16), policy, random.Random(seed))


COLOCATED = [_w("w1", "colocated"), _w("w2", "colocated")]


@pytest.mark.parametrize(
    ("case", "stored", "request_salt", "expected", "expected_cached"),
    [
        ("prefix on w2 wins", [("w2", None)], None, "w2", 8),
        ("prefix on w1 wins", [("w1", None)], None, "w1", 8),
        ("deeper prefix wins", [("w1", None, 3), ("w2", None)], None, "w2", 8),
        ("another salt earns nothing", [("w2", "tenant-a")], "tenant-b", None, 0),
        ("own salt earns credit", [("w2", "tenant-a")], "tenant-a", "w2", 8),
        ("unsalted blocks do not serve a salted prompt", [("w1", None)], "tenant-a", None, 0),
    ],
)
def test_prefix_overlap_and_salt_isolation(case, stored, request_salt, expected, expected_cached):
    router = _router(_config(COLOCATED))
    prompt = _prompt(10)
    for entry in stored:
        worker, salt = entry[0], entry[1]
        blocks = entry[2] if len(entry) > 2 else 8
        _store(router.index, worker, prompt[: blocks * BS], salt)
    route = router.route(prompt, "r1", cache_salt=request_salt)
    assert route.kind is Kind.COLOCATED and route.prefill is None
    assert route.cached_blocks == expected_cached, case
    if expected is not None:
        assert route.decode.name == expected, case


@pytest.mark.parametrize(
    ("case", "credit", "w2_prefix_blocks", "expected"),
    [
        ("affinity breaks the tie", 16.0, 0, "w1"),
        ("no credit configured: the prefix decides", 0.0, 2, "w2"),
        ("affinity outweighs a small prefix elsewhere", 16.0, 2, "w1"),
        ("affinity is soft: a big prefix elsewhere wins", 4.0, 9, "w2"),
    ],
)
def test_session_affinity_is_a_soft_credit(case, credit, w2_prefix_blocks, expected):
    """The credit alone (the stay rule off: it would move the step to w2, which starts it sooner)."""
    cost = {"session_affinity_credit": credit, "session_stays_unless_sooner": False}
    router = _router(_config(COLOCATED, cost=cost))
    session = SessionId("conv-1")
    first = router.route(_prompt(10, base=1000), "r0", session=session)
    router.sessions.get(session).last_worker = WorkerId("w1")  # the previous step ran on w1
    assert first.prompt_blocks == 10
    prompt = _prompt(10)
    if w2_prefix_blocks:
        _store(router.index, "w2", prompt[: w2_prefix_blocks * BS])
    route = router.route(prompt, "r1", session=session)
    assert route.decode.name == expected, case


def test_served_records_the_decode_worker_and_sessions_name_only_new_blocks():
    router = _router(_config(COLOCATED))
    session = SessionId("agent")
    prompt = _prompt(10)
    _store(router.index, "w2", prompt)
    route = router.route(prompt, "r1", session=session)
    router.served(session, route)
    state = router.sessions.get(session)
    assert state.last_worker == "w2"
    named = state.chain.named_blocks
    route2 = router.route(prompt + _prompt(3, base=500), "r2", session=session)
    assert list(state.chain.tokens[: len(prompt)]) == prompt and route2.prompt_blocks == 13
    # The 10 old keys are kept, and the match names new blocks only up to the first
    # that no worker caches (lazy): 11, not 13 and not a fresh 13 from the root.
    assert (named, state.chain.named_blocks) == (10, 11) and route2.decode.name == "w2"
    dry = router.route(_prompt(2, base=900), "r3", session=session, dry_run=True)
    assert dry.prompt_blocks == 2 and len(state.chain.tokens) == 13 * BS  # dry run left the chain


def test_load_moves_traffic_off_a_busy_worker():
    router = _router(_config(COLOCATED))
    prompt = _prompt(10)
    for w in ("w1", "w2"):
        _store(router.index, w, prompt[: 4 * BS])
    router.ledger.dispatch("busy", WorkerId("w1"), WorkerId("w1"), PromptChain(_prompt(40, base=5000), BS), 0)
    assert router.route(prompt, "r1").decode.name == "w2"


PD = [_w("p1", "prefill"), _w("p2", "prefill"), _w("d1", "decode", kv_blocks=100)]


@pytest.mark.parametrize(
    ("case", "on_p2", "on_d1", "d_active_blocks", "expected_kind", "expected_p"),
    [
        ("nothing cached: remote on either P", 0, 0, 0, Kind.REMOTE_PREFILL, None),
        ("P2 holds the prefix: the pair through P2", 8, 0, 0, Kind.REMOTE_PREFILL, "p2"),
        ("D holds most of it: local prefill on D", 0, 9, 0, Kind.LOCAL_PREFILL, None),
        ("D holds it but is busy (KV 95%): decode-busy guard", 0, 9, 95, Kind.REMOTE_PREFILL, None),
        ("D holds it, KV 80%: local", 0, 9, 70, Kind.LOCAL_PREFILL, None),
    ],
)
def test_pairs_and_conditional_disaggregation(case, on_p2, on_d1, d_active_blocks, expected_kind, expected_p):
    router = _router(_config(PD))
    prompt = _prompt(10)
    if on_p2:
        _store(router.index, "p2", prompt[: on_p2 * BS])
    if on_d1:
        _store(router.index, "d1", prompt[: on_d1 * BS])
    if d_active_blocks:
        other = PromptChain(_prompt(d_active_blocks, base=5000), BS)
        router.ledger.dispatch("other", WorkerId("d1"), WorkerId("d1"), other, d_active_blocks)
    route = router.route(prompt, "r1")
    assert route.kind is expected_kind, f"{case}\n{route.explain()}"
    assert route.decode.name == "d1"
    if expected_kind is Kind.LOCAL_PREFILL:
        assert route.prefill is None and route.prefill_worker.name == "d1"
        assert route.cached_blocks == on_d1
    else:
        assert route.prefill is not None
        if expected_p:
            assert route.prefill.name == expected_p and route.cached_blocks == on_p2
    assert route.decision.chosen in {
        pair_name(WorkerId("p1"), WorkerId("d1")),
        pair_name(WorkerId("p2"), WorkerId("d1")),
    }


def test_explain_names_the_request_every_term_and_the_policy_verdict():
    router = _router(_config(PD))
    text = router.route(_prompt(6), "req-42").explain()
    lines = text.splitlines()
    assert all("request=req-42" in line for line in lines)
    assert "p1->d1" in text and "p2->d1" in text and "adjusted_prefill_blocks" in text
    assert "remote prefill" in lines[-1] and "effective prompt" in lines[-1]


def test_seeded_sampling_is_reproducible():
    cfg = _config(COLOCATED, cost={"router_temperature": 1.0})
    routers = [_router(cfg, seed=7), _router(cfg, seed=7)]
    picks = [[r.route(_prompt(3), f"r{i}").decode.name for i in range(12)] for r in routers]
    assert picks[0] == picks[1]
    assert len(set(picks[0])) == 2  # at T=1 with equal costs, both get picked


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty"):
        _router(_config(COLOCATED)).route([], "r")


# ---- the fleet (kvpilot.routing.fleet) and its config section --------------------------
@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ([{"name": "a", "role": "decode", "url": "http://h:1", "colour": 1}], "workers[0].colour"),
        ([{"name": "a", "role": "decode"}], "workers[0].url: missing required key"),
        ([_w("a", "mixer")], "workers[0].role"),
        ([_w("a", "decode"), _w("a", "decode")], "workers[1].name: 'a' is used twice"),
        ([_w("a", "prefill")], "need at least one decode"),
        ([], "at least one decode or colocated"),
        ([{"name": "a", "role": "decode", "url": "ftp://h"}], "workers[0].url"),
        ([_w("a", "decode", kv_events_endpoint="udp://x")], "workers[0].kv_events_endpoint"),
        (
            [_w("a", "decode", replay_endpoint="tcp://127.0.0.1:2")],
            "workers[0].replay_endpoint: needs kv_events_endpoint",
        ),
        ([_w("a", "decode", kv_blocks="many")], "workers[0].kv_blocks"),
        (
            [
                _w("a", "decode", kv_events_endpoint="tcp://127.0.0.1:3"),
                _w("b", "decode", kv_events_endpoint="tcp://127.0.0.1:3"),
            ],
            "tcp://127.0.0.1:3 is used twice",
        ),
    ],
)
def test_bad_workers_are_errors_naming_the_field(workers, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        fleet_from_config(_config(workers))


def test_workers_section_parses_and_renders_the_engine_flag(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(
        textwrap.dedent(
            """
            server: {port: 8000, model_dir: /m, model_name: tiny}
            index: {block_size: 32}
            disaggregation: {max_local_tokens: null, compare_costs: true}
            workers:
              - {name: prefill-0, role: prefill, url: "http://127.0.0.1:8100/",
                 kv_events_endpoint: "tcp://127.0.0.1:5700", replay_endpoint: "tcp://127.0.0.1:5800"}
              - {name: decode-0, role: decode, url: "http://127.0.0.1:8101", kv_blocks: 2048}
            """
        )
    )
    cfg = load_config(path)
    fleet = fleet_from_config(cfg)
    assert [w.name for w in fleet.prefill] == ["prefill-0"] and fleet.decode[0].kv_blocks == 2048
    assert fleet.prefill[0].role is Role.PREFILL and fleet.prefill[0].url == "http://127.0.0.1:8100"
    assert cfg.disaggregation.max_local_tokens is None and cfg.disaggregation.compare_costs is True
    assert fleet.prefill[0] is cfg.workers[0]  # one type: the parsed workers are the fleet's
    assert json.loads(kv_events_config(fleet.prefill[0])) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5700",
        "replay_endpoint": "tcp://127.0.0.1:5800",
        "topic": "kv",
    }
    with pytest.raises(ValueError, match="decode-0"):
        kv_events_config(fleet.decode[0])


def test_unknown_policy_preset_names_the_section():
    cfg = _config(PD, disaggregation={"p_hardware": "tpu9"})
    with pytest.raises(ConfigError, match="disaggregation"):
        policy_from_config(cfg.disaggregation, prior_model(cfg))


# ---- a session's later step: the five options (reference article, section 9.2) ----


def _offer(blocks: int) -> dict:
    """d1's end-of-turn params holding ``blocks`` blocks (vLLM's bidirectional protocol)."""
    return {"do_remote_decode": True, "remote_block_ids": [list(range(blocks))], "remote_engine_id": "d1"}


OFFER = _offer(12)
STEP1_BLOCKS = 8


def _session_after_step_one(
    force: str = "", generated_blocks: int = 3, **disaggregation: object
) -> tuple[Router, SessionId, list[int]]:
    """Step 1 (8 blocks) prefilled on a P and decoded on d1, which now caches the
    prompt and ``generated_blocks`` generated blocks and offers them; returns step 2's
    prompt (the generated blocks and 2 blocks more)."""
    cfg = _config(PD, disaggregation={"max_local_tokens": 0, **disaggregation}, sessions={"force_option": force})
    router = _router(cfg)
    session = SessionId("agent")
    step1 = _prompt(STEP1_BLOCKS, base=100)
    first = router.route(step1, "s1", session=session, now=0.0)
    assert first.option is None and first.kind is Kind.REMOTE_PREFILL  # a first step: the pair's policy
    router.served(session, first, _offer(STEP1_BLOCKS + generated_blocks + 1))
    assert router.sessions.get(session).last_prefill == first.prefill.name
    step2 = step1 + _prompt(generated_blocks, base=900) + _prompt(2, base=950)
    _store(router.index, "d1", step2[: (STEP1_BLOCKS + generated_blocks) * BS])  # the prompt and its generated blocks
    _store(router.index, first.prefill.name, step1)
    return router, session, step2


# Unforced, step 2 goes to affinity: the session's last P is the cost model's P (it
# caches step 1), so re-prefill and affinity do the same work at the same price and
# the tie goes to affinity (TIE_ORDER: it moves the least data); pulling d1's three
# blocks adds a transfer for 12 tokens that an idle P recomputes for free (its pass
# is weight-bound). Forced, the named option is taken.
@pytest.mark.parametrize(
    ("force", "expected"), [("", "affinity"), ("reprefill", "reprefill"), ("pull", "pull"), ("affinity", "affinity")]
)
def test_a_later_step_prices_every_option_and_takes_the_forced_or_cheapest(force, expected):
    router, session, step2 = _session_after_step_one(force)
    route = router.route(step2, "s2", session=session, now=0.0)
    assert [p.option.value for p in route.options] == ["reprefill", "pull", "affinity", "shared_tier", "local"]
    price = {p.option.value: p for p in route.options}
    assert price["reprefill"].seconds == price["affinity"].seconds < price["pull"].seconds
    assert route.option is not None and route.option.value == expected
    assert route.kind is Kind.REMOTE_PREFILL  # max_local_tokens 0: D never prefills here
    assert not price["local"].available
    assert f"{expected}: " in route.explain() and "<- chosen" in route.explain()
    offer, use = router.take_session_offer(session, route, now=0.0)
    assert (use == "sent") == (expected == "pull") and (offer is not None) == (use == "sent")


def test_unforced_a_long_generated_span_is_pulled_not_recomputed():
    """d1 generated 1,200 tokens: recomputing them on P is compute-bound and costs
    several times what pulling their KV over RDMA does (checked here on the roofline
    the router's default disaggregation section names), so the cheapest option is
    the pull, not the tie of re-prefill and affinity."""
    generated = 300  # blocks of BS tokens
    config = _config(PD)
    cfg = config.disaggregation
    model, fmt = prior_model(config), kv_format_preset(cfg.kv_format)
    hw, link = hardware_preset(cfg.p_hardware), link_preset(cfg.link_preset)
    span = generated * BS
    assert prefill(model, fmt, hw, span, STEP1_BLOCKS * BS).seconds > 5 * link.transfer_seconds(
        kv_bytes(model, fmt, span)
    )
    router, session, step2 = _session_after_step_one("", generated_blocks=generated)
    route = router.route(step2, "s2", session=session, now=0.0)
    assert route.option is Option.PULL and route.kind is Kind.REMOTE_PREFILL
    offer, use = router.take_session_offer(session, route, now=0.0)
    assert use == "sent" and offer is not None


def test_an_idle_d_holding_the_session_prefills_the_increment_itself():
    router, session, step2 = _session_after_step_one("", max_local_tokens=2048)
    route = router.route(step2, "s2", session=session, now=0.0)
    assert route.option.value == "local" and route.kind is Kind.LOCAL_PREFILL and route.prefill is None
    assert router.take_session_offer(session, route, now=0.0) == (None, "unused")


@pytest.mark.parametrize(
    ("measured_rates", "expected"),
    [
        (False, Kind.LOCAL_PREFILL),  # the roofline of an H100: the idle D prefills the increment itself
        (True, Kind.REMOTE_PREFILL),  # D measured at 1 s a token, P at 1 ms: the increment goes to P
    ],
)
def test_measured_rates_price_the_session_options_only_when_switched_on(measured_rates, expected):
    router, session, step2 = _session_after_step_one("", max_local_tokens=2048, measured_rates=measured_rates)
    rates = RateEstimator(
        lambda _engine: RolePriors.from_config(router.config.disaggregation, prior_model(router.config)).other
    )
    for new in (4, 8, 16, 32):
        rates.observe_prefill("d1", new, 0, 1.0 * new)
        for p in router.fleet.prefill:
            rates.observe_prefill(p.name, new, 0, 0.001 * new)
    router.rates = rates if measured_rates else None  # as Router.__init__ sets it from the switch
    route = router.route(step2, "s2", session=session, now=0.0)
    assert route.kind is expected and (route.option is Option.LOCAL) is (expected is Kind.LOCAL_PREFILL)
    price = {p.option.value: p for p in route.options}
    chosen = price[route.option.value]
    assert ("measured rates:" in chosen.why) is measured_rates
    if measured_rates:  # D's 2 new blocks at 1 s a token cost more than P's whole path: local is out
        assert not price["local"].available and "NO: remote cheaper" in price["local"].why


@pytest.mark.parametrize(("measured_rates", "expected"), [(False, Kind.LOCAL_PREFILL), (True, Kind.REMOTE_PREFILL)])
def test_measured_rates_decide_local_vs_remote_when_switched_on(measured_rates, expected):
    """D holds 9 of 10 blocks; with the cost comparison on, the roofline keeps the last
    block on D, a D measured at 1 s a token (P at 1 ms) sends it to P."""
    router = _router(_config(PD, disaggregation={"compare_costs": True, "measured_rates": measured_rates}))
    rates = RateEstimator(
        lambda _engine: RolePriors.from_config(router.config.disaggregation, prior_model(router.config)).other
    )
    for new in (4, 8, 16, 32):
        rates.observe_prefill("d1", new, 0, 1.0 * new)
        for p in ("p1", "p2"):
            rates.observe_prefill(p, new, 0, 0.001 * new)
    router.rates = rates if measured_rates else None  # as Router.__init__ sets it from the switch
    prompt = _prompt(10)
    _store(router.index, "d1", prompt[: 9 * BS])
    route = router.route(prompt, "r1")
    assert route.kind is expected, route.explain()
    assert route.local_remote is not None
    if measured_rates:
        # D's one block at 1 s a token, then its first step (on the prior: no decode timed)
        assert route.local_remote.local_s == pytest.approx(BS * 1.0 + rates.decode_step("d1", 1).seconds)


def test_the_measured_rates_switch_is_on_by_default_and_turns_off():
    cfg = _config(PD)
    assert cfg.disaggregation.measured_rates is True and cfg.disaggregation.compare_costs is True
    cfg = _config(PD, disaggregation={"measured_rates": False})
    router = Router(
        fleet_from_config(cfg),
        cfg,
        BlockIndex(BS),
        LoadLedger(),
        SessionStore(BS, 16),
        policy_from_config(cfg.disaggregation, prior_model(cfg)),
        rates=RateEstimator(lambda _engine: RolePriors.from_config(cfg.disaggregation, prior_model(cfg)).other),
    )
    assert router.rates is None


def test_an_offer_expiring_before_p_could_read_it_is_never_sent():
    router, session, step2 = _session_after_step_one("pull")
    router.sessions.get(session).offer = SessionOffer(WorkerId("d1"), OFFER, expires_at=3.0)
    route = router.route(step2, "s2", session=session, now=0.0)
    pull = {p.option.value: p for p in route.options}["pull"]
    assert not pull.available and "expires in 3.0 s" in pull.why
    assert route.option.value != "pull"
    assert router.take_session_offer(session, route, now=0.0) == (None, "expired")


def _ttft_router(objective: str) -> Router:
    """Two co-located workers: w1 holds 40 of the prompt's 44 blocks and decodes one other
    stream of 40 blocks; w2 holds 30 and is idle. Both prefill at 1 ms a token and step at
    1 ms plus 0.1 ms a stream (measured)."""
    cfg = _config(COLOCATED, cost={"objective": objective})
    fleet = fleet_from_config(cfg)
    prior = RolePriors.from_config(cfg.disaggregation, prior_model(cfg)).other
    rates = RateEstimator(lambda _engine: prior)
    for worker in ("w1", "w2"):
        for new in (4, 8, 16, 32):
            rates.observe_prefill(worker, new, 0, 0.001 * new)
        for streams in (1, 2, 3, 4):
            rates.observe_decode(worker, streams, 0.001 + 0.0001 * streams)
    router = Router(fleet, cfg, BlockIndex(BS), LoadLedger(), SessionStore(BS, 16), None, rates=rates)
    prompt = _prompt(44)
    _store(router.index, "w1", prompt[: 40 * BS])
    _store(router.index, "w2", prompt[: 30 * BS])
    router.ledger.dispatch("other", WorkerId("w1"), WorkerId("w1"), PromptChain(_prompt(40, base=5000), BS), 0)
    router.ledger.first_token("other")  # decoding now
    return router


@pytest.mark.parametrize(("objective", "expected"), [("blocks", "w2"), ("predicted_ttft", "w1")])
def test_by_predicted_ttft_a_worker_holding_the_history_beside_a_running_stream_beats_an_idle_one(objective, expected):
    """Dynamo's blocks count w1's running stream (40 decode blocks) against it, and send the
    prompt to w2, which recomputes 14 blocks; measured, w1's 4 blocks beside one stream are
    the faster first token."""
    router = _ttft_router(objective)
    route = router.route(_prompt(44), "r1")
    assert route.decode.name == expected, route.explain()
    terms = {t.name: t for t in route.decision.terms}
    if objective == "predicted_ttft":
        assert terms["w1"].predicted_ttft_s < terms["w2"].predicted_ttft_s
        assert terms["w2"].predicted_ttft_s - terms["w1"].predicted_ttft_s == pytest.approx(
            0.001 * 10 * BS - 0.0001, abs=2e-4
        )  # w2 prefills 10 more blocks; w1 steps beside one more stream
        assert "objective=predicted_ttft" in route.explain() and "cost=predicted_ttft(" in route.explain()
    else:
        assert all(t.predicted_ttft_s is None for t in terms.values())


def test_the_predicted_ttft_objective_needs_the_measured_rates():
    with pytest.raises(ConfigError, match=r"cost.objective.*measured_rates"):
        _config(COLOCATED, cost={"objective": "predicted_ttft"}, disaggregation={"measured_rates": False})


def test_d_s_gauge_counts_only_what_bypassed_the_router_beyond_its_ledger():
    """D's gauge is as old as its last poll: the router's own requests it counted then are
    taken from the ledger now (one that finished since is no running stream), and only the
    gauge's excess over them (traffic that bypassed the router) is added."""
    from kvpilot.routing.health.engine_load import EngineLoad

    cfg = _config(PD)
    fleet = fleet_from_config(cfg)
    ledger = LoadLedger()
    gauge = {"d1": EngineLoad(running=3, waiting=0, kv_usage=0.0, at=0.0)}
    router = Router(
        fleet,
        cfg,
        BlockIndex(BS),
        ledger,
        SessionStore(BS, 16),
        policy_from_config(cfg.disaggregation, prior_model(cfg)),
        random.Random(0),
        health=FleetHealth(CircuitBreaker(), PairHealth(cfg.cost), EventWatch(0.0), engine_load=gauge.get),
    )

    def streams() -> str:
        route = router.route(_prompt(6, base=500), "probe")
        assert route.local_remote is not None
        return re.search(r"stall on (\d+) streams", "; ".join(route.local_remote.reasons)).group(1)

    assert streams() == "3"  # no poll recorded: the whole gauge bypassed the router
    for n in range(2):
        ledger.dispatch(f"r{n}", WorkerId("p1"), WorkerId("d1"), PromptChain(_prompt(2, base=100 * n), BS), 0)
    router.engine_polled(WorkerId("d1"))  # the gauge's 3: the router's 2 and 1 that bypassed it
    assert streams() == "3"
    ledger.complete("r0")
    assert streams() == "2"  # r0 finished since the poll: no longer a stream


@pytest.mark.parametrize(("max_local_tokens", "stays"), [(2048, True), (0, False)])
def test_a_later_step_stays_on_its_d_only_where_d_may_prefill_it(max_local_tokens, stays):
    """The stay rule keeps a session's step on the D that holds its history, which can then
    prefill the increment itself; where D never prefills (``max_local_tokens: 0``, as beside
    Dynamo) that history buys nothing, and the step follows Dynamo's cost off a busy D."""
    cfg = _config(
        [_w("p1", "prefill"), _w("d1", "decode"), _w("d2", "decode")],
        disaggregation={"max_local_tokens": max_local_tokens},
        cost={"session_affinity_credit": 0.0},
    )
    router, session = _router(cfg), SessionId("s")
    first = router.route(_prompt(8), "s1", session=session, now=0.0)
    router.served(session, first, now=1.0)
    busy = "d1" if first.decode.name == "d1" else "d2"
    for n in range(3):  # the first step's D is now running long streams
        router.ledger.dispatch(
            f"busy{n}", WorkerId(busy), WorkerId(busy), PromptChain(_prompt(40, 1000 + 100 * n), BS), 0
        )
    second = router.route(_prompt(9), "s2", session=session, now=2.0)
    assert (second.decode.name == first.decode.name) is stays, second.explain()


@pytest.mark.parametrize(("weight", "second_p"), [(1.0, "p2"), (0.0, "p1")])
def test_a_first_step_avoids_the_p_where_a_session_lives_though_it_holds_the_shared_prefix(weight, second_p):
    """Where D never prefills, a session's later steps prefill on the P that holds its
    history: a second agent's first step placed there would meet the first's prefills at
    every step. A pair's P is charged for the sessions living on it as D is for its own
    (``cost.session_residency_weight``; 0: Dynamo's cost piles both on the P holding the
    shared prefix)."""
    cfg = _config(PD, disaggregation={"max_local_tokens": 0}, cost={"session_residency_weight": weight})
    router = _router(cfg)
    prefix = _prompt(6)
    _store(router.index, "p1", prefix)
    first = router.route(prefix + _prompt(2, base=1000), "a-0", session=SessionId("a"), now=0.0)
    assert first.prefill is not None and first.prefill.name == "p1"
    router.served(SessionId("a"), first, now=1.0)
    second = router.route(prefix + _prompt(2, base=2000), "b-0", session=SessionId("b"), now=1.5)
    assert second.prefill is not None and second.prefill.name == second_p, second.explain()


@pytest.mark.parametrize(("link", "expected"), [("", "w1"), ("pcie", "w2")])
def test_a_host_tier_is_credited_by_what_its_restore_saves_over_its_link(link: str, expected: str) -> None:
    """w1 holds 8 of the prompt's blocks in GPU; w2 holds 10 in its host tier (Dynamo's
    medium ``CPU_PINNED``). At Dynamo's preset host credit (0.75 a block: 7.5) w1 wins; with
    ``cost.host_restore_link: pcie`` a llama-8b block restored over PCIe saves 96% of its
    prefill on an H100 (9.6 blocks' credit), and w2 wins."""
    cost = {"host_restore_link": link} if link else {}
    router = _router(_config(COLOCATED, cost=cost, disaggregation={"model_preset": "llama-8b"}))
    prompt = _prompt(12)
    _store(router.index, "w1", prompt[: 8 * BS])
    hashes = [f"w2-{i}".encode() for i in range(10)]
    router.index.apply(WorkerId("w2"), BlockStored(hashes, None, prompt[: 10 * BS], BS, medium="CPU_PINNED"))
    assert router.route(prompt, "r").decode.name == expected
    credit = router.cost.cfg.host_cache_hit_weight
    if link:
        model, fmt = model_preset("llama-8b"), kv_format_preset("bf16")
        assert credit == host_block_credit(model, fmt, hardware_preset("h100"), link_preset("pcie"), BS)
        assert credit == pytest.approx(0.958, abs=1e-3)
    else:
        assert credit == 0.75


def test_an_unknown_restore_link_is_refused_naming_its_key() -> None:
    with pytest.raises(ConfigError, match=r"cost\.host_restore_link.*unknown preset 'pcie5'"):
        _config(COLOCATED, cost={"host_restore_link": "pcie5"})
