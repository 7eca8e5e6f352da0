"""A session's holder dies (article section 8.6; issue 9, leases and failures): D
held the session's newest KV and is gone when the next turn reaches P. P's pull
fails, vLLM's ``kv_load_failure_policy: recompute`` (set by the fleet) prefills
what it was to load, and P answers exactly as a co-located run would; the next
offer from the dead D is prefilled without another try. Both counted. D dies in
the middle of a stream the router relays: the client gets an error event naming D
and the stream ends (no hang). P dies holding a request: D prefills it, correctly.
P dies after returning its params, before D pulls: D recomputes, correctly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.agent_session import decoded_turn, prefill_next_turn
from kvpilot.deploy.client import Completion, complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled, total, wait_for_metric
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.kvconnectors.vllm_metrics import KVPILOT_LOAD_FAILURES
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.scenarios import PROMPT_TOKENS, RECOMPUTED, REJECTED
from tests.e2e.sessions import GENERATED, block_count, colocated, history
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()
LOAD_FAILURES = KVPILOT_LOAD_FAILURES.total


@pytest.fixture(scope="module")
def spec(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FleetSpec:
    return FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("dead-holder-fleet"),
        disaggregation="always",
        # P remembers the dead D long enough for the second turn on a slow box (a P
        # holding a lease has been seen to take 30 s before it schedules the next turn)
        connector_extra_config={"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0, "peer_retry_after_s": 300},
        **PORTS,
    )


@pytest.fixture(scope="module")
def fleet(spec: FleetSpec) -> Iterator[Fleet]:
    with running_fleet(spec) as started:
        yield started


def test_a_dead_holder_is_recomputed_with_correct_output(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    prefill, decode = fleet.by_role("prefill")[0], fleet.by_role("decode")[0]
    sessions = [history(tokenizer, seed) for seed in (700, 701)]
    turns = [decoded_turn(prefill.url, decode.url, x, GENERATED) for x in sessions]
    stream = _relayed_stream(fleet.router.url, sessions[0])
    assert stream.first_event.wait(300), "no streamed token before D was killed"
    router_before = scrape(fleet.router.url)
    os.killpg(decode.pid, signal.SIGKILL)  # D and its NIXL agent vanish with the session's KV
    stream.thread.join(STREAM_END_BOUND_S)
    assert not stream.thread.is_alive(), f"the client's stream hung over {STREAM_END_BOUND_S} s after D died"
    last = json.loads(stream.events[-1])
    assert "[DONE]" not in stream.events and "decode-0" in last["error"]["message"], stream.events[-3:]
    assert (
        delta(scrape(fleet.router.url), router_before, "kvpilot_router_upstream_errors_total", worker="decode-0") == 1
    )

    # Both next turns first, back to back: the second must reach P while it remembers
    # the dead peer (peer_retry_after_s); the co-located references come after.
    served = []
    for turn in turns:
        x, x2 = turn.prompt, turn.prompt + turn.generated + tokenizer.text_token_ids(" tool: ok")
        before = scrape(prefill.url)
        out = prefill_next_turn(prefill.url, x2, turn.d_params, timeout=120)
        served.append((x, x2, out, before, settled(prefill.url, before)))
    for (x, x2, out, before, after), reason in zip(served, ("load_failed", "peer_failed"), strict=True):
        # P keeps its own blocks of x from turn 1 and prefills the rest, as a
        # co-located engine that computed x first would.
        reference = colocated(prefill.url, x, x2, reused_blocks=block_count(len(x)))
        assert out.logprobs[0] == reference.logprobs[0], f"{reason}: P's first token differs from co-located"
        assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == 0
        offered_beyond_hit = len(x) + GENERATED - 1 - block_count(len(x)) * 32
        if reason == "load_failed":  # the pull was tried, failed, and was prefilled here
            assert delta(after, before, LOAD_FAILURES, action="recompute") == 1
            loaded = (block_count(len(x) + GENERATED - 1) - block_count(len(x))) * 32
            assert delta(after, before, RECOMPUTED, reason="load_failed") == loaded
        else:  # the same dead peer's next offer is not tried at all
            assert delta(after, before, LOAD_FAILURES, action="recompute") == 0
            assert delta(after, before, RECOMPUTED, reason="peer_failed") == offered_beyond_hit
            assert delta(after, before, REJECTED, reason="peer_failed") == (
                block_count(len(x) + GENERATED - 1) - block_count(len(x))
            )
    assert scrape(prefill.url), "P keeps serving"


def test_p_killed_mid_prefill_is_served_by_d_with_correct_output(
    fleet: Fleet, spec: FleetSpec, tokenizer: PromptTokenizer
) -> None:
    """P dies holding a request: the router sees P's connection drop, D prefills the
    prompt itself, and the answer equals a co-located run's. Runs after the test
    above killed D, so D is started again first."""
    restarted = fleet_io.restart_engine(spec, "decode-0")
    prefill, decode = restarted.by_role("prefill")[0], restarted.by_role("decode")[0]
    x = tokenizer.text_token_ids(filler_text(600, 41))
    router_before = scrape(fleet.router.url)
    answers: list[Completion] = []
    os.killpg(prefill.pid, signal.SIGSTOP)  # P accepts the request and never answers...
    try:
        client = threading.Thread(target=lambda: answers.append(complete(fleet.router.url, x, max_tokens=6)))
        client.start()
        samples = wait_for_metric(
            fleet.router.url, "kvpilot_router_active_prefill_blocks", lambda v: v > 0, timeout=60, worker="prefill-0"
        )
        assert total(samples, "kvpilot_router_active_prefill_blocks", worker="prefill-0") > 0, "never sent to P"
        time.sleep(1.0)  # the request's bytes are in P's socket
    finally:
        os.killpg(prefill.pid, signal.SIGKILL)  # ...then dies mid-prefill
    client.join(P_DEATH_BOUND_S)
    assert not client.is_alive(), f"no answer {P_DEATH_BOUND_S} s after P died"
    assert answers, "the client got an error, not D's answer"
    out = answers[0]
    assert out.headers.get("X-KVPilot-Route") == "fallback", out.headers
    reference = complete(decode.url, x, max_tokens=6, cache_salt=uuid.uuid4().hex)
    assert out.same_output(reference), f"max logprob diff {out.max_logprob_diff(reference)}"
    after = scrape(fleet.router.url)
    assert delta(after, router_before, "kvpilot_router_prefill_failures_total", worker="prefill-0") == 1
    assert total(after, "kvpilot_router_prefill_failures_total", worker="prefill-0", reason="connection") >= 1


def test_p_killed_after_returning_params_is_recomputed_on_d(
    fleet: Fleet, spec: FleetSpec, tokenizer: PromptTokenizer
) -> None:
    """P answers the prefill with its params and dies before D pulls: D's pull fails,
    vLLM's ``kv_load_failure_policy: recompute`` prefills those tokens on D, and the
    answer equals a co-located run's. Runs after the test above killed P, so P is
    started again first."""
    restarted = fleet_io.restart_engine(spec, "prefill-0")
    prefill, decode = restarted.by_role("prefill")[0], restarted.by_role("decode")[0]
    x = tokenizer.text_token_ids(filler_text(600, 43))
    params = complete(prefill.url, x, max_tokens=1, kv_transfer_params=handoff_request()).kv_transfer_params
    assert params and params.get("do_remote_prefill"), params
    os.killpg(prefill.pid, signal.SIGKILL)
    before = scrape(decode.url)
    out = complete(decode.url, x, max_tokens=6, kv_transfer_params=params, timeout=P_DEATH_BOUND_S)
    after = settled(decode.url, before)
    reference = complete(decode.url, x, max_tokens=6, cache_salt=uuid.uuid4().hex)
    # as for the dead D above: the first token's logprob, and the same tokens
    assert out.logprobs[0] == reference.logprobs[0] and out.tokens == reference.tokens
    assert delta(after, before, LOAD_FAILURES, action="recompute") == 1
    assert delta(after, before, RECOMPUTED, reason="load_failed") > 0
    assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == 0


P_DEATH_BOUND_S = 120.0
"""How long a request may take once its P died (D's whole prefill, on a loaded box)."""

STREAM_END_BOUND_S = 60.0
"""How long a relayed stream may last after its D died."""


class _Stream:
    """A streaming completion through the router, read in a thread."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.first_event = threading.Event()
        self.thread = threading.Thread(target=lambda: None)


def _relayed_stream(router_url: str, prompt: list[int]) -> _Stream:
    """Start a long stream (P prefills, D decodes 4,000 tokens) and return at once."""
    stream = _Stream()
    body = {"prompt": prompt, "max_tokens": 4000, "ignore_eos": True, "stream": True, "temperature": 0.0}
    request = urllib.request.Request(
        f"{router_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )

    def read() -> None:
        with urllib.request.urlopen(request, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    stream.events.append(line[5:].strip())
                    stream.first_event.set()

    stream.thread = threading.Thread(target=read, daemon=True)
    stream.thread.start()
    return stream
