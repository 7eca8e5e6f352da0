"""kvpilot.routing.serve.proxy on its own: one routed request through an in-process
Upstream (no HTTP, no aiohttp.web), its fallback, retry and bookkeeping."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.routing.config import Role, RouterConfig, Worker, prior_model
from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.lifecycle import Lifecycle
from kvpilot.routing.decide.rates import PREFILL_TIMEOUT_FACTOR, RateEstimator, RolePriors
from kvpilot.routing.decide.router import Kind, Route, Router, policy_from_config
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.health.circuit import CircuitBreaker
from kvpilot.routing.health.event_watch import EventWatch
from kvpilot.routing.health.pair_health import PairHealth
from kvpilot.routing.health.view import FleetHealth
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.serve.driver import ProxyRequest, RequestDriver
from kvpilot.routing.serve.proxy import Proxy
from kvpilot.routing.serve.upstream import (
    Api,
    EngineRequest,
    PrefillFailure,
    PrefillOutcome,
    StreamBroke,
    UpstreamError,
)

BS = 4
HANDOFF = {"do_remote_decode": False, "remote_block_ids": [[0]], "remote_engine_id": "p"}


class ScriptedUpstream:
    """Answers as told, and records every call: ``(kind, worker, body, params)``."""

    def __init__(
        self,
        prefill: PrefillOutcome | None = None,
        failing_decoders: Mapping[str, int] | None = None,
        stream_breaks_after: int | None = None,
    ) -> None:
        self.prefill_outcome = prefill or PrefillOutcome(HANDOFF)
        self.failing_decoders = failing_decoders or {}
        self.stream_breaks_after = stream_breaks_after
        self.calls: list[tuple[str, str, dict[str, Any], dict[str, Any] | None]] = []
        self.timeouts: list[float] = []

    async def prefill(
        self, worker: Worker, request: EngineRequest, params: dict[str, Any], timeout_s: float
    ) -> PrefillOutcome:
        self.timeouts.append(timeout_s)
        self.calls.append(("prefill", worker.name, request.body, params))
        return self.prefill_outcome

    def _refuse(self, worker: Worker) -> None:
        status = self.failing_decoders.get(worker.name)
        if status is not None:
            raise UpstreamError(worker, status, f"answered {status}")

    async def complete(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> dict[str, Any]:
        self.calls.append(("complete", worker.name, request.body, handoff))
        self._refuse(worker)
        return {"id": "x", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}

    @asynccontextmanager
    async def stream(
        self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None
    ) -> AsyncIterator[AsyncIterator[list[str]]]:
        self.calls.append(("stream", worker.name, request.body, handoff))
        self._refuse(worker)
        breaks_after = self.stream_breaks_after

        async def events() -> AsyncIterator[list[str]]:
            for i in range(3):
                if breaks_after is not None and i == breaks_after:
                    raise StreamBroke("connection reset")
                yield ['{"id": "x", "choices": [{"index": 0, "text": "t"}]}']
            yield ["[DONE]"]

        yield events()


class RecordingClient:
    def __init__(self) -> None:
        self.headers: Mapping[str, str] | None = None
        self.events: list[str] = []
        self.closed = False

    async def open(self, headers: Mapping[str, str]) -> None:
        self.headers = headers

    async def send(self, events: Sequence[str]) -> None:
        self.events.extend(events)

    async def close(self) -> None:
        self.closed = True


def _fleet_config(decoders: int = 2, prefills: int = 1) -> RouterConfig:
    workers = [Worker(WorkerId(f"p{i}"), Role.PREFILL, f"http://127.0.0.1:{100 + i}") for i in range(prefills)]
    workers += [Worker(WorkerId(f"d{i}"), Role.DECODE, f"http://127.0.0.1:{2 + i}") for i in range(decoders)]
    return RouterConfig(workers=tuple(workers))


def _remote(route: Route, router: Router) -> Route:
    """``route`` as a remote prefill on the fleet's P, whatever the policy chose."""
    return dataclasses.replace(route, kind=Kind.REMOTE_PREFILL, prefill=router.fleet.prefill[0])


class Rig:
    """A proxy over a real Router, ledger, breaker and metrics, with ``upstream``."""

    def __init__(self, upstream: ScriptedUpstream, decoders: int = 2, max_retries: int = 1, prefills: int = 1) -> None:
        cfg = _fleet_config(decoders, prefills)
        fleet = fleet_from_config(cfg)
        self.ledger = LoadLedger()
        self.breaker = CircuitBreaker(failures_to_open=1, open_s=60.0)
        self.metrics = RouterMetrics([w.name for w in fleet.workers])
        policy = policy_from_config(cfg.disaggregation, prior_model(cfg))
        health = FleetHealth(self.breaker, PairHealth(cfg.cost), EventWatch(0.0))
        self.router = Router(
            fleet, cfg, BlockIndex(BS), self.ledger, SessionStore(BS, 8), policy, random.Random(0), health=health
        )
        self.upstream = upstream
        priors = RolePriors.from_config(cfg.disaggregation, prior_model(cfg))
        self.rates = RateEstimator(lambda engine: priors.of(fleet.by_name(WorkerId(engine)).role))
        self.lifecycle = Lifecycle(self.router, rates=self.rates)
        self.driver = RequestDriver(upstream, self.lifecycle, self.metrics, prefill_timeout_s=30.0)
        self.proxy = Proxy(self.driver, max_retries)

    def request(self, body: dict[str, Any], exclude_calls: list[frozenset[WorkerId]] | None = None) -> ProxyRequest:
        prompt = list(range(8 * BS))
        route = self.router.route(prompt, "req-1", exclude=frozenset())
        forced = _remote(route, self.router)

        def reroute(exclude: frozenset[WorkerId]) -> Route | None:
            if exclude_calls is not None:
                exclude_calls.append(exclude)
            try:
                again = self.router.route(prompt, "req-1", exclude=exclude)
            except Exception:  # noqa: BLE001 - the router's NoHealthyWorker: nothing left
                return None
            return _remote(again, self.router)

        engine = EngineRequest(Api.COMPLETIONS, {"prompt": prompt, **body}, prompt)
        return ProxyRequest(forced, engine, None, 0.0, reroute)

    def value(self, name: str, **labels: str) -> float:
        got = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if got is None else got


def test_remote_prefill_hands_p_params_to_d_and_books_every_step():
    rig = Rig(ScriptedUpstream())
    reply = asyncio.run(rig.proxy.serve(rig.request({"max_tokens": 4}), RecordingClient()))
    assert reply is not None and reply.status == 200
    assert reply.headers["X-KVPilot-Route"] == "remote_prefill"
    assert reply.headers["X-KVPilot-Prefill-Worker"] == "p0"
    (kind, worker, _, params), (d_kind, d_worker, _, handoff) = rig.upstream.calls
    assert (kind, worker, params) == ("prefill", "p0", handoff_request())
    assert d_kind == "complete" and d_worker == reply.headers["X-KVPilot-Decode-Worker"] and handoff == HANDOFF
    assert rig.ledger.load(WorkerId("p0")).active_requests == 0  # completed, nothing left in flight
    assert rig.value("kvpilot_router_prefill_fallbacks_total") == 0
    assert rig.rates.prefill("p0", 8 * BS, 0).samples == 1  # P's answer timed: the estimator learns P's prefill
    assert rig.upstream.timeouts == [30.0]  # the H100 prior predicts milliseconds: the floor
    assert (
        rig.metrics.registry.get_sample_value("kvpilot_router_ttft_observed_over_predicted_count", {"stage": "prefill"})
        == 1
    )


def test_p_s_timeout_is_k_times_its_measured_prefill_above_the_floor():
    """A box measured slow (0.5 s a token) gives P 3 x its predicted prefill, not the floor."""
    rig = Rig(ScriptedUpstream())
    for new in (32, 64, 128, 256):
        rig.rates.observe_prefill("p0", new, 0, 0.5 * new)
    reply = asyncio.run(rig.proxy.serve(rig.request({"max_tokens": 4}), RecordingClient()))
    assert reply is not None and reply.status == 200
    (timeout,) = rig.upstream.timeouts
    assert timeout == pytest.approx(PREFILL_TIMEOUT_FACTOR * 0.5 * 8 * BS)
    assert timeout > 30.0


@pytest.mark.parametrize(
    ("outcome", "reason", "counts_against_p"),
    [
        (PrefillOutcome(None, PrefillFailure.ENGINE_ERROR, 500), "status_500", True),
        (PrefillOutcome(None, PrefillFailure.REFUSED, 400), "status_400", False),
        (PrefillOutcome(None, PrefillFailure.TIMEOUT), "timeout", True),
        (PrefillOutcome(None, PrefillFailure.NO_KV_TRANSFER_PARAMS), "no_kv_transfer_params", False),
    ],
)
def test_a_failed_prefill_falls_back_to_d_as_the_fallback_kind(outcome, reason, counts_against_p):
    rig = Rig(ScriptedUpstream(prefill=outcome))
    reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert reply is not None and reply.status == 200
    assert reply.headers["X-KVPilot-Route"] == Kind.FALLBACK.value
    assert reply.headers["X-KVPilot-Prefill-Worker"] == reply.headers["X-KVPilot-Decode-Worker"]
    assert rig.upstream.calls[-1][0] == "complete" and rig.upstream.calls[-1][3] is None  # D prefills itself
    assert rig.value("kvpilot_router_prefill_failures_total", worker="p0", reason=reason) == 1
    assert rig.value("kvpilot_router_prefill_fallbacks_total") == 1
    assert rig.breaker.allows(WorkerId("p0"), time.monotonic()) is not counts_against_p


def test_a_decoder_that_fails_before_answering_is_left_out_and_the_request_retried():
    first = ScriptedUpstream()
    rig = Rig(first)
    d_first = rig.request({}).route.decode.name
    rig.upstream.failing_decoders = {d_first: 502}
    excluded: list[frozenset[WorkerId]] = []
    reply = asyncio.run(rig.proxy.serve(rig.request({}, excluded), RecordingClient()))
    assert reply is not None and reply.status == 200
    assert excluded == [frozenset({d_first})]
    assert reply.headers["X-KVPilot-Decode-Worker"] != d_first
    assert rig.value("kvpilot_router_retries_total", worker=d_first) == 1
    assert rig.value("kvpilot_router_circuit_open", worker=d_first) == 1


def test_a_4xx_from_d_is_the_request_s_fault_and_not_retried():
    rig = Rig(ScriptedUpstream())
    d_first = rig.request({}).route.decode.name
    rig.upstream.failing_decoders = {d_first: 400}
    excluded: list[frozenset[WorkerId]] = []
    reply = asyncio.run(rig.proxy.serve(rig.request({}, excluded), RecordingClient()))
    assert reply is not None and reply.status == 400 and reply.payload["error"]["type"] == "upstream_error"
    assert excluded == [] and rig.breaker.allows(WorkerId(d_first), time.monotonic())


def test_retries_stop_at_max_retries():
    rig = Rig(ScriptedUpstream(failing_decoders={"d0": 502, "d1": 502}), max_retries=1)
    reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert reply is not None and reply.status == 502
    assert sorted(c[1] for c in rig.upstream.calls if c[0] == "complete") == ["d0", "d1"]  # one try, one retry


def test_a_stream_is_relayed_and_a_break_ends_it_with_an_error_event_against_d():
    rig = Rig(ScriptedUpstream(stream_breaks_after=2))
    client = RecordingClient()
    reply = asyncio.run(rig.proxy.serve(rig.request({"stream": True}), client))
    d = rig.upstream.calls[-1][1]
    assert reply is None and client.closed and client.headers is not None
    assert client.headers["X-KVPilot-Route"] == "remote_prefill"
    assert (
        len(client.events) == 3
        and "stream broke: connection reset" in client.events[-1]
        and '"code": 502' in client.events[-1]
    )
    assert rig.value("kvpilot_router_upstream_errors_total", worker=d) == 1
    assert not rig.breaker.allows(WorkerId(d), time.monotonic())


OFFER = {"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_block_ids": [[3, 4]], "kvpilot_hold": True}
"""D's offer of the session's KV, as a decode engine in vLLM's bidirectional mode returns it."""


class OfferingUpstream(ScriptedUpstream):
    """D answers with its offer and a ``kvpilot_*`` key at the top level, whole and in each
    streamed chunk; one chunk only names them in its text; one is not JSON at all."""

    async def complete(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> dict[str, Any]:
        answer = await super().complete(worker, request, handoff)
        return {**answer, "kv_transfer_params": OFFER, "kvpilot_lease": 30}

    @asynccontextmanager
    async def stream(
        self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None
    ) -> AsyncIterator[AsyncIterator[list[str]]]:
        async def events() -> AsyncIterator[list[str]]:
            chunk = {"id": "x", "choices": [{"index": 0, "text": "t"}]}
            yield [json.dumps({**chunk, "kv_transfer_params": OFFER}), json.dumps({**chunk, "kvpilot_lease": 30})]
            yield [json.dumps({"id": "x", "choices": [{"index": 0, "text": 'say "kv_transfer_params"'}]})]
            yield ['{"id": "x", "kv_transfer_params": {"remote_host": "10.0.0.7"', "[DONE]"]

        yield events()


def _kept_offers(rig: Rig) -> list[object]:
    """The offers D's answers hand the lifecycle (the session's, for its next step)."""
    kept: list[object] = []
    finished = rig.driver.lifecycle.finished

    def recording(ticket: Any, *, answered: bool, decode_params: object = None) -> Any:
        kept.append(decode_params)
        return finished(ticket, answered=answered, decode_params=decode_params)

    rig.driver.lifecycle.finished = recording  # type: ignore[method-assign]
    return kept


def test_the_relay_withholds_d_s_offer_and_kvpilot_keys_whole_and_streamed():
    """The client never reads D's offer (where the session's KV lives, how to pull it) nor a
    top-level ``kvpilot_*`` key: ``null`` and gone in a whole answer, gone from each streamed
    chunk; a chunk whose text only names them passes as D wrote it, and one that names them
    but cannot be read is withheld. The offer is the router's, kept for the session's next
    step, whole or streamed (vLLM 0.34 streams it)."""
    rig = Rig(OfferingUpstream())
    kept = _kept_offers(rig)
    reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert reply is not None and reply.payload["kv_transfer_params"] is None and "kvpilot_lease" not in reply.payload
    assert kept == [OFFER]
    rig = Rig(OfferingUpstream())
    kept = _kept_offers(rig)
    client = RecordingClient()
    assert asyncio.run(rig.proxy.serve(rig.request({"stream": True}), client)) is None
    assert kept == [OFFER]
    first, second, named, broken, done = client.events
    assert json.loads(first) == json.loads(second) == {"id": "x", "choices": [{"index": 0, "text": "t"}]}
    assert json.loads(named)["choices"][0]["text"] == 'say "kv_transfer_params"'
    assert "withheld" in json.loads(broken)["error"]["message"] and "10.0.0.7" not in broken
    assert done == "[DONE]"


def test_several_samples_are_prefilled_on_d_and_p_is_never_asked():
    """``n`` > 1 routed to a remote prefill: vLLM would fan the samples out into requests that
    each read P's one handoff, so D prefills it, without a handoff, as a local prefill."""
    rig = Rig(ScriptedUpstream())
    reply = asyncio.run(rig.proxy.serve(rig.request({"n": 2}), RecordingClient()))
    assert reply is not None and reply.status == 200
    assert reply.headers["X-KVPilot-Route"] == "local_prefill"
    assert [(kind, handoff) for kind, _, _, handoff in rig.upstream.calls] == [("complete", None)]
    assert rig.value("kvpilot_router_prefill_fallbacks_total") == 0


def test_a_request_id_already_in_flight_is_refused():
    rig = Rig(ScriptedUpstream())
    request = rig.request({})
    rig.ledger.dispatch(request.route.request_id, WorkerId("p0"), WorkerId("d0"), request.route.chain, 0)
    reply = asyncio.run(rig.proxy.serve(request, RecordingClient()))
    assert reply is not None and reply.status == 409 and rig.upstream.calls == []


class DeferringUpstream(ScriptedUpstream):
    """Names P for D's call instead of prefilling (as Dynamo's frontend does the
    handoff itself), and records P's booked prefill while D is called."""

    def __init__(self, ledger_of: Any) -> None:
        super().__init__(prefill=PrefillOutcome({"x-prefill": "p0"}, deferred=True))
        self.ledger_of = ledger_of
        self.p_prefill_blocks_during_d: list[int] = []

    async def complete(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> dict[str, Any]:
        self.p_prefill_blocks_during_d.append(self.ledger_of().load(WorkerId("p0")).active_prefill_blocks)
        return await super().complete(worker, request, handoff)


@pytest.mark.parametrize("deferred", [True, False])
def test_a_deferred_prefill_goes_with_d_s_call_and_p_prefills_until_d_answers(deferred):
    rig = Rig(ScriptedUpstream())
    upstream = DeferringUpstream(lambda: rig.ledger)
    if not deferred:
        upstream.prefill_outcome = PrefillOutcome(HANDOFF)
    rig.driver.upstream = upstream
    reply = asyncio.run(rig.proxy.serve(rig.request({}), RecordingClient()))
    assert reply is not None and reply.status == 200
    assert reply.headers["X-KVPilot-Route"] == Kind.REMOTE_PREFILL.value
    assert upstream.calls[-1][3] == ({"x-prefill": "p0"} if deferred else HANDOFF)  # D's call carries it
    (during,) = upstream.p_prefill_blocks_during_d
    assert (during > 0) is deferred  # a deferred P is still prefilling while D is called
    prefill_stage = rig.value("kvpilot_router_ttft_stage_seconds_count", stage="prefill")
    assert prefill_stage == (0 if deferred else 1)  # no answer of P's to time when it is deferred
    assert rig.ledger.load(WorkerId("p0")) == rig.ledger.load(WorkerId("nobody"))  # all released at the end


def test_every_known_label_set_exists_at_zero_from_the_start():
    """A dashboard's increase() sees the first event only if the series existed before it."""
    metrics = Rig(ScriptedUpstream()).metrics
    for option in ("reprefill", "pull", "affinity", "shared_tier", "local"):
        assert metrics.registry.get_sample_value("kvpilot_router_session_options_total", {"option": option}) == 0
    for outcome in ("sent", "expired", "unused"):
        assert metrics.registry.get_sample_value("kvpilot_router_session_offers_total", {"outcome": outcome}) == 0


@pytest.mark.parametrize("timed_here", [True, False])
def test_where_engines_publish_no_timings_a_prefill_within_d_s_call_is_timed_by_d_s_first_token(timed_here):
    """Dynamo's workers have no vLLM /metrics: the router learns their prefill from the
    streamed first token of an uncontended request, P's when it was deferred into D's
    call, D's own when D prefilled; never twice for a P that answered itself."""
    rig = Rig(ScriptedUpstream())
    rig.lifecycle.prefills_timed_here = timed_here
    rig.driver.upstream = DeferringUpstream(lambda: rig.ledger)
    asyncio.run(rig.proxy.serve(rig.request({"stream": True}), RecordingClient()))
    assert rig.rates.prefill("p0", 8 * BS, 0).samples == (1 if timed_here else 0)

    local = Rig(ScriptedUpstream())
    local.lifecycle.prefills_timed_here = timed_here
    request = local.request({"stream": True})
    request = dataclasses.replace(
        request, route=dataclasses.replace(request.route, kind=Kind.LOCAL_PREFILL, prefill=None)
    )
    asyncio.run(local.proxy.serve(request, RecordingClient()))
    d = local.upstream.calls[-1][1]
    assert local.rates.prefill(d, 8 * BS, 0).samples == (1 if timed_here else 0)

    answered = Rig(ScriptedUpstream())  # P answered its prefill: timed once, by that answer
    answered.lifecycle.prefills_timed_here = timed_here
    asyncio.run(answered.proxy.serve(answered.request({"stream": True}), RecordingClient()))
    assert answered.rates.prefill("p0", 8 * BS, 0).samples == 1


def test_the_predicted_ttft_header_says_uncalibrated_until_a_prefill_is_measured():
    """A fresh fleet's prediction is the prior's (an H100 pricing a CPU box: 0.009 ms): the
    header says so instead of printing it; once a prefill is measured it carries the figure."""
    from kvpilot.routing.decide.rates import Estimate, TTFTPrediction
    from kvpilot.routing.serve.driver import UNCALIBRATED, predicted_ttft_header

    nothing = Estimate(0.0, None, 0)
    prior_only = TTFTPrediction(nothing, Estimate(9e-6, None, 0), nothing, nothing, nothing)
    assert predicted_ttft_header(prior_only) == UNCALIBRATED
    measured = dataclasses.replace(prior_only, prefill=Estimate(9e-6, 0.040, 4, "p"))
    assert predicted_ttft_header(measured) == f"{measured.seconds * 1e3:.3f}"
    assert float(predicted_ttft_header(measured)) == pytest.approx(40.0)
