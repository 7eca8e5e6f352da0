"""The picker module in the real Envoy (.venv/bin/envoy, ABI v0.2.0): a token-id prompt of
12,000 ids (a body Envoy hands over in slices) is routed to the worker whose KV events say it
holds the prompt's blocks; a text prompt passes through untouched to the default route; each
is counted; a session's later steps stay on the worker that served it; a session named in the
body or by a bad header is left to the Python picker; ``--mode validate`` loads the config
and opens no socket. Only 127.0.0.1."""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpilot.deploy.dynamo_fleet import field_lines, native_picker_lines
from kvpilot.deploy.metrics import parse, total
from kvpilot.routing import native
from kvpilot.routing.config import CostConfig, RouterConfig

zmq = pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parents[3]
MODULE_DIR = ROOT / "routing" / "native" / "build"
ENVOY = shutil.which("envoy", path=str(ROOT / ".venv" / "bin"))
LIBZMQ = next((Path(zmq.__file__).parent.parent / "pyzmq.libs").glob("libzmq*.so*"), None)
BLOCK = 64
TYPES = "type.googleapis.com/envoy.extensions."
PROMPT = [7 + (i * 7919) % 2000 for i in range(12_000)]

pytestmark = pytest.mark.skipif(
    ENVOY is None or LIBZMQ is None or not (MODULE_DIR / "libkvpilot_picker.so").exists(),
    reason="needs .venv/bin/envoy, pyzmq's libzmq and `make setup`'s module",
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Upstream(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"worker": self.server.name, "decided_by": self.headers.get("x-kvpilot-decided-by")})  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def _upstream(name: str) -> tuple[http.server.ThreadingHTTPServer, int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.name = name  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


def _config(listen: int, admin: int, ports: dict[str, int], events: dict[str, int]) -> dict[str, Any]:
    lines = [f"block_size {BLOCK}", "topic kv", f"libzmq {LIBZMQ}", *field_lines()]
    lines += [f"worker 127.0.0.1:{ports[w]} connect tcp://127.0.0.1:{events[w]}" for w in ("a", "b")]
    module = {
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": "kvpilot_picker", "do_not_close": True},
            "filter_name": "kvpilot_picker",
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": "\n".join(lines)},
        },
    }
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }
    picked = {
        "match": {"prefix": "/", "headers": [{"name": "x-gateway-destination-endpoint", "present_match": True}]},
        "route": {"cluster": "picked"},
    }
    default = {"match": {"prefix": "/"}, "route": {"cluster": "default"}}
    hcm = {
        "@type": TYPES + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "http_filters": [module, router],
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [picked, default]}]},
    }
    address = lambda port: {"socket_address": {"address": "127.0.0.1", "port_value": port}}  # noqa: E731
    endpoint = {"lb_endpoints": [{"endpoint": {"address": address(ports["a"])}}]}
    return {
        "admin": {"address": address(admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "in",
                    "address": address(listen),
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "picked",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "1s",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "default",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {"cluster_name": "default", "endpoints": [endpoint]},
                },
            ],
        },
    }


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with open("/tmp/kvpilot-e2e.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        servers = {w: _upstream(w) for w in ("a", "b")}
        ctx = zmq.Context()
        pubs, events = {}, {}
        for w in ("a", "b"):
            pubs[w] = ctx.socket(zmq.PUB)
            events[w] = pubs[w].bind_to_random_port("tcp://127.0.0.1")
        listen, admin = _port(), _port()
        config = tmp_path / "envoy.json"
        config.write_text(json.dumps(_config(listen, admin, {w: s[1] for w, s in servers.items()}, events)))
        env = {**os.environ, "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(MODULE_DIR)}
        log = (tmp_path / "envoy.log").open("w")
        base = ["--base-id", str(listen), "--concurrency", "2", "-c", str(config), "--log-level", "info"]
        proc = subprocess.Popen([ENVOY, *base], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            else:
                pytest.fail((tmp_path / "envoy.log").read_text()[-3000:])
            yield {
                "listen": listen,
                "admin": admin,
                "pubs": pubs,
                "config": config,
                "env": env,
                "log": tmp_path / "envoy.log",
                "stop": lambda: (proc.terminate(), proc.wait(timeout=10)),
            }
        finally:
            proc.terminate()
            assert proc.wait(timeout=10) == 0, (tmp_path / "envoy.log").read_text()[-3000:]
            for pub in pubs.values():
                pub.close(0)
            ctx.term()
            for server, _ in servers.values():
                server.shutdown()


def _post(port: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        return dict(json.loads(answer.read()))


def _stored(seq: int, tokens: list[int]) -> list[bytes]:
    blocks = len(tokens) // BLOCK
    event = {
        "type": "BlockStored",
        "block_hashes": list(range(1, blocks + 1)),
        "parent_block_hash": None,
        "token_ids": tokens[: blocks * BLOCK],
        "block_size": BLOCK,
        "medium": "GPU",
    }
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [event]])]


def test_the_module_routes_a_token_id_prompt_to_the_worker_holding_it(gateway: dict[str, Any]) -> None:
    port, pub = gateway["listen"], gateway["pubs"]["b"]
    deadline, seq, answer = time.monotonic() + 15, 0, {}
    while time.monotonic() < deadline:  # a SUB joins a moment after it connects: publish until heard
        for hostile in ([b"kv", b"short"], [b"kv", b"\0" * 8, b"\xc1not msgpack"], [b"kv"] * 5):
            pub.send_multipart(hostile)  # counted and dropped by the feeder
        pub.send_multipart(_stored(seq, PROMPT))
        seq += 1
        answer = _post(port, {"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
        if answer["worker"] == "b":
            break
        time.sleep(0.1)
    assert answer == {"worker": "b", "decided_by": "module"}, gateway["log"].read_text()[-3000:]
    for _ in range(10):
        assert _post(port, {"model": "tiny", "prompt": PROMPT, "max_tokens": 1})["worker"] == "b"
    text = _post(port, {"model": "tiny", "prompt": "hello", "max_tokens": 1})
    assert text == {"worker": "a", "decided_by": None}  # untouched: the default route
    admin = f"http://127.0.0.1:{gateway['admin']}"
    stats = urllib.request.urlopen(f"{admin}/stats?filter=kvpilot_picker_(decided|passthrough)$").read().decode()
    counts = {
        line.split(": ")[0].rsplit(".", 1)[-1]: int(line.split(": ")[1]) for line in stats.splitlines() if ": " in line
    }
    assert counts.get("kvpilot_picker_passthrough") == 1 and counts.get("kvpilot_picker_decided", 0) >= 11, stats
    time.sleep(6)  # Envoy merges its workers' histograms at each stats flush (5 s)
    samples = parse(urllib.request.urlopen(f"{admin}/stats/prometheus").read().decode())
    assert total(samples, f"{native.ENVOY_STATS_PREFIX}{native.DECISION_HISTOGRAM}_count") >= 11  # every decision timed
    gateway["stop"]()
    assert "bad frames" in gateway["log"].read_text()  # the feeder's counts, logged at the config's end


def test_a_session_s_later_steps_stay_on_the_worker_that_served_it(gateway: dict[str, Any]) -> None:
    """No worker holds these prompts, so both price alike but for the session's affinity:
    without it, each step would land on either worker at random."""
    port = gateway["listen"]
    homes = set()
    for session in range(8):
        name = {"x-dynamo-session-id": f"agent-{session}"}
        prompt = [3 + session] * (2 * BLOCK)
        first = _post(port, {"model": "tiny", "prompt": prompt, "max_tokens": 1}, name)
        assert first["decided_by"] == "module"
        homes.add(first["worker"])
        for step in range(1, 6):
            prompt += [100 + step] * BLOCK
            later = _post(port, {"model": "tiny", "prompt": prompt, "max_tokens": 1}, name)
            assert later == first, (session, step)
    assert homes == {"a", "b"}  # the first steps of new sessions are spread


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"conversation_id": "c-1"}, {}),
        ({"prompt_cache_key": "k-1"}, {}),
        ({}, {"x-session-id": "s" * 257}),
        ({"kv_transfer_params": {"remote_host": "10.0.0.7"}}, {}),  # refused by the Python picker, by name
        ({"nvext": {"backend_instance_id": 7}}, {}),
    ],
)
def test_a_session_the_python_picker_must_answer_passes_through(
    gateway: dict[str, Any], body: dict[str, Any], headers: dict[str, str]
) -> None:
    answer = _post(gateway["listen"], {"model": "tiny", "prompt": PROMPT[:256], "max_tokens": 1, **body}, headers)
    assert answer == {"worker": "a", "decided_by": None}


def test_validation_mode_loads_the_config_and_subscribes_to_nothing(gateway: dict[str, Any], tmp_path: Path) -> None:
    """The config now binds the ports the engines' PUB sockets hold: a bind would fail."""
    config = tmp_path / "validate.json"
    config.write_text(gateway["config"].read_text().replace(" connect tcp://", " bind tcp://"))
    assert " bind tcp://" in config.read_text()
    out = subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(config), "--base-id", "7"],
        env=gateway["env"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def _validate(tmp_path: Path, module_config: str, base_id: int) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` of a two-worker bootstrap whose module config is ``module_config``."""
    config = _config(_port(), _port(), {"a": 1, "b": 2}, {"a": 3, "b": 4})
    module = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    module["http_filters"][0]["typed_config"]["filter_config"]["value"] = module_config
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(MODULE_DIR)}
    assert ENVOY is not None
    return subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(path), "--base-id", str(base_id)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_fleet_s_config_lines_load(tmp_path: Path) -> None:
    """Every line :func:`native_picker_lines` writes (the router's cost and sessions
    settings among them) is one the module reads."""
    fleet = {
        "block_size": 32,
        "workers": [
            {"name": "decode-11", "role": "decode", "instance_id": 17, "kv_events_endpoint": "tcp://127.0.0.1:5999"}
        ],
    }
    router = RouterConfig(cost=CostConfig(session_affinity_credit=1000.0, session_stays_unless_sooner=False))
    assert LIBZMQ is not None and ENVOY is not None
    lines = native_picker_lines(fleet, "127.0.0.1:8000", router, LIBZMQ)
    assert "cost.session_affinity_credit 1000.0" in lines and "cost.session_stays_unless_sooner 0" in lines
    out = _validate(tmp_path, "\n".join(lines), base_id=11)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_config_it_cannot_read_is_refused_naming_the_line(tmp_path: Path) -> None:
    two_workers = _config(_port(), _port(), {"a": 1, "b": 2}, {"a": 3, "b": 4})
    module = two_workers["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    value = module["http_filters"][0]["typed_config"]["filter_config"]["value"]
    out = _validate(tmp_path, value + "\nblock_sise 64", base_id=9)
    assert out.returncode != 0
    assert f"config line {value.count(chr(10)) + 2}: cannot read 'block_sise 64'" in out.stdout + out.stderr
    no_fields = "\n".join(line for line in value.splitlines() if not line.startswith("field "))
    out = _validate(tmp_path, no_fields, base_id=10)
    assert out.returncode != 0 and "at least one field" in out.stdout + out.stderr
