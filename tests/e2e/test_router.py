"""The KV-aware router on real engines: routing by the engines' own KV events,
tenant isolation, malformed events, engine restart. Two co-located engines."""

from __future__ import annotations

import json
import socket as socket_module
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
import zmq

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import Completion, complete, debug_route, wait_for_overlap
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled, total, wait_for_metric
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors import vllm_metrics
from kvpilot.kvconnectors.vllm_metrics import PROMPT_TOKENS_BY_SOURCE
from kvpilot.routing.config import IndexBackend
from kvpilot.routing.serve.request_fields import ENGINE_INTERNAL
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()
CACHE_HIT = PROMPT_TOKENS_BY_SOURCE.total


@pytest.fixture(scope="module", params=list(IndexBackend), ids=lambda backend: backend.value)
def spec(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FleetSpec:
    """The same fleet and tests with each index backend (kvpilot's, Dynamo's RadixTree)."""
    return FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("router-fleet"),
        prefill=0,
        decode=0,
        colocated=2,
        index_backend=request.param,
        **PORTS,
    )


@pytest.fixture(scope="module")
def fleet(spec: FleetSpec) -> Iterator[Fleet]:
    with running_fleet(spec) as started:
        yield started


@pytest.fixture(scope="module")
def warmed(fleet: Fleet, tokenizer: PromptTokenizer) -> tuple[list[int], list[int]]:
    """Prompt A cached on colocated-0, prompt B on colocated-1 (sent to them directly)."""
    a, b = tokenizer.text_token_ids(filler_text(600, 21)), tokenizer.text_token_ids(filler_text(600, 22))
    complete(fleet.engines[0].url, a, max_tokens=1)
    complete(fleet.engines[1].url, b, max_tokens=1)
    assert wait_for_overlap(fleet.router.url, a, "colocated-0", len(a) // 32)["overlap"]["colocated-0"]["GPU"] > 0
    assert wait_for_overlap(fleet.router.url, b, "colocated-1", len(b) // 32)["overlap"]["colocated-1"]["GPU"] > 0
    return a, b


def _hits(before: list, after: list) -> float:
    return sum(delta(x, y, CACHE_HIT, source="local_cache_hit") for x, y in zip(after, before, strict=True))


def test_prefix_routing_beats_round_robin(
    fleet: Fleet, warmed: tuple[list[int], list[int]], tokenizer: PromptTokenizer
) -> None:
    a, b = warmed
    extensions = [
        (base + tokenizer.text_token_ids(f" step {i} " + filler_text(40, 30 + i)), want)
        for i in range(4)
        for base, want in ((a, "colocated-0"), (b, "colocated-1"))
    ]
    before = [scrape(e.url) for e in fleet.engines]
    placed = [
        complete(fleet.router.url, prompt, max_tokens=2).headers.get("X-KVPilot-Decode-Worker")
        for prompt, _ in extensions
    ]
    after = [settled(e.url, b, finished=placed.count(e.name)) for e, b in zip(fleet.engines, before, strict=True)]
    routed_hits = _hits(before, after)
    assert placed == [want for _, want in extensions]

    # Round robin on the same engines, with the same prompts under a fresh salt (warmed
    # again, A on engine 0 and B on engine 1) sends some where their prefix is not cached:
    # each such miss is a cold prefill of the whole prefix.
    salt = uuid.uuid4().hex
    complete(fleet.engines[0].url, a, max_tokens=1, cache_salt=salt)
    complete(fleet.engines[1].url, b, max_tokens=1, cache_salt=salt)
    before = [scrape(e.url) for e in fleet.engines]
    for i, (prompt, _) in enumerate(extensions):
        complete(fleet.engines[(i // 2) % 2].url, prompt, max_tokens=2, cache_salt=salt)
    sent = [sum(1 for i in range(len(extensions)) if (i // 2) % 2 == k) for k in range(len(fleet.engines))]
    after = [settled(e.url, b, finished=n) for e, b, n in zip(fleet.engines, before, sent, strict=True)]
    round_robin_hits = _hits(before, after)
    full_prefix = len(a) // 32 * 32
    assert routed_hits >= len(extensions) * full_prefix
    assert round_robin_hits <= routed_hits - full_prefix
    print(f"\nprefix routing: {routed_hits:.0f} cached prompt tokens; round robin: {round_robin_hits:.0f}")


def test_another_salt_earns_no_credit(fleet: Fleet, warmed: tuple[list[int], list[int]]) -> None:
    a, _ = warmed
    assert debug_route(fleet.router.url, a)["cached_blocks"] == len(a) // 32
    other = debug_route(fleet.router.url, a, cache_salt="another-tenant")
    assert other["cached_blocks"] == 0 and not any(other["overlap"].values())


def test_malformed_events_are_counted_and_skipped(fleet: Fleet, spec: FleetSpec, tokenizer: PromptTokenizer) -> None:
    before = scrape(fleet.router.url)
    socket = zmq.Context.instance().socket(zmq.PUB)
    socket.connect(f"tcp://127.0.0.1:{spec.events_port}")  # the router binds; a rogue publisher connects
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            socket.send_multipart((b"kv", (2**62).to_bytes(8, "big"), b"\xc1 not msgpack"))
            socket.send_multipart((b"kv", b"short"))
            time.sleep(0.2)
            after = scrape(fleet.router.url)
            if (
                delta(after, before, "kvpilot_router_kv_event_bad_frames_total")
                + delta(after, before, "kvpilot_router_kv_events_rejected_total")
                >= 2
            ):
                break
    finally:
        socket.close(linger=0)
    assert (
        total(after, "kvpilot_router_kv_event_bad_frames_total")
        + total(after, "kvpilot_router_kv_events_rejected_total")
        >= 2
    )
    out = complete(fleet.router.url, tokenizer.text_token_ids(filler_text(50, 5)), max_tokens=2)
    assert out.tokens  # still serving


def test_engine_restart_clears_its_entries(
    fleet: Fleet, spec: FleetSpec, warmed: tuple[list[int], list[int]], tokenizer: PromptTokenizer
) -> None:
    a, _ = warmed
    assert debug_route(fleet.router.url, a)["overlap"].get("colocated-0", {}).get("GPU", 0) > 0
    restarted = fleet_io.restart_engine(spec, "colocated-0")
    # The new engine publishes from sequence 0 again once it stores blocks.
    other = tokenizer.text_token_ids(filler_text(100, 77))
    complete(restarted.engines[0].url, other, max_tokens=1)
    deadline = time.monotonic() + 30
    while (
        debug_route(fleet.router.url, a)["overlap"].get("colocated-0", {}).get("GPU", 0) and time.monotonic() < deadline
    ):
        time.sleep(0.3)
    assert debug_route(fleet.router.url, a)["overlap"].get("colocated-0", {}).get("GPU", 0) == 0
    assert (
        wait_for_overlap(fleet.router.url, other, "colocated-0", len(other) // 32)["overlap"]["colocated-0"]["GPU"] > 0
    )


def test_router_reads_the_engines_own_load(fleet: Fleet, spec: FleetSpec, tokenizer: PromptTokenizer) -> None:
    """The router polls each engine's /metrics (every 5 s) and exports what it read: a
    series of each gauge for every engine, and the engine's own numbers in them. A long
    generation sent to colocated-0 directly (not through the router: the engines' own
    gauges count traffic the router did not see) holds KV there until it is cut off: the
    router must report KV usage above 0 and a running request for colocated-0, while
    colocated-1, idle, runs none."""
    names = [e.name for e in fleet.engines]
    usage_name = "kvpilot_router_engine_kv_usage"
    deadline = time.monotonic() + 60
    while True:
        samples = scrape(fleet.router.url)
        seen = {dict(labels).get("worker") for (name, labels) in samples if name == usage_name}
        if seen >= set(names) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for worker in names:
        for field in ("kv_usage", "running", "waiting"):
            series = f"kvpilot_router_engine_{field}"
            assert any(n == series and ("worker", worker) in labels for n, labels in samples), (series, worker)

    loaded, idle = fleet.engines[0], fleet.engines[1]
    prompt = tokenizer.text_token_ids(filler_text(100, 91))
    body = {
        "model": spec.served_model_name,
        "prompt": prompt,
        "max_tokens": spec.max_model_len - len(prompt),  # minutes of decoding: far longer than a poll
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{loaded.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        assert stream.readline().startswith(b"data:")  # its first token: its KV is allocated
        samples = wait_for_metric(
            fleet.router.url, usage_name, lambda usage: usage > 0, timeout=30, interval=0.2, worker=loaded.name
        )
        usage = total(samples, usage_name, worker=loaded.name)
        running = total(samples, "kvpilot_router_engine_running", worker=loaded.name)
        idle_running = total(samples, "kvpilot_router_engine_running", worker=idle.name)
    # Closed: the engine aborts the generation; leave it idle for the next test.
    running_name = vllm_metrics.NUM_REQUESTS_RUNNING.sample
    after = wait_for_metric(loaded.url, running_name, lambda n: n == 0, timeout=120, interval=0.5)
    assert 0.0 < usage <= 1.0, f"{loaded.name}'s KV usage as the router reports it, while a request held KV: {usage}"
    assert running >= 1 and idle_running == 0, (running, idle_running)
    assert total(after, running_name) == 0, "the cut-off generation still runs"


def test_an_engine_whose_events_stop_is_flagged_and_routed_on_load_alone(
    fleet: Fleet, spec: FleetSpec, tokenizer: PromptTokenizer, tmp_path: Path
) -> None:
    """colocated-1 keeps serving but none of its KV events reach the router (its topic
    is misconfigured in the router's config: the router's SUB filters its batches out).
    Once it has prefilled a prompt through the router and stayed silent for
    ``index.events_stale_after_s``, it is flagged and gets no overlap credit; its
    answers stay correct. Runs last: it restarts the router, then restores it."""
    if spec.index_backend is not IndexBackend.KVPILOT:
        pytest.skip("the watch is the router's, whatever the index: once is enough")
    silenced = "colocated-1"
    config = yaml.safe_load((spec.run_dir / "router.yaml").read_text())
    for worker in config["workers"]:
        if worker["name"] == silenced:
            worker["topic"] = "not-what-the-engine-publishes"
    config["index"]["events_stale_after_s"] = 3.0
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    try:
        router = fleet_io.restart_router(spec, ["--config", str(tmp_path / "router.yaml")]).router.url
        served: dict[str, tuple[list[int], Completion]] = {}
        for seed in range(700, 712):  # fresh prompts: no overlap anywhere, so ties go to either worker
            prompt = tokenizer.text_token_ids(filler_text(200, seed))
            out = complete(router, prompt, max_tokens=4)
            served.setdefault(out.headers["X-KVPilot-Decode-Worker"], (prompt, out))
            if silenced in served:
                break
        assert silenced in served, f"no fresh prompt went to {silenced}: {sorted(served)}"
        stale = "kvpilot_router_kv_events_stale"
        samples = wait_for_metric(router, stale, lambda v: v == 1, timeout=30, worker=silenced)
        assert total(samples, stale, worker=silenced) == 1
        assert total(samples, "kvpilot_router_kv_events_went_stale_total", worker=silenced) == 1
        assert total(samples, stale, worker="colocated-0") == 0
        prompt, out = served[silenced]
        route = debug_route(router, prompt)
        assert route["events_stale"] == [silenced]
        reference = complete(fleet.engines[1].url, prompt, max_tokens=4, cache_salt=uuid.uuid4().hex)
        assert out.same_output(reference)
    finally:
        fleet_io.restart_router(spec)


def test_clients_cannot_make_engines_dial_anywhere(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """A client's own kv_transfer_params (pointing an engine's NIXL at a listener here)
    and every other engine-internal field are refused with a 400 naming the field, on
    both endpoints; the listener sees no connection, and the router keeps serving."""
    listener = socket_module.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    steer = {
        "do_remote_prefill": True,
        "remote_engine_id": "rogue",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [1, 2, 3],
    }
    prompt = tokenizer.text_token_ids(filler_text(100, 90))
    bodies = [({"prompt": prompt, "kv_transfer_params": steer}, "/v1/completions", "kv_transfer_params")]
    chat = {"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": steer}
    bodies.append((chat, "/v1/chat/completions", "kv_transfer_params"))
    bodies += [({"prompt": prompt, name: value}, "/v1/completions", name) for name, value in ENGINE_INTERNAL_SAMPLES]
    try:
        for body, path, name in bodies:
            request = urllib.request.Request(
                f"{fleet.router.url}{path}",
                data=json.dumps({"model": "tiny", "max_tokens": 2, **body}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert refused.value.code == 400 and name in refused.value.read().decode(), (path, name)
        time.sleep(2.0)  # anything dialing the listener would have by now
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert complete(fleet.router.url, prompt, max_tokens=2).tokens  # still serving


ENGINE_INTERNAL_SAMPLES = [(name, {"x": 1}) for name in sorted(ENGINE_INTERNAL)]
