"""The router beside Dynamo, on Dynamo 1.6.1's real frontend (direct mode) and
``dynamo.mocker`` workers: 2 prefill and 2 decode mockers, one process each, on the
tiny model, all on 127.0.0.1 (``kvpilot fleet up --dynamo``'s own launcher).

What each test shows comes from the workers themselves, not from the router's own
headers alone: a prefill worker's vLLM-format KV events (read here on its port, beside
the router) and a decode worker's request counter (its system server's ``/metrics``).
Ports: 19000-19499 (no other e2e module uses them).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from kvpilot.deploy import dynamo_fleet
from kvpilot.deploy.client import complete
from kvpilot.deploy.dynamo_spec import DynamoFleetSpec
from kvpilot.deploy.fleet import Fleet, FleetStartError, down
from kvpilot.routing.config import Role
from kvpilot.routing.index.events import BlockStored, EventDecoder
from tests.e2e.fleets import join_worker, leave_worker, restart_gateway
from tests.e2e.parity import HISTORY, TOOLS

pytest.importorskip("dynamo.mocker", reason="needs ai-dynamo (scripts/bootstrap.sh installs it)")
pytestmark = pytest.mark.e2e

STRIDE = 100
BS = 32
PORTS = {
    "worker_port": 19000,
    "port_stride": STRIDE,
    "frontend_port": 19490,
    "router_port": 19480,
    "gateway_port": 19470,
    "picker_port": 19471,
    "envoy_admin_port": 19472,
}
VOCAB = 2048  # the tiny model's: the frontend refuses larger token ids


@pytest.fixture(scope="module")
def spec(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> DynamoFleetSpec:
    return DynamoFleetSpec(model_dir, tmp_path_factory.mktemp("dynamo-fleet"), prefill=2, decode=2, **PORTS)


def _discovery_expired(spec: DynamoFleetSpec) -> bool:
    """Whether Dynamo's file discovery expired an entry of this fleet (its processes log
    ``Expired``): an entry's owner touches it every 3.3 s and any process deletes one
    untouched for 10 s, so a box that stalls every process that long (seen once in a full
    suite run here: all the fleet's logs silent for 12.9 s during the router's start)
    loses every worker from discovery. ``up`` clears the discovery directory first, so no
    earlier fleet's entry can expire."""
    return any("Expired" in log.read_text(errors="replace") for log in (spec.run_dir / "logs").glob("*.log"))


@pytest.fixture(scope="module")
def fleet(spec: DynamoFleetSpec) -> Iterator[Fleet]:
    try:
        started = dynamo_fleet.up(spec, timeout=120)
    except FleetStartError:
        if not _discovery_expired(spec):
            raise
        print("Dynamo's file discovery expired the workers' entries while the fleet started: once more")
        started = dynamo_fleet.up(spec, timeout=120)
    try:
        yield started
    finally:
        down(spec.run_dir)


class Events:
    """Every worker's vLLM-format KV events, read here (the router reads them too)."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.ctx = zmq.Context()
        self.socks = {}
        for name, port in ports.items():
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            self.socks[name] = sock
        time.sleep(0.5)  # a SUB that connects misses what comes before its subscription
        self.decoder = EventDecoder()

    def stored(self, wait_s: float = 1.0) -> dict[str, list[int]]:
        """The token ids of every block stored since the last call, per worker."""
        time.sleep(wait_s)
        out: dict[str, list[int]] = {name: [] for name in self.socks}
        for name, sock in self.socks.items():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for event in self.decoder.decode(frames[-1]).events:
                    if isinstance(event, BlockStored):
                        out[name] += event.token_ids
        return out

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.ctx.term()


def _events_port(proc: Any) -> int:
    return int(proc.side_ports[1])  # (request plane, KV events, replay, bootstrap)


@pytest.fixture(scope="module")
def events(fleet: Fleet) -> Iterator[Events]:
    reader = Events({e.name: _events_port(e) for e in fleet.engines if e.role})
    yield reader
    reader.close()


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Message, dict[str, Any]]:
    """Status, headers (looked up in any case: Envoy sends them lower-case) and JSON answer."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read() or b"{}")


def _complete(spec: DynamoFleetSpec, prompt: list[int], **body: Any) -> Message:
    """A completion sent as a client sends it: to Envoy, which asks the router's picker."""
    status, headers, payload = _post(
        f"{spec.client_url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3, **body}
    )
    assert status == 200, payload
    return headers


def _prompt(seed: int, blocks: int = 4) -> list[int]:
    """``blocks`` full blocks of token ids no other test uses, below the vocabulary."""
    return [(seed * 997 + i * 7) % (VOCAB - 1) + 1 for i in range(blocks * BS)]


def _requests_served(proc: Any) -> float:
    """A worker's own count of requests it served (its system server's /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("dynamo_component_requests_total") and 'dynamo_endpoint="generate"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _instance(router_name: str) -> str:
    return router_name.split("-", 1)[1]


def _worker_of(spec: DynamoFleetSpec, router_name: str) -> Any:
    """The launched process behind the router's worker name (by its instance id in discovery)."""
    fleet = Fleet.load(spec.run_dir)
    assert fleet is not None
    instance = int(_instance(router_name), 16)
    for path in (spec.discovery_dir / "v1" / "instances").iterdir():
        entry = json.loads(path.read_text())
        if entry.get("instance_id") == instance and entry.get("endpoint") == "generate":
            rpc = int(entry["transport"]["tcp"].split("/")[0].rsplit(":", 1)[1])
            return next(e for e in fleet.engines if e.role and e.side_ports[0] == rpc)
    raise KeyError(router_name)


def test_a_request_is_prefilled_and_decoded_on_the_instances_the_router_chose(fleet, spec, events):
    events.stored(0.0)
    served = {e.name: _requests_served(e) for e in fleet.engines if e.role == Role.DECODE.value}
    prompt = _prompt(1)
    headers = _complete(spec, prompt)
    assert headers["X-KVPilot-Route"] == "remote_prefill"
    p = _worker_of(spec, headers["X-KVPilot-Prefill-Worker"])
    d = _worker_of(spec, headers["X-KVPilot-Decode-Worker"])
    stored = events.stored()
    assert stored[p.name][: len(prompt)] == prompt  # P computed the prompt's blocks: its own events say so
    others = [name for name, tokens in stored.items() if name != p.name and prompt[:BS] in _blocks(tokens)]
    assert others == []  # no other worker prefilled it
    after = {e.name: _requests_served(e) for e in fleet.engines if e.role == Role.DECODE.value}
    assert {name: after[name] - served[name] for name in served} == {
        name: (1.0 if name == d.name else 0.0) for name in served
    }  # the chosen D served it, by its own counter


def _blocks(tokens: list[int]) -> list[list[int]]:
    return [tokens[i : i + BS] for i in range(0, len(tokens), BS)]


def _instance_of(spec: DynamoFleetSpec, proc: Any) -> int:
    """The Dynamo instance id of a launched worker (its request-plane port in discovery)."""
    for path in (spec.discovery_dir / "v1" / "instances").iterdir():
        entry = json.loads(path.read_text())
        if entry.get("endpoint") == "generate" and entry["transport"]["tcp"].split("/")[0].endswith(
            f":{proc.side_ports[0]}"
        ):
            return int(entry["instance_id"])
    raise KeyError(proc.name)


HINTS = {"osl": 16, "latency_sensitivity": 1.2}
"""Dynamo's agent hints, as a client written for Dynamo's router sends them."""
TEXT = "Fix the failing scheduler test: " + " ".join(f"step {i} ok" for i in range(120))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": TEXT}),
        ("/v1/chat/completions", {"messages": HISTORY, "tools": TOOLS}),
        ("/v1/completions", {"prompt": "Hinted. " + TEXT, "nvext": {"agent_hints": HINTS}}),
    ],
    ids=["text completion", "chat with tools", "text completion with agent hints"],
)
def test_through_kvpilot_a_request_is_prefilled_on_the_frontend_s_own_tokens(fleet, spec, events, path, body):
    """Beside Dynamo the frontend is the oracle: a text completion, and a chat with tools and
    a tool-call history, sent through kvpilot are prefilled on exactly the token ids the
    frontend computes for the same request sent to it directly (each read from a prefill
    worker's own KV events), and both answers count the same prompt tokens. A text
    completion goes with the router's ids (``nvext.token_data``), computed by the frontend's
    rule (it adds no BOS to text, where vLLM's completions endpoint does); a chat goes as it
    came: the frontend renders tools otherwise than vLLM (the router's ids, vLLM's, part from
    the frontend's within the tools' JSON), and its rendering is what its workers serve. A
    client's ``nvext.agent_hints`` reach the frontend beside the router's ids."""
    sent = {"model": "tiny", "max_tokens": 3, **body}
    events.stored(0.0)
    status, headers, through = _post(f"{spec.client_url}{path}", sent)
    assert status == 200, through
    p = _worker_of(spec, headers["X-KVPilot-Prefill-Worker"])
    d = _worker_of(spec, headers["X-KVPilot-Decode-Worker"])
    prefilled_through = events.stored()[p.name]
    other_p = next(e for e in fleet.engines if e.role == Role.PREFILL.value and e.name != p.name)
    direct_headers = {
        "x-dynamo-worker-instance-id": str(_instance_of(spec, d)),
        "x-dynamo-prefill-instance-id": str(_instance_of(spec, other_p)),
    }
    status, _, direct = _post(f"{spec.frontend_url}{path}", sent, direct_headers)
    assert status == 200, direct
    prefilled_direct = events.stored()[other_p.name]
    assert prefilled_through and prefilled_through == prefilled_direct
    assert through["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


def test_the_router_reads_each_worker_s_events_from_its_own_port(fleet, spec, events):
    prompt = _prompt(2)
    first = _complete(spec, prompt)
    events.stored()
    status, _, explained = _post(f"{fleet.router.url}/debug/route", {"model": "tiny", "prompt": [*prompt, 5, 6]})
    assert status == 200
    p = first["X-KVPilot-Prefill-Worker"]
    assert explained["overlap"].get(p, {}).get("GPU") == 4  # the index holds the prompt on P, and only there
    assert [w for w, tiers in explained["overlap"].items() if tiers.get("GPU")] == [p]
    assert _complete(spec, [*prompt, 5, 6])["X-KVPilot-Prefill-Worker"] == p  # and routes its next step there


def test_a_worker_that_leaves_is_dropped_and_one_that_joins_is_used(fleet, spec, events):
    names = dynamo_fleet.router_workers(fleet.router.url)
    decoders = [n for n in names if n.startswith("decode-")]
    assert len(decoders) == 2
    leaving = _worker_of(spec, decoders[1])
    leave_worker(spec.run_dir, leaving.name)
    left = dynamo_fleet.wait_for_workers(fleet.router.url, lambda now: decoders[1] not in now, 15)
    assert sorted(left) == sorted(n for n in names if n != decoders[1])
    for seed in range(10, 16):  # the departed worker is never chosen again, and nothing fails
        assert _complete(spec, _prompt(seed, 2))["X-KVPilot-Decode-Worker"] == decoders[0]

    joined = join_worker(spec, Role.DECODE)
    now = dynamo_fleet.wait_for_workers(fleet.router.url, lambda now: len(now) == len(names), 15)
    (new,) = set(now) - set(names) - {decoders[1]}
    assert _worker_of(spec, new).name == joined.name
    before = _requests_served(joined)
    chosen = [_complete(spec, _prompt(seed, 2))["X-KVPilot-Decode-Worker"] for seed in range(20, 40)]
    assert new in chosen  # the cost model breaks ties at random: 20 requests all elsewhere is 1e-6
    assert _requests_served(joined) - before == chosen.count(new)  # by the new worker's own counter


def _loopback(host: str) -> bool:
    """Loopback, IPv4-mapped IPv6 included (gRPC's sockets are dual-stack: ``::ffff:127.0.0.1``)."""
    address = ipaddress.ip_address(host.strip("[]"))
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_every_discovery_address_and_every_connection_is_loopback(fleet, spec):
    _complete(spec, _prompt(50))  # connections of a request in the fleet's recent past
    texts = [p.read_text() for p in spec.discovery_dir.rglob("*") if p.is_file()]
    hosts = [h for text in texts for h in re.findall(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])", text)]
    assert hosts and all(_loopback(h) for h in hosts), sorted(set(hosts))
    assert not re.search(r"tcp://(?!127\.0\.0\.1|\[::1\]|localhost)", "\n".join(texts))
    recorded = Fleet.load(spec.run_dir)  # as it is now: one worker left, one joined
    assert recorded is not None
    procs = [psutil.Process(p.pid) for p in recorded.processes]
    procs += [child for proc in list(procs) for child in proc.children(recursive=True)]
    assert len(procs) >= 7  # 4 workers, the frontend, the router, Envoy
    peers = [c for proc in procs for c in proc.net_connections("inet") if c.raddr]
    assert peers, "no connection at all: nothing was checked"
    outside = [(c.laddr, c.raddr) for c in peers if not (_loopback(c.laddr.ip) and _loopback(c.raddr.ip))]
    assert outside == []
    restarter = psutil.Process(next(p.pid for p in recorded.processes if p.name == "envoy"))
    (envoy,) = [p for p in restarter.children() if p.name() == "envoy"]
    listening = [c.laddr for c in envoy.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert {a.port for a in listening} == {spec.gateway_port, spec.envoy_admin_port}  # the gateway and admin
    assert all(_loopback(a.ip) for a in listening), listening


def _first_tokens_seen(fleet: Fleet) -> float:
    """How many first tokens the router has timed (``kvpilot_router_ttft_seconds_count``)."""
    with urllib.request.urlopen(f"{fleet.router.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(r"^kvpilot_router_ttft_seconds_count (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_router_learns_each_worker_s_prefill_from_its_own_timings(fleet, spec):
    """Dynamo's mockers publish no vLLM /metrics, and Envoy, not the router, carries the
    streams: the picker reads each request's first-token time from Envoy's access log (the
    destination's first body byte, an uncontended prefill deferred into D's call) and fits
    the workers' prefill from it. After a few, a new prompt's predicted TTFT is
    the measured one's order, where the roofline prior (an H100 for the tiny model)
    is not."""
    before = _first_tokens_seen(fleet)
    warm_ups = list(zip(range(60, 68), (4, 40, 12, 56, 8, 28, 48, 20), strict=True))
    for seed, blocks in warm_ups:
        complete(spec.client_url, _prompt(seed, blocks), max_tokens=2, stream=True, ignore_eos=True)
    deadline = time.monotonic() + 10
    while _first_tokens_seen(fleet) < before + len(warm_ups) and time.monotonic() < deadline:
        time.sleep(0.05)  # each request's access-log entry reaches the picker as the request ends
    assert _first_tokens_seen(fleet) == before + len(warm_ups)
    prompt = _prompt(70, 36)
    status, _, explained = _post(f"{fleet.router.url}/debug/route", {"model": "tiny", "prompt": prompt})
    assert status == 200
    predicted = explained["predicted"]
    assert predicted["prefill"]["measured_s"] is not None and predicted["prefill"]["samples"] > 0, predicted
    measured = complete(spec.client_url, prompt, max_tokens=2, stream=True, ignore_eos=True).ttft_seconds
    learned, prior = predicted["ttft_s"], predicted["prior_ttft_s"]
    print(f"\nTTFT measured {measured * 1e3:.1f} ms, predicted {learned * 1e3:.1f} ms, prior {prior * 1e3:.2f} ms")
    assert abs(math.log(learned / measured)) < abs(math.log(prior / measured))
    assert measured / 3 < learned < measured * 3


def _stream_in_thread(url: str, prompt: list[int], max_tokens: int) -> tuple[threading.Thread, dict[str, Any]]:
    """A streamed completion read to its end in a thread: ``out["first"]`` is set at its
    first event, ``out["events"]`` counts its events, ``out["done"]`` says it ended with
    ``[DONE]``, ``out["error"]`` holds what broke it."""
    out: dict[str, Any] = {"first": threading.Event(), "events": 0, "done": False, "error": None}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )

    def read() -> None:
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                for line in resp:
                    if line.startswith(b"data: "):
                        out["events"] += 1
                        out["first"].set()
                        out["done"] = line.strip() == b"data: [DONE]"
        except OSError as exc:
            out["error"] = exc
        finally:
            out["first"].set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, out


def test_an_envoy_hot_restart_cuts_no_stream(fleet, spec):
    """A new Envoy takes over the listener while the old one serves the stream it holds to
    its end (Envoy's hot restart, a SIGHUP to its restarter); new requests go through the new one."""
    assert spec.gateway is not None
    thread, out = _stream_in_thread(spec.client_url, _prompt(85, 2), max_tokens=8000)  # ~5 s at speedup 10
    assert out["first"].wait(30) and out["error"] is None
    before = Fleet.load(spec.run_dir)
    assert before is not None and before.gateway is not None
    envoys = [p.pid for p in psutil.Process(before.gateway.pid).children() if p.name() == "envoy"]
    restart_gateway(spec.run_dir, spec.gateway)
    now = [p.pid for p in psutil.Process(before.gateway.pid).children() if p.name() == "envoy"]
    assert len(envoys) == 1 and now[0] == envoys[0] and len(now) == 2  # the old one drains beside the new
    assert _complete(spec, _prompt(86))["x-kvpilot-route"] == "remote_prefill"  # through the new Envoy
    thread.join(60)
    assert out["error"] is None and out["done"] and out["events"] == 8002, out  # the old one finished it


def test_the_picker_down_is_a_clear_503_and_its_restart_breaks_no_stream(fleet, spec):
    """Last in the module: it restarts the router. A stream Envoy carries survives the
    picker's crash; meanwhile Envoy answers new requests at once with a 503 naming the
    picker (and a client naming its own destination is not let through); the restarted
    picker serves again, its index replayed from the workers' events."""
    prompt = _prompt(80, 4)
    decode = _complete(spec, prompt)["x-kvpilot-decode-worker"]  # the prompt's blocks are on a worker, in the index
    thread, out = _stream_in_thread(spec.client_url, _prompt(81, 2), max_tokens=8000)  # ~5 s at speedup 10
    assert out["first"].wait(30) and out["error"] is None
    os.killpg(fleet.router.pid, signal.SIGKILL)  # the picker crashes mid-stream
    started = time.monotonic()
    instance = str(int(_instance(decode), 16))
    status, _, payload = _post(
        f"{spec.client_url}/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 3},
        {"x-gateway-destination-endpoint": f"127.0.0.1:{spec.frontend_port}", "x-dynamo-worker-instance-id": instance},
    )
    assert status == 503 and time.monotonic() - started < 2.0, payload
    assert "endpoint picker could not be reached" in payload["error"]["message"], payload
    restarted = dynamo_fleet.restart_router(spec)
    assert restarted.router.pid != fleet.router.pid
    thread.join(60)
    assert out["error"] is None and out["done"] and out["events"] == 8002, out  # 8000 tokens, the finish, [DONE]
    explained = _post(f"{restarted.router.url}/debug/route", {"model": "tiny", "prompt": prompt})[2]
    assert max(tiers.get("GPU", 0) for tiers in explained["overlap"].values()) == 4  # the index came back
    assert _complete(spec, prompt)["x-kvpilot-route"] == "remote_prefill"
