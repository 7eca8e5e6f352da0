"""The router's HTTP front (kvpilot.routing.serve.app) against fake engines
(:mod:`tests.fakes.engine`), with aiohttp's test client."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.routing.config_load import load_config
from kvpilot.routing.decide.ledger import WorkerLoad
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.events import BlockStored
from kvpilot.routing.serve.app import RouterServer, build_server
from tests.fakes.engine import PROMPT_WORDS as WORDS
from tests.fakes.engine import FakeEngine

BS = 4


Scenario = Callable[[TestClient, RouterServer, dict[str, FakeEngine]], Awaitable[None]]


def run(
    model_dir: Path,
    roles: dict[str, str],
    scenario: Scenario,
    server_extra: dict[str, Any] | None = None,
    **sections: Any,
) -> None:
    """Start the fake engines and the router (no KV events), then run ``scenario``."""

    async def main() -> None:
        length = (server_extra or {}).get("max_model_len") or FakeEngine.max_model_len  # the engines' --max-model-len
        engines = {name: FakeEngine(name, max_model_len=length) for name in roles}
        servers = {name: TestServer(engine.app(), host="127.0.0.1") for name, engine in engines.items()}
        for server in servers.values():
            await server.start_server()
        workers = [
            {"name": name, "role": role, "url": str(servers[name].make_url("/")).rstrip("/")}
            for name, role in roles.items()
        ]
        server = {"model_dir": str(model_dir), "prefill_timeout_s": 0.5, **(server_extra or {})}
        doc = {"index": {"block_size": BS}, "server": server, "workers": workers, **sections}
        path = model_dir / "router.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg = load_config(path)
        router = build_server(cfg, fleet_from_config(cfg), feed_index=False)
        try:
            async with TestClient(TestServer(router.app(), host="127.0.0.1")) as client:
                await scenario(client, router, engines)
        finally:
            for server in servers.values():
                await server.close()

    asyncio.run(main())


PD = {"prefill-0": "prefill", "decode-0": "decode"}
PROMPT = [i % len(WORDS) for i in range(40)]  # 10 blocks, ids inside the vocabulary


def _idle(router: RouterServer) -> bool:
    return all(router.core.ledger.load(w.name) == WorkerLoad() for w in router.core.fleet.workers)


def test_remote_prefill_then_decode_with_p_params(model_dir):
    async def scenario(client, router, engines):
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["text"] == "decode-0:40"
        assert resp.headers["X-KVPilot-Route"] == "remote_prefill"
        assert resp.headers["X-KVPilot-Prefill-Worker"] == "prefill-0"
        (p_body,), (d_body,) = engines["prefill-0"].bodies, engines["decode-0"].bodies
        assert p_body["prompt"] == PROMPT == d_body["prompt"]
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert p_body["kv_transfer_params"] == handoff_request()
        assert d_body["kv_transfer_params"] == {"remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}
        assert d_body["max_tokens"] == 5 and d_body["temperature"] == 0
        assert _idle(router)

    run(model_dir, PD, scenario)


def test_p_s_one_token_prefill_carries_no_field_it_must_refuse(model_dir):
    """min_tokens above P's max_tokens=1 is a 400 from vLLM: P never gets it, D does."""

    async def scenario(client, router, engines):
        body = {"prompt": PROMPT, "max_tokens": 48, "min_tokens": 24, "ignore_eos": True}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200 and resp.headers["X-KVPilot-Route"] == "remote_prefill"
        (p_body,), (d_body,) = engines["prefill-0"].bodies, engines["decode-0"].bodies
        assert "min_tokens" not in p_body and p_body["ignore_eos"] is True
        assert d_body["min_tokens"] == 24 and d_body["max_tokens"] == 48

    run(model_dir, PD, scenario)


@pytest.mark.parametrize(
    ("knob", "value", "reason"),
    [("status", 500, "status_500"), ("delay_s", 2.0, "timeout"), ("kv_params", False, "no_kv_transfer_params")],
)
def test_prefill_failure_falls_back_to_local_prefill_on_d(model_dir, knob, value, reason):
    async def scenario(client, router, engines):
        setattr(engines["prefill-0"], knob, value)
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-KVPilot-Route"] == "fallback"
        assert resp.headers["X-KVPilot-Prefill-Worker"] == "decode-0"
        (d_body,) = engines["decode-0"].bodies
        assert "kv_transfer_params" not in d_body and d_body["prompt"] == PROMPT
        metrics = await (await client.get("/metrics")).text()
        assert "kvpilot_router_prefill_fallbacks_total 1.0" in metrics
        assert f'kvpilot_router_prefill_failures_total{{reason="{reason}",worker="prefill-0"}} 1.0' in metrics
        assert _idle(router)

    run(model_dir, PD, scenario)


def test_decode_failure_is_a_json_error_naming_the_engine_and_the_router_keeps_serving(model_dir):
    async def scenario(client, router, engines):
        engines["decode-0"].status = 503
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert "decode-0" in error["message"] and "503" in error["message"]
        engines["decode-0"].status = 400  # a client mistake the engine saw keeps its status
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
        assert resp.status == 400 and "decode-0" in (await resp.json())["error"]["message"]
        engines["decode-0"].status = 200
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert resp.status == 200
        assert (
            'kvpilot_router_upstream_errors_total{worker="decode-0"} 2.0' in await (await client.get("/metrics")).text()
        )
        assert _idle(router)

    run(model_dir, PD, scenario)


def test_streaming_completions_are_relayed(model_dir):
    async def scenario(client, router, engines):
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in (await resp.text()).split("\n\n") if line]
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["x", "y"]
        assert events[-1] == "data: [DONE]"
        metrics = await (await client.get("/metrics")).text()
        for stage in ("route", "prefill", "decode_first_token"):
            assert f'kvpilot_router_ttft_stage_seconds_count{{stage="{stage}"}} 1.0' in metrics
        assert _idle(router)

    run(model_dir, PD, scenario)


def test_chat_goes_to_the_engines_chat_endpoint_and_answers_as_the_engine_wrote(model_dir):
    """A chat is forwarded as the client sent it, to P's and D's own ``/v1/chat/completions``
    (P cut to one token, D with P's handoff), and D's answer, whole or streamed, reaches the
    client as D wrote it; the router routed it on the template's rendering."""
    messages = [{"role": "user", "content": "fix the bug"}]
    tools = [{"type": "function", "function": {"name": "fix", "parameters": {"type": "object"}}}]

    async def scenario(client, router, engines):
        body = {"messages": messages, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2, "tools": tools}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        (p_body,) = engines["prefill-0"].bodies
        (d_body,) = engines["decode-0"].bodies
        assert engines["prefill-0"].paths == engines["decode-0"].paths == ["/v1/chat/completions"]
        assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == body
        assert p_body["max_tokens"] == 1 and "max_completion_tokens" not in p_body and p_body["tools"] == tools
        assert d_body["kv_transfer_params"] == {"remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}
        assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-x"
        assert answer["choices"][0]["message"] == {"role": "assistant", "content": "decode-0:1"}
        route = await (await client.post("/debug/route", json={"messages": messages})).json()
        rendered = "hello<|user|> fix the bug <|end|> <|assistant|> "
        assert route["prompt_tokens"] == len(router.core.intake.prompts.tokenizer.text_token_ids(rendered))
        resp = await client.post("/v1/chat/completions", json={"messages": messages, "stream": True})
        chunks = [json.loads(e[6:]) for e in (await resp.text()).split("\n\n") if e and e != "data: [DONE]"]
        assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "x"}, {"content": "y"}]

    run(model_dir, PD, scenario)


@pytest.mark.parametrize(
    ("path", "body", "status", "names"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", {"prompt": 5}, 400, "'prompt'"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "'prompt'"),
        ("/v1/completions", {"prompt": [1, -2]}, 400, "vocabulary"),
        ("/v1/completions", {"prompt": [1, 2**40]}, 400, "vocabulary"),
        ("/v1/completions", {"prompt": [1, 2], "stream": "yes"}, 400, "'stream'"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "'max_tokens'"),
        ("/v1/completions", {"prompt": [1, 2], "cache_salt": 7}, 400, "'cache_salt'"),
        (
            "/v1/completions",
            {"prompt": [1, 2], "kv_transfer_params": {"do_remote_prefill": True}},
            400,
            "'kv_transfer_params'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "kv_transfer_params": {}},
            400,
            "'kv_transfer_params'",
        ),
        ("/v1/completions", {"prompt": [1, 2], "conversation_id": ""}, 400, "conversation_id"),
        ("/v1/completions", {"prompt": [1, 2], "model": "gpt-9"}, 404, "'gpt-9'"),
        ("/v1/chat/completions", {"messages": []}, 400, "'messages'"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
            400,
            "'messages[1].role'",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "'messages[0].content'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{}]}, 400, "'tools[0]"),
        ("/debug/route", {"prompt": {}}, 400, "'prompt'"),
    ],
)
def test_malformed_requests_are_400s_naming_the_field(model_dir, path, body, status, names):
    async def scenario(client, router, engines):
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        resp = await client.post(path, **kwargs)
        assert resp.status == status
        assert names in (await resp.json())["error"]["message"]
        assert engines["co-0"].bodies == [] and _idle(router)

    run(model_dir, {"co-0": "colocated"}, scenario)


@pytest.mark.parametrize("backend", ["kvpilot", "dynamo"])
def test_debug_route_explains_without_sending_and_metrics_count_decisions(model_dir, backend):
    async def scenario(client, router, engines):
        assert type(router.core.index.inner).__name__ == {"kvpilot": "BlockIndex", "dynamo": "DynamoIndex"}[backend]
        hashes = [f"h{i}".encode() for i in range(6)]
        router.core.index.apply(WorkerId("co-1"), BlockStored(hashes, None, PROMPT[:24], BS, medium="GPU"))
        resp = await client.post("/debug/route", json={"prompt": PROMPT}, headers={"X-Request-Id": "dbg-1"})
        assert resp.status == 200
        info = await resp.json()
        assert info["decode_worker"] == "co-1" and info["cached_blocks"] == 6
        assert info["overlap"] == {"co-1": {"GPU": 6}} and info["prompt_blocks"] == 10
        assert info["explain"].startswith("request=dbg-1 kind=colocated")
        predicted = info["predicted"]  # no samples yet: every term on the prior
        assert predicted["ttft_s"] == predicted["prior_ttft_s"] > 0
        assert predicted["transfer"] == {"prior_s": 0.0, "measured_s": None, "samples": 0, "measured_by": None}
        assert predicted["prefill"]["measured_s"] is None and info["learned_rates"] == {}
        assert all(e.bodies == [] for e in engines.values())
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert resp.headers["X-KVPilot-Decode-Worker"] == "co-1"
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_decisions_total{decode="co-1",kind="colocated",prefill="co-1"} 1.0' in metrics
        assert "kvpilot_router_decision_seconds_count 1.0" in metrics  # the dry run is not counted
        assert "kvpilot_router_prompt_blocks_total 10.0" in metrics
        assert 'kvpilot_router_cached_blocks_total{tier="gpu"} 6.0' in metrics
        assert "kvpilot_router_cache_hit_ratio 0.6" in metrics
        assert 'kvpilot_router_index_blocks{tier="GPU",worker="co-1"} 6.0' in metrics
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny"
        assert (await (await client.get("/health")).json())["status"] == "ok"

    run(model_dir, {"co-0": "colocated", "co-1": "colocated"}, scenario, index={"block_size": BS, "backend": backend})


def test_session_header_gives_affinity_to_the_last_decode_worker(model_dir):
    async def scenario(client, router, engines):
        first = await client.post("/v1/completions", json={"prompt": PROMPT}, headers={"X-Session-ID": "s1"})
        worker = first.headers["X-KVPilot-Decode-Worker"]
        other = "co-1" if worker == "co-0" else "co-0"
        # both hold the prompt's first 3 blocks (the session's worker from its first step): the
        # other would not start a step sooner, so the session stays
        for holder in (worker, other):
            router.core.index.apply(
                WorkerId(holder), BlockStored([b"a", b"b", b"c"], None, PROMPT[:12], BS, medium="GPU")
            )
        for step in range(3):
            body = {"prompt": PROMPT + [7] * (4 * (step + 1)), "conversation_id": "s1"}
            resp = await client.post("/v1/completions", json=body)
            assert resp.headers["X-KVPilot-Decode-Worker"] == worker
            assert "conversation_id" not in engines[worker].bodies[-1]
        resp = await client.post("/v1/completions", json={"prompt": PROMPT + [7] * 4})
        # no session: the session living on its worker counts against it
        assert resp.headers["X-KVPilot-Decode-Worker"] == other

    run(model_dir, {"co-0": "colocated", "co-1": "colocated"}, scenario)


def test_no_field_outside_the_allow_list_reaches_an_engine(model_dir):
    """Fuzzed bodies: known fields, engine-internal ones and random names, on both
    endpoints. A refused body is a 400 naming the field and reaches no engine; an
    accepted one reaches the engines with allow-listed fields only."""
    from kvpilot.routing.decide.sessions import SESSION_FIELDS
    from kvpilot.routing.serve.request_fields import ACCEPTED, ENGINE_INTERNAL
    from kvpilot.routing.serve.upstream import Api

    rng = random.Random(7)
    fixed = {"model", "prompt", "messages", "stream", "stream_options", "tools", "n"}
    candidates = sorted((ACCEPTED[Api.COMPLETIONS] | ACCEPTED[Api.CHAT]) - fixed) + sorted(ENGINE_INTERNAL)
    candidates += ["x_internal", "__proto__", "remote_host", "do_remote_prefill", "best_of", ""]
    values = [1, 0.5, True, "v", [1, 2], {"do_remote_decode": True, "remote_host": "10.0.0.1"}, None]

    async def scenario(client, router, engines):
        for i in range(120):
            api = Api.CHAT if i % 2 == 1 else Api.COMPLETIONS
            chat = {"messages": [{"role": "user", "content": "hello world"}]}
            body: dict[str, Any] = chat if api is Api.CHAT else {"prompt": PROMPT[:8]}
            extra = {rng.choice(candidates): rng.choice(values) for _ in range(rng.randint(0, 3))}
            body.update(extra)
            sent_before = sum(len(e.bodies) for e in engines.values())
            resp = await client.post(api.value, json=body)
            reached = [b for e in engines.values() for b in e.bodies[sent_before:]]
            bad = [k for k in extra if k not in ACCEPTED[api]]
            if bad:
                assert resp.status == 400, (body, resp.status)
                message = (await resp.json())["error"]["message"]
                assert any(f"'{k}'" in message for k in bad), message
                assert not reached
            allowed = ACCEPTED[api] - frozenset(SESSION_FIELDS)
            for engine_body in reached:  # what the router itself sets is allowed too
                assert set(engine_body) <= allowed | {"kv_transfer_params"}, engine_body
                if "kv_transfer_params" in engine_body:
                    assert engine_body["kv_transfer_params"] != {"do_remote_decode": True, "remote_host": "10.0.0.1"}

    run(model_dir, PD, scenario)


def test_overload_is_refused_early_with_retry_after(model_dir):
    """One slot, one queue place: of three concurrent requests to a slow engine, one is
    served, one waits and is served, one is refused at once (429); a request that waits
    past the queue timeout is refused then (503). Both say when to retry."""

    async def scenario(client, router, engines):
        engines["decode-0"].delay_s = 0.6
        body = {"prompt": PROMPT, "max_tokens": 2}
        responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(3)))
        statuses = sorted(r.status for r in responses)
        assert statuses == [200, 200, 429], statuses
        refused = next(r for r in responses if r.status == 429)
        assert refused.headers["Retry-After"] == "1" and "capacity" in (await refused.json())["error"]["message"]
        engines["decode-0"].delay_s = 3.0
        slow = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.2)
        late = await client.post("/v1/completions", json=body)
        assert late.status == 503 and late.headers["Retry-After"] == "1"
        assert (await slow).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_rejected_total{reason="queue_full"} 1.0' in metrics
        assert 'kvpilot_router_rejected_total{reason="queue_timeout"} 1.0' in metrics
        engines["decode-0"].delay_s = 0.0  # every slot given back: the next request is served at once
        assert (await client.post("/v1/completions", json=body)).status == 200
        assert router.core.admission.queued == 0 and _idle(router)

    run(
        model_dir,
        {"decode-0": "colocated"},
        scenario,
        server_extra={"max_concurrent_requests": 1, "max_queued_requests": 1, "queue_timeout_s": 1.0},
    )


def test_a_request_predicted_over_the_ttft_slo_is_refused_before_any_engine_sees_it(model_dir):
    """An SLO no prediction can meet: every request, with or without a session, is a 503
    with ``Retry-After`` naming the predicted TTFT and the SLO, counted, and no engine
    sees it; the session is left as it was, and the router keeps answering."""

    async def scenario(client, router, engines):
        for headers in ({}, {"X-Session-ID": "s1"}):
            resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=headers)
            message = (await resp.json())["error"]["message"]
            assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1, (resp.status, message)
            assert "predicted TTFT" in message and "server.ttft_slo_s (1e-09 s)" in message
        assert not engines["prefill-0"].bodies and not engines["decode-0"].bodies
        state = router.core.router.sessions.get("s1")
        assert state is None or state.chain is None  # the refused step did not advance it
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_rejected_total{reason="ttft_slo"} 2.0' in metrics
        assert (await client.get("/health")).status == 200 and _idle(router)
        # the same router with the SLO off (where requests are taken in) serves the next request
        off = msgspec.structs.replace(router.core.config.server, ttft_slo_s=0.0)
        router.core.intake.config = msgspec.structs.replace(router.core.config, server=off)
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert resp.status == 200 and engines["decode-0"].bodies

    run(model_dir, PD, scenario, server_extra={"ttft_slo_s": 1e-9})


@pytest.mark.parametrize(
    ("limits", "body", "status", "reason", "names"),
    [
        ({"max_body_bytes": 1024}, {"prompt": "hello " * 400}, 413, "body_too_large", "max_body_bytes"),
        ({"max_prompt_tokens": 16}, {"prompt": PROMPT}, 400, "prompt_too_long", "max_prompt_tokens"),
        ({"max_output_tokens": 64}, {"prompt": PROMPT, "max_tokens": 65}, 400, "max_tokens", "'max_tokens' 65"),
    ],
)
def test_limits_refuse_before_routing_naming_the_limit(model_dir, limits, body, status, reason, names):
    async def scenario(client, router, engines):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == status and names in (await resp.json())["error"]["message"]
        assert not engines["decode-0"].bodies
        metrics = await (await client.get("/metrics")).text()
        assert f'kvpilot_router_rejected_total{{reason="{reason}"}} 1.0' in metrics

    run(model_dir, {"decode-0": "colocated"}, scenario, server_extra=limits)


def test_a_failing_worker_opens_its_circuit_and_closes_it_when_it_answers_again(model_dir):
    async def scenario(client, router, engines):
        body = {"prompt": PROMPT, "max_tokens": 2}
        engines["co-0"].status = 500
        assert [(await client.post("/v1/completions", json=body)).status for _ in range(2)] == [502, 502]
        refused = await client.post("/v1/completions", json=body)  # its circuit is open: not even tried
        assert refused.status == 503 and "circuit" in (await refused.json())["error"]["message"]
        assert len(engines["co-0"].bodies) == 2
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_circuit_trips_total{worker="co-0"} 1.0' in metrics
        assert 'kvpilot_router_circuit_open{worker="co-0"} 1.0' in metrics
        await asyncio.sleep(1.1)  # half-open: tried again, closed by a success
        engines["co-0"].status = 200
        assert (await client.post("/v1/completions", json=body)).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_circuit_open{worker="co-0"} 0.0' in metrics

    run(model_dir, {"co-0": "colocated"}, scenario, server_extra={"circuit_failures": 2, "circuit_open_s": 1.0})


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_worker_failing_before_the_answer_is_retried_on_another(model_dir, stream):
    async def scenario(client, router, engines):
        engines["decode-0"].status = engines["decode-1"].status = 500
        body = {"prompt": PROMPT, "max_tokens": 2, "stream": stream}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 502  # both failed: max_retries 1, the second failure stands
        engines["decode-1"].status = 200
        for _ in range(3):  # whichever D the cost model picks first, decode-1 answers
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200 and resp.headers["X-KVPilot-Decode-Worker"] == "decode-1", await resp.text()
            await resp.read()
        metrics = await (await client.get("/metrics")).text()
        retries = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kvpilot_router_retries_total{")
        ]
        assert sum(retries) >= 1  # the first request was retried once (its series exist from the start at 0)
        for line in metrics.splitlines():
            if line.startswith("kvpilot_router_active_requests{"):
                assert line.endswith(" 0.0"), line  # every attempt left the ledger

    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    run(model_dir, roles, scenario, disaggregation={"max_local_tokens": 0}, server_extra={"circuit_failures": 0})


def test_a_client_error_is_not_retried(model_dir):
    async def scenario(client, router, engines):
        engines["decode-0"].status = engines["decode-1"].status = 400
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert resp.status == 400 and len(engines["decode-0"].bodies) + len(engines["decode-1"].bodies) == 1

    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    run(model_dir, roles, scenario, disaggregation={"max_local_tokens": 0})


def test_a_worker_with_an_open_circuit_is_not_routed_to(model_dir):
    async def scenario(client, router, engines):
        for _ in range(2):
            router.core.breaker.failed("co-0", time.monotonic())
        body = {"prompt": PROMPT, "max_tokens": 2}
        served = [
            (await client.post("/v1/completions", json=body)).headers["X-KVPilot-Decode-Worker"] for _ in range(4)
        ]
        assert served == ["co-1"] * 4 and not engines["co-0"].bodies

    run(
        model_dir,
        {"co-0": "colocated", "co-1": "colocated"},
        scenario,
        server_extra={"circuit_failures": 2, "circuit_open_s": 30.0},
    )


def test_a_prefill_worker_with_an_open_circuit_is_skipped_for_local_prefill(model_dir):
    async def scenario(client, router, engines):
        engines["prefill-0"].status = 500
        body = {"prompt": PROMPT, "max_tokens": 2}
        routes = [(await client.post("/v1/completions", json=body)).headers["X-KVPilot-Route"] for _ in range(3)]
        assert routes == ["fallback", "fallback", "local_prefill"]  # the third does not try P at all
        assert len(engines["prefill-0"].bodies) == 2

    run(
        model_dir,
        PD,
        scenario,
        disaggregation={"max_local_tokens": 0},
        server_extra={"circuit_failures": 2, "circuit_open_s": 30.0},
    )


def test_an_api_key_guards_every_endpoint_but_health_and_metrics(model_dir, monkeypatch):
    monkeypatch.setenv("KVPILOT_TEST_KEY", "s3cret")

    async def scenario(client, router, engines):
        body = {"prompt": PROMPT, "max_tokens": 2}
        for path, payload in (("/v1/completions", body), ("/debug/route", body)):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                resp = await client.post(path, json=payload, headers=headers)
                assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer", (path, headers)
        assert (await client.get("/v1/models")).status == 401
        assert not engines["co-0"].bodies
        authorized = {"Authorization": "Bearer s3cret"}
        assert (await client.post("/v1/completions", json=body, headers=authorized)).status == 200
        assert (await client.get("/health")).status == 200
        metrics = await client.get("/metrics")
        assert metrics.status == 200
        assert 'kvpilot_router_rejected_total{reason="unauthorized"} 7.0' in await metrics.text()

    run(model_dir, {"co-0": "colocated"}, scenario, server_extra={"api_key_env": "KVPILOT_TEST_KEY"})


def test_the_router_sends_the_engines_api_key(model_dir, monkeypatch):
    monkeypatch.setenv("KVPILOT_TEST_ENGINE_KEY", "engine-s3cret")

    async def scenario(client, router, engines):
        for engine in engines.values():
            engine.api_key = "engine-s3cret"
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert resp.status == 200 and resp.headers["X-KVPilot-Route"] == "remote_prefill"
        engines["decode-0"].api_key = "another"
        assert (await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})).status == 401

    run(
        model_dir,
        PD,
        scenario,
        disaggregation={"max_local_tokens": 0},
        server_extra={"engine_api_key_env": "KVPILOT_TEST_ENGINE_KEY"},
    )


def test_an_api_key_variable_that_is_unset_stops_the_router(model_dir, monkeypatch):
    from kvpilot.routing.config import ConfigError

    monkeypatch.delenv("KVPILOT_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="KVPILOT_TEST_KEY"):
        run(
            model_dir,
            {"co-0": "colocated"},
            lambda *_: asyncio.sleep(0),
            server_extra={"api_key_env": "KVPILOT_TEST_KEY"},
        )


def test_ds_session_offer_goes_to_p_at_the_next_step_once_and_never_expired_or_across_salts(model_dir):
    offer = {
        "do_remote_decode": True,
        "remote_block_ids": [[5, 6]],
        "remote_engine_id": "decode-0",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_request_id": "r",
    }

    async def step(client, tokens: int, **extra):
        body = {"prompt": PROMPT + [7] * tokens, "conversation_id": "agent", **extra}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()

    async def scenario(client, router, engines):
        p, d = engines["prefill-0"], engines["decode-0"]
        d.session_offer = {**offer, "kvpilot_expires_at": time.time() + 300}
        await step(client, 4)
        assert p.bodies[-1]["kv_transfer_params"] == handoff_request()  # step 1: nothing offered yet
        await step(client, 8)
        assert p.bodies[-1]["kv_transfer_params"] == d.session_offer  # step 2: D's offer of step 1
        await step(client, 12, cache_salt="tenant-b")  # the same id in another tenant: another session
        assert p.bodies[-1]["kv_transfer_params"] == handoff_request()
        d.session_offer = {**offer, "kvpilot_expires_at": time.time() + 2}  # D's hold ends before P could read
        await step(client, 16)
        await step(client, 20)
        assert p.bodies[-1]["kv_transfer_params"] == handoff_request()
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_session_offers_total{outcome="sent"} 2.0' in metrics
        assert 'kvpilot_router_session_offers_total{outcome="expired"} 1.0' in metrics

    run(model_dir, PD, scenario, disaggregation={"max_local_tokens": 0}, sessions={"force_option": "pull"})


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("workers:\n  - {name: a, role: decode, url: 'http://x:1', bogus: 1}\n", "workers[0].bogus"),
        ("workers:\n  - {name: a, role: decode, url: 'http://x:1'}\n", "server.model_dir: required"),
        ("cost: {overlap_score_credt: 1}\n", "cost.overlap_score_credt"),
    ],
)
def test_router_cli_refuses_a_bad_config_with_exit_code_2(tmp_path, capsys, yaml_text, message):
    from kvpilot.routing.cli import main

    path = tmp_path / "router.yaml"
    path.write_text(yaml_text)
    assert main(["router", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_router_cli_flags_override_the_yaml(tmp_path):
    import argparse

    from kvpilot.routing.cli import add_subcommands

    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="command"))
    path = tmp_path / "router.yaml"
    path.write_text("server: {port: 8000, host: 127.0.0.1}\ncost: {overlap_score_credit: 1.0}\n")
    args = parser.parse_args(
        [
            "router",
            "--config",
            str(path),
            "--server-port",
            "9100",
            "--cost-overlap-score-credit",
            "0.5",
            "--server-model-dir",
            "/m",
        ]
    )
    cfg = load_config(args.config, args)
    assert (cfg.server.port, cfg.server.host, cfg.server.model_dir) == (9100, "127.0.0.1", "/m")
    assert cfg.cost.overlap_score_credit == 0.5 and args.func.__name__ == "run_router"


def test_engines_own_metrics_feed_the_decode_busy_guard_and_the_router_metrics(model_dir):
    async def scenario(client, router, engines):
        router.core.index.apply(WorkerId("decode-0"), BlockStored([b"a", b"b", b"c", b"d"], None, PROMPT[:16], BS))
        short = PROMPT[:18]  # D holds 4 of 4 blocks: a local prefill on D
        assert (await (await client.post("/debug/route", json={"prompt": short})).json())["kind"] == "local_prefill"
        engines["decode-0"].metrics_text = (
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.95\n'
            'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0\n'
        )
        for _ in range(100):  # the poller runs every 0.05 s
            route = await (await client.post("/debug/route", json={"prompt": short})).json()
            if route["kind"] == "remote_prefill":
                break
            await asyncio.sleep(0.05)
        assert route["kind"] == "remote_prefill", route["explain"]  # D says it is busy: the guard
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_engine_kv_usage{worker="decode-0"} 0.95' in metrics
        assert 'kvpilot_router_engine_running{worker="decode-0"} 3.0' in metrics
        assert 'kvpilot_router_engine_metrics_failures_total{reason="http_404",worker="prefill-0"}' in metrics
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})  # still serving
        assert resp.status == 200

    server = {"model_dir": str(model_dir), "engine_metrics_interval_s": 0.05}
    run(model_dir, PD, scenario, server=server)


TWO_P = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}


def test_a_pairs_transfer_failures_raise_its_cost_and_the_other_pair_wins(model_dir):
    """P-0's failed prefill for D, then D's failed NIXL transfers (its own counters, as
    polled) are charged to the pairs D served; the penalties show in /debug/route's
    explanation and in /metrics, and the healthier pair takes the traffic."""

    async def scenario(client, router, engines):
        usage = '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        for engine in engines.values():
            engine.metrics_text = usage
        engines["prefill-1"].status = 500
        while True:  # until the seeded tie-break sends one request to prefill-1
            resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert resp.status == 200
            if resp.headers["X-KVPilot-Route"] == "fallback":
                break
        engines["prefill-1"].status = 200
        route = await (await client.post("/debug/route", json={"prompt": PROMPT})).json()
        penalties = route["pair_penalty_blocks"]
        assert penalties["prefill-1->decode-0"] == pytest.approx(32.0, rel=0.01), penalties
        assert penalties["prefill-0->decode-0"] == 0.0
        assert route["prefill_worker"] == "prefill-0", route["explain"]
        assert "pair_penalty(32" in route["explain"]
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert resp.headers["X-KVPilot-Prefill-Worker"] == "prefill-0"
        # D reports four failed transfers: shared by the two pairs it served (+64 each).
        engines["decode-0"].metrics_text = usage + "vllm:nixl_num_failed_transfers_total 4.0\n"
        for _ in range(100):  # the poller runs every 0.05 s
            route = await (await client.post("/debug/route", json={"prompt": PROMPT})).json()
            if route["pair_penalty_blocks"]["prefill-0->decode-0"] > 0:
                break
            await asyncio.sleep(0.05)
        penalties = route["pair_penalty_blocks"]
        assert penalties["prefill-0->decode-0"] == pytest.approx(64.0, rel=0.01), penalties
        assert penalties["prefill-1->decode-0"] == pytest.approx(96.0, rel=0.01), penalties
        assert route["prefill_worker"] == "prefill-0", route["explain"]
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_pair_penalty_blocks{pair="prefill-1->decode-0"} 9' in metrics

    server = {"model_dir": str(model_dir), "engine_metrics_interval_s": 0.05}
    run(model_dir, TWO_P, scenario, server=server)


@pytest.mark.parametrize(
    ("host", "beyond"),
    [
        ("127.0.0.1", False),
        ("::1", False),
        ("localhost", False),
        ("127.0.0.2", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.0.0.7", True),
        ("router.example", True),
    ],
)
def test_binding_beyond_loopback_is_recognised(host, beyond):
    from kvpilot.routing.serve.loopback import beyond_loopback

    assert beyond_loopback(host) is beyond


def test_the_router_reads_the_chat_template_transformers_saves_beside_the_tokenizer(tiny_model_dir, tmp_path):
    """transformers (4.50 on) saves a tokenizer's chat template to ``chat_template.jinja``, not
    into ``tokenizer_config.json``: the tiny model's chat requests were refused (400, "this model
    has no chat template") until the router read it there. The older layout still works."""
    import json
    import shutil

    from kvpilot.deploy.tiny_model import PLAIN_CHAT_TEMPLATE
    from kvpilot.routing.serve.chat import JINJA_TEMPLATE, ChatTemplate

    assert (tiny_model_dir / JINJA_TEMPLATE).is_file()
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    assert template.render(hi) == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    old = tmp_path / "old"
    old.mkdir()
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": PLAIN_CHAT_TEMPLATE}))
    shutil.copy(tiny_model_dir / "tokenizer.json", old / "tokenizer.json")
    legacy = ChatTemplate.from_model_dir(old)
    assert legacy is not None and legacy.render(hi).endswith("<|assistant|>\n")
