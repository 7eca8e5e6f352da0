"""Bad input stops at the door (issue 41): every request vLLM would refuse gets vLLM's 400
from the router's HTTP front with no engine called; a prompt is tokenized off the event
loop and only once its size is within bounds; a config error names its file; the picker's
ext_proc server holds no body over ``server.max_body_bytes``."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvpilot.routing.config import ConfigError
from kvpilot.routing.config_load import add_cli_flags, load_config
from kvpilot.routing.gateway.extproc import ExternalProcessor
from kvpilot.routing.serve.upstream import Api
from tests.fakes.engine import PROMPT_WORDS, VOCAB_SIZE, word_model_dir
from tests.unit.routing.test_routing_engine_checks import CASES, LIMITS, vllm_refusal
from tests.unit.routing.test_routing_server import PD, run

SERVER = {"max_model_len": LIMITS.max_model_len, "max_logprobs": LIMITS.max_logprobs}


@pytest.fixture(scope="module")
def sized_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The fake word-level model with a ``config.json`` (the tiny model's) naming its
    vocabulary, which vLLM checks token ids against."""
    path = word_model_dir(tmp_path_factory.mktemp("sized"))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB_SIZE}))
    assert LIMITS.vocab_size == VOCAB_SIZE
    return path


def _body(api: Api, fields: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    ids = [i % len(PROMPT_WORDS) for i in range(prompt_tokens)]
    if api is Api.COMPLETIONS:
        return {"prompt": ids, **fields}
    text = " ".join(PROMPT_WORDS[i] for i in ids[1:])  # the template adds a token or more around it
    return {"messages": [{"role": "user", "content": text}], **fields}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_each_field_vllm_refuses_is_a_400_with_vllms_message_and_no_engine_sees_it(sized_model_dir):
    cases = [
        (name, api, fields, tokens)
        for name, apis, fields, tokens, chars in CASES
        for api in apis
        if chars is None and (api is Api.COMPLETIONS or tokens < 100)  # a chat's length is its template's
    ]

    async def scenario(client, router, engines):
        for name, api, fields, tokens in cases:
            resp = await client.post(api.value, json=_body(api, fields, tokens))
            message = (await resp.json())["error"]["message"]
            expected = vllm_refusal(api, fields, tokens, None)
            assert (name, resp.status, message) == (name, 400, expected)
        assert not engines["prefill-0"].bodies and not engines["decode-0"].bodies
        ok = await client.post("/v1/completions", json=_body(Api.COMPLETIONS, {"max_tokens": 4}, 40))
        assert ok.status == 200 and engines["prefill-0"].bodies  # the same router serves a good one

    assert len(cases) > 60
    run(sized_model_dir, PD, scenario, server_extra=SERVER)


def _recording_encoder(router: Any) -> list[int]:
    """Record the thread of each call to the router's tokenizer; returns the list."""
    threads: list[int] = []
    encode = router.core.intake.prompts.tokenizer.encode

    def recorded(text: str, *, add_special_tokens: bool) -> list[int]:
        threads.append(threading.get_ident())
        return encode(text, add_special_tokens=add_special_tokens)

    router.core.intake.prompts.tokenizer.encode = recorded
    return threads


def test_prompts_are_tokenized_off_the_event_loop_in_the_router(sized_model_dir):
    async def scenario(client, router, engines):
        threads = _recording_encoder(router)
        text = " ".join(PROMPT_WORDS[3:20])
        bodies = {Api.COMPLETIONS: {"prompt": text}, Api.CHAT: {"messages": [{"role": "user", "content": text}]}}
        for api, body in bodies.items():
            resp = await client.post(api.value, json={**body, "max_tokens": 4})
            assert resp.status == 200
        assert len(threads) == 2 and threading.get_ident() not in threads

    run(sized_model_dir, PD, scenario, server_extra=SERVER)


@pytest.mark.parametrize(
    ("server", "fragment"),
    [
        (SERVER, "This model's maximum context length is 128 tokens. However, your prompt contains {chars} characters"),
        ({"max_prompt_tokens": 128}, "the prompt has {chars} characters, more than server.max_prompt_tokens (128)"),
    ],
)
def test_a_prompt_over_the_size_limit_is_refused_before_the_tokenizer_runs(sized_model_dir, server, fragment):
    async def scenario(client, router, engines):
        widest = router.core.intake.limits.max_chars_per_token
        assert widest == max(len(w) for w in [*PROMPT_WORDS, f"w{VOCAB_SIZE - 1}"])
        text = "x" * (128 * widest + 1)
        threads = _recording_encoder(router)
        resp = await client.post("/v1/completions", json={"prompt": text})
        assert resp.status == 400
        assert fragment.format(chars=len(text)) in (await resp.json())["error"]["message"]
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
        assert chat.status == 400 and "characters" in (await chat.json())["error"]["message"]
        assert threads == [] and not engines["prefill-0"].bodies and not engines["decode-0"].bodies
        metrics = await (await client.get("/metrics")).text()
        assert 'kvpilot_router_rejected_total{reason="prompt_too_long"} 2.0' in metrics

    run(sized_model_dir, PD, scenario, server_extra=server)


def test_a_malformed_yaml_config_names_its_file_and_line(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("server: {model_dir: [1\nworkers: x\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value) and "line 2, column 8" in str(caught.value)
    assert "<unicode string>" not in str(caught.value)


def test_a_wrong_key_names_the_file_or_the_flag_that_set_it(tmp_path):
    import argparse

    path = tmp_path / "router.yaml"
    path.write_text("server: {port: 8000, bogus: 1}\n")
    with pytest.raises(ConfigError, match=rf"server\.bogus: unknown key .*\({path}\)"):
        load_config(path)
    path.write_text("server: {port: 8000}\n")
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    with pytest.raises(ConfigError, match=r"server\.port: .* \(flag --server-port\)"):
        load_config(path, parser.parse_args(["--server-port", "99999"]))


def test_a_model_directory_without_its_tokenizer_is_named(tmp_path):
    from kvpilot.routing.cli import main

    missing = tmp_path / "no-such-model"
    path = tmp_path / "router.yaml"
    path.write_text(
        f"server: {{model_dir: {str(missing)!r}}}\nworkers: [{{name: d0, role: colocated, url: 'http://127.0.0.1:1'}}]\n"
    )
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()) as err:
        sys.exit(main(["router", "--config", str(path)]))
    assert exited.value.code == 2
    assert f"server.model_dir: no tokenizer.json in {str(missing)!r}" in err.getvalue()


class _NoPicker:
    """A picker that must not be reached."""

    async def pick(self, *args: object) -> None:
        raise AssertionError("an oversized body reached the picker")

    async def ended(self, *args: object) -> None:
        raise AssertionError("nothing was picked")


def test_the_picker_in_gaie_mode_refuses_a_body_over_the_limit_without_buffering_it():
    limit = 64 * 1024
    processor = ExternalProcessor(_NoPicker(), lambda path, headers: (404, {}), max_body_bytes=limit)  # type: ignore[arg-type]
    headers = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            ]
        )
    )
    duplex = processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    )
    chunk = b"x" * (16 * 1024)
    sent = 0

    async def messages():
        nonlocal sent
        yield ep.ProcessingRequest(
            protocol_config=ep.ProtocolConfiguration(request_body_mode=duplex.request_body_mode),
            request_headers=headers,
        )
        while sent < 4 * limit:  # four times the limit: only a refusal ends the stream early
            sent += len(chunk)
            yield ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk, end_of_stream=sent >= 4 * limit))

    async def main() -> list[ep.ProcessingResponse]:
        return [answer async for answer in processor.Process(messages(), None)]  # type: ignore[arg-type]

    answers = asyncio.run(main())
    assert len(answers) == 1 and answers[0].immediate_response.status.code == 413
    assert f"server.max_body_bytes ({limit})" in json.loads(answers[0].immediate_response.body)["error"]["message"]
    assert sent <= limit + len(chunk)
