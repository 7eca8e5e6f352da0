"""One price (issue 50, item 3): on one state, the router's choice, the predicted-TTFT
header, the TTFT SLO check and ``/debug/route`` read the same predicted TTFT, and D's
running streams in it count what D's own gauge reports beyond this router's requests."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvpilot.routing.decide.rates import RateEstimator
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.serve.driver import PREDICTED_TTFT_HEADER
from tests.unit.routing.test_routing_server import PD, PROMPT, run

UNBOOKED = 3
"""Requests D's gauge reports running that this router never sent (another replica's)."""
GAUGES = (
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {UNBOOKED}.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.1\n'
)
SESSION = {"X-Session-ID": "one-price"}
STEP_2 = PROMPT + PROMPT[:2] + PROMPT[7:30]
"""The session's second step: its first prompt, two generated tokens, a tool's output."""


def _measured(rates: RateEstimator) -> None:
    """P quick to prefill, D slow (a session step goes to P), D's decode step slower with
    each running stream: the prediction's first step tells 1 stream from 4."""
    for tokens in (8, 16, 32, 64, 128, 256) * 2:
        rates.observe_prefill("prefill-0", tokens, 0, tokens / 3200)
        rates.observe_prefill("decode-0", tokens, 0, tokens / 32)
    for streams in (1, 2, 4, 8) * 4:
        rates.observe_decode("decode-0", streams, 0.01 + 0.02 * streams)


def test_the_choice_the_header_the_slo_check_and_debug_route_read_one_price(model_dir):
    async def scenario(client, server, engines):
        core = server.core
        _measured(core.rates)
        first = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=SESSION)
        assert first.status == 200
        engines["decode-0"].metrics_text = GAUGES
        for _ in range(100):  # the poller runs every 0.05 s
            priced = await (await client.post("/debug/route", json={"prompt": STEP_2}, headers=SESSION)).json()
            local = next(o for o in priced["options"] if o["option"] == "local")
            if f"stall on {UNBOOKED} streams" in local["why"]:
                break
            await asyncio.sleep(0.05)
        assert f"stall on {UNBOOKED} streams" in local["why"], local["why"]
        (chosen,) = (o for o in priced["options"] if o["chosen"])
        assert chosen["option"] != "local", priced["explain"]  # a local option may be priced with its stall
        figure = priced["predicted"]["ttft_s"]
        assert chosen["ttft_s"] == figure, priced["explain"]  # the router's choice and /debug/route
        assert chosen["predicted"]["ttft_s"] == figure
        first_step = core.rates.decode_step(WorkerId("decode-0"), UNBOOKED + 1).seconds
        assert priced["predicted"]["first_step"]["measured_s"] == pytest.approx(first_step)  # D's gauge counted

        def slo(seconds: float) -> None:
            server_cfg = msgspec.structs.replace(core.config.server, ttft_slo_s=seconds)
            core.intake.config = msgspec.structs.replace(core.config, server=server_cfg)

        slo(figure * (1 - 1e-9))  # the SLO check compares the same figure: just under it is refused ...
        refused = await client.post("/v1/completions", json={"prompt": STEP_2, "max_tokens": 2}, headers=SESSION)
        assert refused.status in (429, 503), await refused.text()
        slo(figure * (1 + 1e-9))  # ... just over it is served, with the same figure in its header
        served = await client.post("/v1/completions", json={"prompt": STEP_2, "max_tokens": 2}, headers=SESSION)
        assert served.status == 200, await served.text()
        assert served.headers["X-KVPilot-Prefill-Worker"] == chosen["prefill_worker"]
        assert float(served.headers[PREDICTED_TTFT_HEADER]) == pytest.approx(figure * 1e3, abs=1e-3)

    run(model_dir, PD, scenario, server_extra={"engine_metrics_interval_s": 0.05})


def test_a_session_step_under_a_ttft_slo_is_decided_once_and_committed(model_dir):
    """With a TTFT SLO a session's step is priced on a dry run and, once it meets the SLO,
    committed without a second decision: one ``Router.route`` call per request, and the
    session's chain names the step's prompt as a decided step leaves it."""

    async def scenario(client, server, engines):
        core = server.core
        calls: list[bool] = []
        route = core.router.route

        def counted(*args, **kwargs):
            calls.append(kwargs.get("dry_run", False))
            return route(*args, **kwargs)

        core.router.route = counted
        server_cfg = msgspec.structs.replace(core.config.server, ttft_slo_s=3600.0)
        core.intake.config = msgspec.structs.replace(core.config, server=server_cfg)
        for prompt in (PROMPT, STEP_2):
            answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=SESSION)
            assert answer.status == 200, await answer.text()
        assert calls == [True, True]  # one decision each: the dry run, committed
        state = core.router.sessions.get(SessionId("one-price"))
        assert list(state.chain.tokens) == STEP_2

    run(model_dir, PD, scenario)
