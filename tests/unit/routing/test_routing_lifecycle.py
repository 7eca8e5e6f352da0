"""kvpilot.routing.decide.lifecycle driven through the relay: a failed prefill recovered on
measured costs (another P, D within its jitter budget, or a fast error), a broken stream
that does not pin its session, a half-open circuit's single probe; and the fronts hold no
booking of their own."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import msgspec
import pytest

from kvpilot.kvconnectors.pull_params import HOLD_KEY
from kvpilot.policies.session_hold import HoldReason
from kvpilot.routing.config import HoldMode
from kvpilot.routing.decide.router import Kind
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.serve.upstream import PrefillFailure, PrefillOutcome
from tests.unit.routing.test_routing_proxy import BS, HANDOFF, RecordingClient, Rig, ScriptedUpstream

ROOT = Path(__file__).resolve().parents[3]
FAILED = PrefillOutcome(None, PrefillFailure.ENGINE_ERROR, 500)


class FailsOn(ScriptedUpstream):
    """P ``failing`` answers 500; the other prefill workers hand off."""

    def __init__(self, failing: str, **kw) -> None:
        super().__init__(**kw)
        self.failing = failing

    async def prefill(self, worker, request, params, timeout_s):
        outcome = await super().prefill(worker, request, params, timeout_s)
        return FAILED if worker.name == self.failing else outcome


def _busy(rig: Rig, d: str, streams: int) -> None:
    """``streams`` other requests decoding on ``d``, and D measured slow to prefill
    (1 s for the rig's 32-token prompt) but quick to step (10 ms)."""
    for i in range(streams):
        chain = PromptChain(list(range(1000 + 10 * i, 1000 + 10 * i + BS)), BS)
        rig.ledger.dispatch(f"other-{i}", WorkerId(d), WorkerId(d), chain, 1)
        rig.ledger.first_token(f"other-{i}")
    _slow_prefill(rig, d)
    for _ in range(8):
        rig.rates.observe_decode(d, streams + 1, 0.01)


def _slow_prefill(rig: Rig, worker: str, tokens_per_s: float = 32.0) -> None:
    """``worker`` measured prefilling ``tokens_per_s``."""
    for tokens in (8, 16, 32, 64, 128, 256) * 2:
        rig.rates.observe_prefill(worker, tokens, 0, tokens / tokens_per_s)


def test_a_failed_prefill_moves_to_another_prefill_worker():
    rig = Rig(FailsOn("p0"), prefills=2)
    for d in ("d0", "d1"):
        _slow_prefill(rig, d)  # the prompt would take D a second, p1 a tenth of that
    _slow_prefill(rig, "p1", tokens_per_s=320.0)
    reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert reply is not None and reply.status == 200
    assert reply.headers["X-KVPilot-Route"] == Kind.REMOTE_PREFILL.value
    assert reply.headers["X-KVPilot-Prefill-Worker"] == "p1"
    assert [(kind, worker) for kind, worker, _, _ in rig.upstream.calls][:2] == [("prefill", "p0"), ("prefill", "p1")]
    assert rig.upstream.calls[-1][3] is not None  # D pulls from p1
    assert rig.value("kvpilot_router_prefill_recoveries_total", action="other_prefill") == 1
    assert rig.value("kvpilot_router_prefill_fallbacks_total") == 0
    assert all(rig.ledger.load(WorkerId(w)) == (0, 0, 0, 0) for w in ("p0", "p1", "d0", "d1"))


def test_with_no_other_prefill_worker_an_idle_d_prefills_it():
    rig = Rig(FailsOn("p0"))
    reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert reply is not None and reply.headers["X-KVPilot-Route"] == Kind.FALLBACK.value
    assert rig.value("kvpilot_router_prefill_recoveries_total", action="local") == 1


def test_a_busy_d_past_its_jitter_budget_fails_fast_naming_why():
    rig = Rig(FailsOn("p0"), decoders=1)
    _busy(rig, "d0", streams=4)  # a local prefill would pause 4 streams ~1 s each
    started = time.perf_counter()
    reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert time.perf_counter() - started < 1.0
    assert reply is not None and reply.status == 503
    message = reply.payload["error"]["message"]
    assert "prefill on p0 failed (status_500)" in message and "stall D's 4 streams" in message
    assert [kind for kind, *_ in rig.upstream.calls] == ["prefill"]  # D was never asked
    assert rig.value("kvpilot_router_prefill_recoveries_total", action="fail") == 1
    assert rig.ledger.load(WorkerId("d0")).active_requests == 4  # only the other streams remain


def test_a_broken_stream_does_not_pin_the_session_to_its_d():
    rig = Rig(ScriptedUpstream(stream_breaks_after=1))
    request = dataclasses.replace(rig.request({"stream": True}), session=SessionId("s1"))
    asyncio.run(rig.proxy.serve(request, RecordingClient()))
    assert rig.router.sessions.get(SessionId("s1")).last_worker is None
    rig.upstream.stream_breaks_after = None
    request = dataclasses.replace(rig.request({"stream": True}), session=SessionId("s2"))
    asyncio.run(rig.proxy.serve(request, RecordingClient()))
    assert rig.router.sessions.get(SessionId("s2")).last_worker == request.route.decode.name


def test_a_half_open_worker_takes_one_probe_and_its_answer_closes_it():
    rig = Rig(ScriptedUpstream())
    request = rig.request({})
    d = request.route.decode.name
    rig.breaker.failed(d, time.monotonic() - 120.0)  # opened two minutes ago: half-open now
    ticket = rig.lifecycle.dispatch(request.route, None)
    assert d in ticket.probes and not rig.breaker.allows(d, time.monotonic())  # the rest wait for the probe
    ended = rig.lifecycle.finished(ticket, answered=True)
    assert ended.circuit is not None and not ended.circuit.opened and rig.breaker.allows(d, time.monotonic())


FRONTS = ("routing/serve/proxy.py", "routing/gateway/picker.py", "routing/serve/driver.py", "benchmarks/sim/kvpilot.py")
BOOKING = {
    "ledger",
    "breaker",
    "sessions",
    "pair_health",
    "residency",
    "prefill_residency",
    "served",
    "take_session_offer",
    "move_prefill",
}


@pytest.mark.parametrize("front", FRONTS)
def test_the_fronts_hold_no_booking(front):
    """The relay, the picker and the simulator drive the lifecycle: none touches the ledger,
    the sessions or the circuit breakers itself."""
    tree = ast.parse((ROOT / front).read_text())
    touched = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} & BOOKING)
    assert touched == [], f"{front} books {touched} itself"


@pytest.mark.parametrize("front", ["routing/serve/proxy.py", "routing/gateway/picker.py", "routing/serve/app.py"])
def test_the_live_fronts_reach_the_lifecycle_through_the_driver_alone(front):
    """One request driver: the relay and the picker add their own I/O to the driver's steps
    and never book with the lifecycle (claims, dispatch, ends) themselves; they may read its
    predictions (``/debug/route``)."""
    tree = ast.parse((ROOT / front).read_text())
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not names & {"_lifecycle", "Lifecycle", "claim", "claim_session", "dispatch"}, front
    lifecycle_calls = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "lifecycle"
    }
    assert lifecycle_calls <= {"predict", "predict_option"}, front


D_OFFER = {
    "do_remote_decode": True,
    "remote_block_ids": [[3, 4]],
    "remote_engine_id": "d",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
}
"""D's bidirectional offer of a session's KV (its hold's end is added when it is made)."""


class Offering(ScriptedUpstream):
    """D answers with its bidirectional offer of the session's KV."""

    async def complete(self, worker, request, handoff):
        return {
            **await super().complete(worker, request, handoff),
            "kv_transfer_params": {**D_OFFER, "kvpilot_expires_at": time.time() + 600},
        }


def test_d_s_offer_stays_with_the_router_and_never_reaches_the_client():
    """Where the session's KV lives and how to read it (issue 41): the router keeps D's offer
    for the session's next step; the client's answer carries null, as vLLM's does for a
    request that transferred nothing."""
    rig = Rig(Offering())
    request = dataclasses.replace(rig.request({}), session=SessionId("s1"))
    reply = asyncio.run(rig.proxy.serve(request, RecordingClient()))
    assert reply is not None and reply.status == 200
    assert reply.payload["kv_transfer_params"] is None and reply.payload["choices"][0]["text"] == "ok"
    offer = rig.router.sessions.get(SessionId("s1")).offer
    assert offer is not None and offer.holder == request.route.decode.name


def test_d_holds_a_session_s_step_only_while_the_session_is_expected_back():
    """The router measures the session's gaps and the hold D's offers state, and tells D in
    P's handoff whether to hold the step's KV (:mod:`kvpilot.policies.session_hold`)."""
    rig = Rig(Offering())
    request = dataclasses.replace(rig.request({}), session=SessionId("s1"))
    asyncio.run(rig.proxy.serve(request, RecordingClient()))
    assert rig.upstream.calls[-1][3] == {**HANDOFF, HOLD_KEY: True}  # D told to hold: a first step
    assert rig.value("kvpilot_router_session_holds_total", decision="hold", reason="first_step") == 1
    session, route, router = SessionId("s2"), request.route, rig.router
    router.hold(session, route, now=1000.0)
    router.served(session, route, {**D_OFFER, "kvpilot_expires_at": 1020.0}, now=1000.0)  # D holds 20 s
    back = router.hold(session, route, now=1010.0)  # a 10 s gap, within 20 s less the pull's margin
    assert (back.hold, back.reason, back.horizon_s) == (True, HoldReason.RETURNS_WITHIN_HOLD, 15.0)
    router.served(session, route, {**D_OFFER, "kvpilot_expires_at": 1032.0}, now=1012.0)
    late = router.hold(session, route, now=1052.0)  # gaps 10 and 40 s: 25 s expected
    assert (late.hold, late.reason, late.expected_gap_s) == (False, HoldReason.OUTLASTS_HOLD, 25.0)
    router.config = msgspec.structs.replace(
        router.config, sessions=msgspec.structs.replace(router.config.sessions, hold=HoldMode.ALWAYS)
    )
    assert router.hold(session, route, now=1060.0) is None  # vLLM's own hold: the handoff says nothing


REFUSED = PrefillOutcome(None, PrefillFailure.REFUSED, 400, "'logprobs' must be at most 20")


@pytest.mark.parametrize("d_refuses", [True, False])
def test_a_body_p_refuses_is_the_client_s_error_unless_d_serves_it(d_refuses, caplog):
    """P answers 4xx to the client's own body (issue 41): D is asked as it is. D refusing too
    makes it the client's error, passed back as D wrote it, and nothing of the router's is
    counted or logged as an error; D serving it is a router bug (P was sent what D took)."""
    rig = Rig(ScriptedUpstream(prefill=REFUSED, failing_decoders={"d0": 400, "d1": 400} if d_refuses else None))
    with caplog.at_level(logging.INFO):
        reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert reply is not None and reply.status == (400 if d_refuses else 200)
    assert rig.value("kvpilot_router_prefill_fallbacks_total") == (0 if d_refuses else 1)
    assert rig.breaker.allows(WorkerId("p0"), time.monotonic())  # not P's fault either way
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ([] if d_refuses else [errors[0]]) and (d_refuses or "router bug" in errors[0])
