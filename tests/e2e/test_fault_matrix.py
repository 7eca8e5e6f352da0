"""Faults the router handles, on both of its fronts (issue 40): the relay (``fleet.router``)
and Envoy with the endpoint picker (``fleet.gateway``), on one 1 P + 1 D fleet.

| fault | relay | Envoy |
|---|---|---|
| P stalls mid-handoff (stopped: no answer, no error) | here | here |
| P killed mid-handoff | ``test_dead_holder`` | here |
| D killed mid-stream | ``test_dead_holder`` | here |
| a stale or forged block id | ``test_verified_attach`` | the same engines |

(A stale or forged block id is refused by the engine itself: D verifies every block's hash
before it attaches it, whichever front sent the request.)

The data plane's faults (issue 52) run on the same fleet, whose engines carry kvpilot's fault
injector: it acts only on the reads of requests whose id names a fault (:data:`FAULTS`), which
a row sends the reader in a handoff driven as a router drives it:

| fault on a read (D of P's KV, and P of D's: the router's role reversal) | caught by | the answer |
|---|---|---|
| a byte of a landed block flipped | the KV digest | the co-located answer (recomputed from the bad block) |
| the read's completion held past its deadline | the read deadline | the co-located answer, within the bound |
| the read's completion dropped | the read deadline | the co-located answer, within the bound |

The router's fronts (relay and Envoy) do not carry a client's request id to the engines, so
these rows drive the engines as a router does; the fronts' own recovery is the rows above,
and ``tests/e2e/test_fault_fronts.py`` sends requests through both fronts to engines that
corrupt reads at random.

Each request ends within a stated bound, with the engine's own answer (a prefill D did
itself after the router's recovery equals D's answer with a fresh cache salt) or a clear
error naming the worker; a stream already running on D when P stalls runs to its end.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import Completion, HTTPStatusError, complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, total, wait_for_metric
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.parity import LOGPROB_TOLERANCE
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

BLOCK = block_of(__name__)
PREFILL_TIMEOUT_S = 5.0
"""The router's floor on its wait for P here: a stalled P is given up on after this (or k x
its predicted prefill, if longer)."""
RECOVERY_BOUND_S = PREFILL_TIMEOUT_S + 60.0
"""How long a request may take once its P stalled or died: the wait for P, then D's whole
prefill and six tokens on a loaded 2-core box."""
STREAM_END_BOUND_S = 60.0
"""How long a client's stream may last after its D died."""
RECOVERIES = "kvpilot_router_prefill_recoveries_total"
READ_DEADLINE_FLOOR_S = 8.0
"""The faulty fleet's floor on a read's deadline (its reads are small: the floor is the bound)."""
READ_BOUND_S = READ_DEADLINE_FLOOR_S + 60.0
"""How long D's answer may take when its read is abandoned: the deadline, then D's own
prefill and six tokens on a loaded 2-core box."""
PEER_RETRY_AFTER_S = 1.0
FAULTS = {
    "fm-corrupt": "corrupt_block",
    "fm-reused": "reused_block",
    "fm-stall": "stall_read",
    "fm-drop": "drop_completion",
}
"""A request id part -> the fault the faulty fleet's engines inject into that request's read."""


@pytest.fixture(scope="module")
def spec(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FleetSpec:
    return FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("fault-matrix-fleet"),
        disaggregation="always",
        gateway_port=BLOCK.spare(0),
        picker_port=BLOCK.spare(1),
        envoy_admin_port=BLOCK.spare(2),
        prefill_timeout_s=PREFILL_TIMEOUT_S,
        connector_extra_config={
            "fault_injection": {"request_ids": FAULTS, "stall_s": 3 * READ_BOUND_S},
            "allow_fault_injection": True,
            "read_deadline_floor_s": READ_DEADLINE_FLOOR_S,
            # a failed read marks its peer failed (its offers prefilled locally) for this long:
            # short, so that each fault row reads from P again
            "peer_retry_after_s": PEER_RETRY_AFTER_S,
        },
        **BLOCK.fleet(),
    )


@pytest.fixture(scope="module")
def fleet(spec: FleetSpec) -> Iterator[Fleet]:
    with running_fleet(spec) as started:
        yield started


def _front(fleet: Fleet, front: str) -> str:
    if front == "relay":
        return fleet.router.url
    assert fleet.gateway is not None
    return fleet.gateway.url


class _Stream:
    """A long greedy stream (P prefills, D decodes ``max_tokens``) read in a thread: its
    events, and how it ended (``error``: the exception that broke it, if any)."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        self.events: list[str] = []
        self.first_event = threading.Event()
        self.error: BaseException | None = None
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.0}
        self._request = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=600) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data:"):
                        self.events.append(line[5:].strip())
                        self.first_event.set()
        except (OSError, urllib.error.URLError, ValueError) as exc:  # a reset, an incomplete chunked body
            self.error = exc
        finally:
            self.first_event.set()

    @property
    def chunks(self) -> list[dict]:
        """The stream's JSON events (an engine may put several tokens in one)."""
        return [json.loads(event) for event in self.events if event != "[DONE]"]

    @property
    def finished_whole(self) -> bool:
        """The stream ended as the engine ends one: its last choice's ``finish_reason``, then ``[DONE]``."""
        chunks = self.chunks
        return (
            bool(self.events) and self.events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        )


def _served_or_refused(url: str, prompt: list[int]) -> tuple[Completion | None, HTTPStatusError | None, float]:
    """The answer to a six-token greedy completion or the error it got, and how long it took."""
    started = time.perf_counter()
    try:
        return complete(url, prompt, max_tokens=6, timeout=RECOVERY_BOUND_S), None, time.perf_counter() - started
    except HTTPStatusError as exc:
        return None, exc, time.perf_counter() - started


@pytest.mark.parametrize("front", ["relay", "envoy"])
def test_a_prefill_worker_that_stalls_mid_handoff_is_recovered_in_time(
    fleet: Fleet, tokenizer: PromptTokenizer, front: str
) -> None:
    """P stops answering (SIGSTOP) while a stream it prefilled decodes on D: the router gives
    up on P after its timeout and recovers (D prefills it within D's jitter budget, or a 503
    names P at once); the answer is D's own, and the running stream ends whole."""
    url = _front(fleet, front)
    prefill, decode = fleet.by_role("prefill")[0], fleet.by_role("decode")[0]
    other = _Stream(url, tokenizer.text_token_ids(filler_text(200, 90)), max_tokens=300)
    assert other.first_event.wait(120) and other.error is None, f"the other stream did not start: {other.error}"
    x = tokenizer.text_token_ids(filler_text(600, 91 if front == "relay" else 92))
    before = scrape(fleet.router.url)
    os.killpg(prefill.pid, signal.SIGSTOP)
    try:
        out, refused, elapsed = _served_or_refused(url, x)
    finally:
        os.killpg(prefill.pid, signal.SIGCONT)
    assert elapsed <= RECOVERY_BOUND_S, f"{elapsed:.1f} s after P stalled"
    after = scrape(fleet.router.url)
    assert delta(after, before, "kvpilot_router_prefill_failures_total", worker="prefill-0", reason="timeout") == 1
    if out is not None:
        assert out.headers.get("X-KVPilot-Route") == "fallback", out.headers
        assert delta(after, before, RECOVERIES, action="local") == 1
        reference = complete(decode.url, x, max_tokens=6, cache_salt=uuid.uuid4().hex)
        assert out.tokens == reference.tokens and out.max_logprob_diff(reference) <= LOGPROB_TOLERANCE
    else:
        assert refused is not None and refused.status == 503, refused
        assert "prefill on prefill-0 failed (timeout)" in str(refused)
        assert delta(after, before, RECOVERIES, action="fail") == 1
    other.thread.join(300)
    assert not other.thread.is_alive() and other.error is None, other.error
    assert other.finished_whole and all("error" not in chunk for chunk in other.chunks), other.events[-3:]


def test_a_prefill_worker_killed_mid_handoff_through_envoy(
    fleet: Fleet, spec: FleetSpec, tokenizer: PromptTokenizer
) -> None:
    """P dies holding a request that Envoy's picker sent it: the picker sees P's connection
    drop and recovers at once (D prefills it), and the answer is D's own. P is started again."""
    url = _front(fleet, "envoy")
    prefill, decode = fleet.by_role("prefill")[0], fleet.by_role("decode")[0]
    x = tokenizer.text_token_ids(filler_text(600, 93))
    answers: list[Completion | HTTPStatusError] = []

    def ask() -> None:
        out, refused, _ = _served_or_refused(url, x)
        answers.append(out if out is not None else refused)  # type: ignore[arg-type]

    before = scrape(fleet.router.url)
    os.killpg(prefill.pid, signal.SIGSTOP)  # P takes the request and never answers...
    try:
        client = threading.Thread(target=ask)
        client.start()
        time.sleep(1.0)  # the request's bytes are in P's socket
    finally:
        os.killpg(prefill.pid, signal.SIGKILL)  # ...then dies mid-prefill
    client.join(RECOVERY_BOUND_S)
    assert not client.is_alive(), f"no answer {RECOVERY_BOUND_S} s after P died"
    (out,) = answers
    assert isinstance(out, Completion), out
    assert out.headers.get("X-KVPilot-Route") == "fallback", out.headers
    reference = complete(decode.url, x, max_tokens=6, cache_salt=uuid.uuid4().hex)
    assert out.tokens == reference.tokens and out.max_logprob_diff(reference) <= LOGPROB_TOLERANCE
    after = scrape(fleet.router.url)
    assert delta(after, before, "kvpilot_router_prefill_failures_total", worker="prefill-0", reason="connection") == 1
    fleet_io.restart_engine(spec, "prefill-0")


def test_a_decode_worker_killed_mid_stream_through_envoy(
    fleet: Fleet, spec: FleetSpec, tokenizer: PromptTokenizer
) -> None:
    """D dies in the middle of a stream Envoy carries: the client's stream ends (reset) within
    the bound, and the picker counts it against D from Envoy's response flags (the stream's
    status stayed 200). D is started again and serves the next request."""
    url = _front(fleet, "envoy")
    decode = fleet.by_role("decode")[0]
    stream = _Stream(url, tokenizer.text_token_ids(filler_text(300, 94)), max_tokens=4000)
    assert stream.first_event.wait(120) and stream.error is None, "no streamed token before D was killed"
    before = scrape(fleet.router.url)
    os.killpg(decode.pid, signal.SIGKILL)
    stream.thread.join(STREAM_END_BOUND_S)
    assert not stream.thread.is_alive(), f"the client's stream hung over {STREAM_END_BOUND_S} s after D died"
    assert "[DONE]" not in stream.events and not stream.finished_whole
    deadline = time.monotonic() + 10.0  # Envoy's access-log entry reaches the picker within its flush
    while time.monotonic() < deadline:
        counted = delta(scrape(fleet.router.url), before, "kvpilot_router_upstream_errors_total", worker="decode-0")
        if counted:
            break
        time.sleep(0.2)
    assert counted == 1
    restarted = fleet_io.restart_engine(spec, "decode-0")
    out = complete(_front(restarted, "envoy"), tokenizer.text_token_ids(filler_text(100, 95)), max_tokens=4)
    assert len(out.tokens) == 4


ROLES = {"p-to-d": ("prefill", "decode"), "d-to-p": ("decode", "prefill")}
"""A read's direction -> (the holder's role, the reader's role). D->P is the router's role
reversal: D prefills the session's prefix for P (``do_remote_decode``), P reads it."""


def _handoff(
    fleet: Fleet, x: list[int], request_id: str, direction: str, max_tokens: int = 6
) -> tuple[Completion, float]:
    """The holder prefills ``x`` for the reader, the reader reads the holder's KV under
    ``request_id`` and answers ``max_tokens`` tokens: the answer, and how long the reader took."""
    holder, reader = (fleet.by_role(role)[0].url for role in ROLES[direction])
    params = complete(holder, x, max_tokens=1, kv_transfer_params=handoff_request()).kv_transfer_params
    assert params is not None and params["kvpilot"]["kv_digests"], "the holder's offer carries no KV digests"
    started = time.perf_counter()
    out = complete(
        reader, x, max_tokens=max_tokens, kv_transfer_params=params, request_id=request_id, timeout=READ_BOUND_S
    )
    return out, time.perf_counter() - started


def _reader(fleet: Fleet, direction: str) -> str:
    return fleet.by_role(ROLES[direction][1])[0].url


def _colocated(reader: str, x: list[int]) -> Completion:
    """The reader's own answer to ``x`` with a fresh cache salt: the oracle."""
    return complete(reader, x, max_tokens=6, cache_salt=uuid.uuid4().hex)


@pytest.mark.parametrize("direction", list(ROLES))
def test_a_clean_handoff_is_checked_byte_for_byte(fleet: Fleet, tokenizer: PromptTokenizer, direction: str) -> None:
    reader = _reader(fleet, direction)
    seed = 96 if direction == "p-to-d" else 106
    _handoff(fleet, tokenizer.text_token_ids(filler_text(100, seed + 9)), f"fm-warm-{uuid.uuid4().hex}", direction)
    x = tokenizer.text_token_ids(filler_text(600, seed))
    before = scrape(reader)
    out, _ = _handoff(fleet, x, f"fm-clean-{uuid.uuid4().hex}", direction)
    reference = _colocated(reader, x)
    assert out.tokens == reference.tokens and out.max_logprob_diff(reference) <= LOGPROB_TOLERANCE
    checked = "vllm:kvpilot_digest_checked_blocks_total"
    after = wait_for_metric(reader, checked, lambda n: n > total(before, checked))
    assert delta(after, before, checked) >= 1
    assert delta(after, before, "vllm:kvpilot_digest_mismatch_blocks_total") == 0
    assert delta(after, before, "vllm:kvpilot_abandoned_reads_total") == 0


@pytest.mark.parametrize("direction", list(ROLES))
@pytest.mark.parametrize(
    ("fault", "counter"),
    [
        ("fm-corrupt", "vllm:kvpilot_digest_mismatch_blocks_total"),
        ("fm-reused", "vllm:kvpilot_digest_mismatch_blocks_total"),
        ("fm-stall", "vllm:kvpilot_abandoned_reads_total"),
        ("fm-drop", "vllm:kvpilot_abandoned_reads_total"),
    ],
)
def test_a_faulty_read_is_never_attached_and_the_answer_is_the_colocated_one(
    fleet: Fleet, tokenizer: PromptTokenizer, fault: str, counter: str, direction: str
) -> None:
    """The reader's read of the holder's KV is corrupted, brings a reused block's bytes, is
    stalled or its completion lost: the reader recomputes what the read would have brought,
    within the bound, and answers as it does co-located."""
    reader = _reader(fleet, direction)
    seed = 97 + list(FAULTS).index(fault) + (0 if direction == "p-to-d" else 10)
    x = tokenizer.text_token_ids(filler_text(600, seed))
    time.sleep(PEER_RETRY_AFTER_S)  # an earlier row's failed read no longer skips the holder
    before = scrape(reader)
    out, elapsed = _handoff(fleet, x, f"{fault}-{uuid.uuid4().hex}", direction)
    assert elapsed <= READ_BOUND_S, f"the reader answered {elapsed:.1f} s after its read began"
    reference = _colocated(reader, x)
    assert out.tokens == reference.tokens and out.max_logprob_diff(reference) <= LOGPROB_TOLERANCE
    after = wait_for_metric(reader, counter, lambda n: n > total(before, counter))
    assert delta(after, before, counter) >= 1
    kind = FAULTS[fault]
    assert delta(after, before, "vllm:kvpilot_faults_injected_total", kind=kind) == 1
    reason = "digest_mismatch" if fault in ("fm-corrupt", "fm-reused") else "deadline"
    assert delta(after, before, "vllm:kvpilot_integrity_failed_blocks_total", reason=reason) >= 1


DIGEST_SHARE_BOUND = 0.01
"""The KV digest's cost, both sides together, as a share of the handoffs' time to first token."""


def test_the_digest_costs_under_one_percent_of_the_handoffs_ttft(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """Ten clean handoffs: the worker time both engines spent digesting (the holder its
    offered blocks, the reader what landed) against the time from P's prefill request to D's
    answer of one token (the handoff's time to first token), summed. The share is printed (``-s``)."""
    engines = [fleet.by_role(role)[0].url for role in ("prefill", "decode")]
    digest = "vllm:kvpilot_digest_seconds_total"
    before = [scrape(url) for url in engines]
    ttft = 0.0
    for seed in range(10):
        x = tokenizer.text_token_ids(filler_text(1500, 300 + seed))
        started = time.perf_counter()
        _handoff(fleet, x, f"fm-cost-{uuid.uuid4().hex}", "p-to-d", max_tokens=1)
        ttft += time.perf_counter() - started
    after = [
        wait_for_metric(url, digest, lambda n, b=b: n > total(b, digest))
        for url, b in zip(engines, before, strict=True)
    ]
    spent = sum(delta(a, b, digest) for a, b in zip(after, before, strict=True))
    print(f"digest {spent * 1e3:.1f} ms of {ttft * 1e3:.0f} ms TTFT over 10 handoffs: {spent / ttft:.3%}")
    assert 0 < spent < DIGEST_SHARE_BOUND * ttft
