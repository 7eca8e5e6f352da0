"""Every panel of the committed Grafana dashboards shows data from a live fleet.

One P/D fleet (KVPilotConnector, NIXL's own exporter on) with Prometheus scraping
every engine, every NIXL agent and the router (``fleet up --observe``), then traffic
that does what the panels show: verified transfers through the router, a stream, a
three-step session, offers D rejects (edited tokens, another contract), a prefill
fallback, an engine error, a refused prompt, a forged KV-event frame (a gap the
engine cannot replay, carrying an event the router rejects), and two reads the engines'
fault injector breaks (a corrupted block the KV digest catches, a lost completion the read
deadline ends). Then every query of
every panel, with the template variables set to "All" as Grafana sends it, is
evaluated through Prometheus' HTTP API and must return a finite value; every alert
expression evaluates; and the injected faults fire their alerts.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
import zmq

from kvpilot.deploy import dashboards
from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import HTTPStatusError, complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import scrape, total
from kvpilot.deploy.observe import DEFAULT_RULES, ObserveSpec
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.scenarios import BLOCK_SIZE, prefill_on
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()
PREFILL_TIMEOUT_S = 20
"""The router's wait for P: the fallback's stopped P times out after it; P's prefills of
these prompts take well under a second here, so no other request falls back."""
PROMETHEUS_PORT = block_of(__name__).spare(0)
WINDOW = "10m"
"""``$__rate_interval`` in the checks: wider than the whole run, so each rate sees all of it."""
FIRST_REQUEST_TIMEOUT_S = 900.0
"""D's first pull from P pays NIXL's handshake; on a busy 2-core box that has taken minutes."""
FAULT_ALERTS = (
    "KVPilotKVEventGapUnrecoverable",
    "KVPilotPrefillFallbacks",
    "KVPilotOfferContractMismatch",
    "KVPilotKVDigestMismatch",
    "KVPilotReadsAbandoned",
)
FAULTS = {"dash-corrupt": "corrupt_block", "dash-drop": "drop_completion"}
"""Request id parts the engines' fault injector breaks the reads of."""
READ_DEADLINE_FLOOR_S = 5.0


def _rules_without_waiting(path: Path) -> Path:
    """A copy of grafana/alerts.yml whose alerts fire as soon as their expression holds."""
    doc = yaml.safe_load(DEFAULT_RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _wait_first_scrapes(prom: dashboards.Prometheus, expected: int, timeout: float = 120.0) -> None:
    """Until every target was scraped once and is up: counters' zeros are recorded
    before any traffic, so a rate over the run sees every increment."""
    deadline = time.monotonic() + timeout
    while True:
        targets = prom.targets()
        up = [t for t in targets if t["health"] == "up"]
        if len(up) == expected:
            return
        if time.monotonic() > deadline:
            states = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
            raise AssertionError(f"targets not all up: {states}")
        time.sleep(1.0)


def _forge_kv_event_gap(events_endpoint: str, router_url: str, worker: str) -> None:
    """A frame far ahead of the engine's sequence (a gap its replay buffer cannot fill)
    whose batch carries an event of an unknown type, sent to the router's bound SUB."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(events_endpoint)
    payload = msgspec.msgpack.encode([time.time(), [{"type": "NotAnEvent"}]])
    try:
        for _ in range(10):  # a PUB drops what it sends before the subscription reaches it
            time.sleep(1.0)
            if total(scrape(router_url), "kvpilot_router_kv_event_unrecoverable_gaps_total", worker=worker) >= 1:
                return
            pub.send_multipart([b"kv", (500_000).to_bytes(8, "big"), payload])
        raise AssertionError("the router never saw the forged KV-event frame")
    finally:
        pub.close()


def _wait_scraped(prom: dashboards.Prometheus, selector: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not prom.query(selector):
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus has no sample of {selector}")
        time.sleep(0.5)


def _drive(fleet: Fleet, prom: dashboards.Prometheus, tokenizer: PromptTokenizer) -> None:
    router = fleet.router.url
    prefill, decode = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url

    def ids(seed: int, words: int = 300) -> list[int]:
        return tokenizer.text_token_ids(f"dash {seed}: " + filler_text(words, seed))

    # Verified transfers P -> D through the router; the repeat hits P's prefix cache.
    x = ids(1)
    complete(router, x, max_tokens=4, timeout=FIRST_REQUEST_TIMEOUT_S)
    for prompt in (ids(2), x):
        complete(router, prompt, max_tokens=4)
    # TTFT by stage needs streams. The router creates the decode_first_token series at
    # the first one: a rate needs a second stream after Prometheus has scraped that.
    complete(router, ids(3), max_tokens=6, stream=True)
    _wait_scraped(prom, 'kvpilot_router_ttft_stage_seconds_count{stage="decode_first_token"}')
    complete(router, ids(7), max_tokens=6, stream=True)
    # A three-step session: the router picks an option at steps 2 and 3, D's offers go
    # unused. Step 2 creates both series: an increase needs step 3 after they were scraped.
    prompt = ids(4)
    for step in range(3):
        out = complete(
            router, prompt, max_tokens=8, ignore_eos=True, return_token_ids=True, conversation_id="dash-session"
        )
        prompt = prompt + list(out.token_ids) + tokenizer.text_token_ids(f" tool: step {step} ok")
        if step == 1:
            _wait_scraped(prom, 'kvpilot_router_session_options_total{option="reprefill"}')
            _wait_scraped(prom, 'kvpilot_router_session_offers_total{outcome="unused"}')
    # Offers D rejects: P's KV of x on D's edited prompt, and under another contract.
    edited = x[: 4 * BLOCK_SIZE] + [t + 1 for t in x[4 * BLOCK_SIZE :]]
    complete(decode, edited, max_tokens=2, kv_transfer_params=prefill_on(prefill, x, salt=None))
    salt = uuid.uuid4().hex[:8]
    complete(decode, x, max_tokens=2, kv_transfer_params=prefill_on(prefill, x, f"a-{salt}"), cache_salt=f"b-{salt}")
    # A prefill fallback: P stops answering, its prefill times out (PREFILL_TIMEOUT_S), and
    # D serves the request; P runs on again afterwards.
    p_group = fleet.by_role("prefill")[0].pid
    os.killpg(p_group, signal.SIGSTOP)
    try:
        fallback = complete(router, ids(5), max_tokens=3)
    finally:
        os.killpg(p_group, signal.SIGCONT)
    assert fallback.headers["X-KVPilot-Route"] == "fallback"
    # An engine error passed to the client (a regex xgrammar cannot compile: the router
    # checks what vLLM checks without vLLM, not a grammar; P refuses it, then D, whose error
    # the client gets), and a prompt refused before routing.
    engine_error = {"prompt": ids(6), "max_tokens": 2, "structured_outputs": {"regex": "("}}
    for body in (engine_error, {"prompt": [1] * 9000, "max_tokens": 2}):
        with pytest.raises(HTTPStatusError) as refused:
            complete(router, **body)
        assert refused.value.status == 400
    decode_worker = next(
        w for w in yaml.safe_load((fleet.run_dir / "router.yaml").read_text())["workers"] if w["role"] == "decode"
    )
    _forge_kv_event_gap(decode_worker["kv_events_endpoint"], router, decode_worker["name"])
    # Reads the fault injector breaks: D's read of P's KV corrupted (the digest catches it),
    # then one whose completion is lost (the deadline ends it); D recomputes both.
    for seed, fault in enumerate(FAULTS, start=8):
        time.sleep(1.5)  # past peer_retry_after_s: the last failed read no longer skips P
        prompt = ids(seed)
        params = prefill_on(prefill, prompt, salt=None)
        complete(decode, prompt, max_tokens=2, kv_transfer_params=params, request_id=f"{fault}-{uuid.uuid4().hex}")


@pytest.fixture(scope="module")
def observed(
    model_dir: Path, tokenizer: PromptTokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Fleet, dashboards.Prometheus]]:
    if shutil.which("prometheus") is None and not os.environ.get("KVPILOT_PROMETHEUS"):
        pytest.skip("Prometheus is not installed: `apt-get install -y prometheus` (scripts/bootstrap.sh does it)")
    run_dir = tmp_path_factory.mktemp("dashboards-fleet")
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=run_dir,
        disaggregation="always",
        connector_extra_config={
            "bidirectional_kv_xfer": True,
            "fault_injection": {"request_ids": FAULTS},
            "allow_fault_injection": True,
            "read_deadline_floor_s": READ_DEADLINE_FLOOR_S,
            "peer_retry_after_s": 1.0,
        },
        **PORTS,
    )
    observe = ObserveSpec(port=PROMETHEUS_PORT, rules=_rules_without_waiting(run_dir / "alerts-now.yml"))
    started = fleet_io.up(spec, timeout=600, observe=observe)
    try:
        # Later session steps re-prefill on P: D's offers are counted (unused) and no
        # P-from-D pull pays a second NIXL handshake on this small box.
        flags = ["--sessions-force-option", "reprefill", "--server-prefill-timeout-s", str(PREFILL_TIMEOUT_S)]
        started = fleet_io.restart_router(spec, flags)
        prom = dashboards.Prometheus(observe.url)
        _wait_first_scrapes(prom, expected=2 * 2 + 1)  # engines, their NIXL agents, the router
        _drive(started, prom, tokenizer)
        time.sleep(5.0)  # two scrapes and a rule evaluation after the last request
        yield started, prom
    finally:
        fleet_io.down(run_dir)


def _evaluate_all(prom: dashboards.Prometheus) -> dict[str, list[dict]]:
    results = {}
    for dash in dashboards.load_all():
        variables = dashboards.variable_values(prom, dash)
        for q in dash.queries:
            results[q.name] = prom.query(dashboards.substitute(q.expr, variables, WINDOW))
    return results


def test_fleet_status_lists_prometheus(observed: tuple[Fleet, dashboards.Prometheus]) -> None:
    fleet, prom = observed
    rows = {proc.name: (alive, healthy) for proc, alive, healthy in fleet_io.status(fleet.run_dir)}
    assert rows["prometheus"] == (True, True) and fleet.prometheus is not None
    assert fleet.prometheus.url == prom.url


def test_every_variable_finds_its_values(observed: tuple[Fleet, dashboards.Prometheus]) -> None:
    _, prom = observed
    for dash in dashboards.load_all():
        values = {
            name: sorted(prom.label_values(dashboards.substitute(query, {"model": "tiny"})))
            for name, query in dash.variables.items()
        }
        assert values == {
            "model": ["tiny"],
            "instance": [f"127.0.0.1:{PORTS['engine_port'] + i}" for i in range(2)],
            "worker": ["decode-0", "prefill-0"],
        }, dash.uid


def test_every_panel_query_returns_data(observed: tuple[Fleet, dashboards.Prometheus]) -> None:
    _, prom = observed
    results = _evaluate_all(prom)
    empty = [name for name, result in results.items() if not finite_values(result)]
    assert not empty, f"{len(empty)} of {len(results)} queries show no data: {empty}"


def finite_values(result: Iterable[dict[str, Any]]) -> list[float]:
    """The finite sample values of an instant query's result (NaN and ±Inf left out)."""
    return [value for series in result if math.isfinite(value := float(series["value"][1]))]


def _values(result: list[dict], **labels: str) -> list[float]:
    return finite_values(r for r in result if all(r["metric"].get(k) == v for k, v in labels.items()))


def test_panels_show_what_the_fleet_did(observed: tuple[Fleet, dashboards.Prometheus]) -> None:
    """Not just a flat zero: the events the traffic caused are on their panels."""
    _, prom = observed
    r = _evaluate_all(prom)
    t, rt = "kvpilot / Transfers", "kvpilot / Router"
    for ref in "ABCD":  # p50, p95, p99, mean
        assert max(_values(r[f"{t} / Transfer time / {ref}"])) > 0
    assert max(_values(r[f"{t} / Throughput and per-transfer bandwidth / A"])) > 0
    assert max(_values(r[f"{t} / Prompt tokens by source / A"], source="external_kv_transfer")) > 0
    assert max(_values(r[f"{t} / Offers and verified blocks / B"])) > 0
    for reason in ("token_mismatch", "contract_mismatch"):
        assert max(_values(r[f"{t} / Rejected blocks by reason / A"], reason=reason)) > 0, reason
        assert max(_values(r[f"{t} / Recomputed tokens by reason / A"], reason=reason)) > 0, reason
    assert max(_values(r[f"{t} / NIXL agent bytes / A"], worker="decode-0")) > 0  # D reads P's KV
    assert max(_values(r[f"{t} / Blocks checked and digest mismatches / A"])) > 0
    assert max(_values(r[f"{t} / Blocks checked and digest mismatches / B"])) > 0  # the corrupted read
    assert max(_values(r[f"{t} / Reads abandoned at their deadline / A"])) > 0  # the lost completion
    for reason in ("digest_mismatch", "deadline"):
        assert max(_values(r[f"{t} / Blocks failed by the checks / A"], reason=reason)) > 0, reason
    for kind in FAULTS.values():
        assert max(_values(r[f"{t} / Faults injected (tests only) / A"], kind=kind)) > 0, kind
    stages = {s["metric"]["stage"]: float(s["value"][1]) for s in r[f"{rt} / Mean TTFT by stage / A"]}
    assert set(stages) == {"route", "prefill", "decode_first_token"} and min(stages.values()) > 0
    assert max(_values(r[f"{rt} / Decisions by kind / A"], kind="remote_prefill")) > 0
    assert max(_values(r[f"{rt} / Session steps by option / A"], option="reprefill")) > 0
    assert max(_values(r[f"{rt} / Session offers by outcome / A"], outcome="unused")) > 0
    assert max(_values(r[f"{rt} / Predicted vs measured prefix-cache hit ratio / A"])) > 0
    assert max(_values(r[f"{rt} / Predicted vs measured prefix-cache hit ratio / B"])) > 0
    assert max(_values(r[f"{rt} / Prefill fallbacks / A"])) > 0
    # Counters since the router's restart: P's prefill timed out once (the fallback), D
    # refused the engine error's regex, the router refused the 9,000-token prompt.
    since_start = {
        panel: r[f"{rt} / {panel} (since router start) / A"]
        for panel in ("Prefill failures", "Engine errors passed to clients", "Requests refused before routing")
    }
    # At least the fallback's: on a slow box another of P's prefills can outlast the floor too.
    assert _values(since_start["Prefill failures"], worker="prefill-0", reason="timeout")[0] >= 1
    assert _values(since_start["Engine errors passed to clients"], worker="decode-0") == [1]
    assert _values(since_start["Requests refused before routing"], reason="prompt_too_long") == [1]
    rejected = r[f"{rt} / KV events rejected (since router start) / A"]
    assert max(_values(rejected, worker="decode-0", reason="unknown_tag")) > 0  # one per forged frame that arrived
    assert max(_values(r[f"{rt} / KV-event gaps, replays and restarts / C"], worker="decode-0")) > 0
    assert max(_values(r[f"{rt} / Index blocks per worker and tier / A"], worker="prefill-0")) > 0


def test_every_alert_expression_evaluates_and_the_faults_fire(observed: tuple[Fleet, dashboards.Prometheus]) -> None:
    _, prom = observed
    for group in yaml.safe_load(DEFAULT_RULES.read_text())["groups"]:
        for rule in group["rules"]:
            prom.query(rule["expr"])  # raises PrometheusError on a bad expression
    deadline = time.monotonic() + 30
    while True:
        rules = prom.rules()
        firing = {a["labels"]["alertname"]: a["labels"] for a in prom.alerts() if a["state"] == "firing"}
        if set(FAULT_ALERTS) <= set(firing) or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert set(FAULT_ALERTS) <= set(firing), f"firing: {sorted(firing)}"
    assert firing["KVPilotKVEventGapUnrecoverable"]["worker"] == "decode-0"
    assert firing["KVPilotOfferContractMismatch"]["reason"] == "contract_mismatch"


def test_panels_render_to_png(observed: tuple[Fleet, dashboards.Prometheus], tmp_path: Path) -> None:
    """``kvpilot dashboards render``: one PNG per panel (KVPILOT_DASHBOARD_PNGS keeps them)."""
    _, prom = observed
    out = Path(os.environ.get("KVPILOT_DASHBOARD_PNGS") or tmp_path)
    written = dashboards.render(prom, out, minutes=5, rate_interval="30s")
    panels = sum(len(d.panels) for d in dashboards.load_all())
    assert len(written) == panels and all(p.stat().st_size > 5000 for p in written)
