"""The router's state across a restart and between replicas, on real engines: a
router killed (SIGKILL) mid-session and restarted rebuilds its index from the engines'
replay buffers and takes the session's placement, affinity and D's offer from Redis,
so the session's next step is priced and served as it would have been; without the
store the index still comes back but the session is forgotten. Two replicas over one
fleet, a session alternating between them, are served as one router serves it.

One fleet (1 P + 1 D, vLLM's bidirectional mode so that D offers the session's KV,
KV events on ipc sockets the engines bind so that any number of routers subscribe)
and one ``redis-server`` on 127.0.0.1 (no persistence) for the module."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpilot.deploy.client import Completion, complete, debug_route, wait_for_overlap
from kvpilot.deploy.fleet import Fleet, restart_router, stop_group
from kvpilot.deploy.fleet_spec import HOST, FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled, total
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet, start_router
from tests.e2e.scenarios import BLOCK_SIZE, PROMPT_TOKENS
from tests.e2e.sessions import FIRST_PULL_TIMEOUT_S, GENERATED, colocated_steps, history
from tests.fakes.ports import block_of
from tests.redis_server import redis_binary, running_redis

pytestmark = pytest.mark.e2e

BLOCK = block_of(__name__)
REDIS_PORT = BLOCK.spare(0)
REPLICA_PORT = BLOCK.spare(1)
DROP_IN = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}
OPTIONS = "kvpilot_router_session_options_total"
REPLAYED_BLOCKS = "kvpilot_router_kv_event_replayed_blocks_total"
RESTORED = "kvpilot_router_session_store_restored_total"
STORE_ERRORS = "kvpilot_router_session_store_errors_total"
STORE_TIMEOUTS = ("--sessions-store-read-timeout-s", "1.0", "--sessions-store-write-timeout-s", "1.0")
"""Every router here waits up to 1 s for Redis, not the default 50 ms: this module proves
what a record restores, on a 2-core box whose engines' NIXL threads spin; what a store
that does not answer costs is proven against a paused redis-server in
``tests/unit/routing/test_routing_session_store.py``."""

Steps = list[tuple[list[int], Completion]]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    redis_binary()  # skips the module, saying how to install it, when missing
    with running_redis(REDIS_PORT, tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="module")
def spec(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> FleetSpec:
    return FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("state-fleet"),
        connector_extra_config=DROP_IN,
        kv_events_ipc=True,
        session_store_url=redis_url,
        **BLOCK.fleet(),
    )


@pytest.fixture(scope="module")
def fleet(spec: FleetSpec) -> Iterator[Fleet]:
    with running_fleet(spec) as started:
        restart_router(spec, STORE_TIMEOUTS)  # the same URL
        yield started


def _decode_url(fleet: Fleet) -> str:
    return fleet.by_role("decode")[0].url


def _ask(router: str, prompt: list[int], session: str, timeout: float = 300.0) -> Completion:
    """One agent step's request: ``GENERATED`` tokens, their ids returned."""
    return complete(
        router,
        prompt,
        max_tokens=GENERATED,
        ignore_eos=True,
        return_token_ids=True,
        conversation_id=session,
        timeout=timeout,
    )


def _step(router: str, prompt: list[int], session: str, timeout: float = 300.0) -> Completion:
    """One agent step; returns once the router's index shows D holding the prompt (D's
    KV events lag on a loaded box, and a stale index would price D cold)."""
    out = _ask(router, prompt, session, timeout)
    wait_for_overlap(router, prompt, "decode-0", len(prompt) // BLOCK_SIZE, conversation_id=session)
    return out


def _next(prompt: list[int], out: Completion, tokenizer: PromptTokenizer, n: int) -> list[int]:
    """The history resent: D's tool call appended, then a new tool output."""
    return prompt + list(out.token_ids) + tokenizer.text_token_ids(f" tool: step {n} ok, {n + 3} tests pass")


def _decision(route: dict[str, Any]) -> dict[str, Any]:
    """What must not change across the restart: where the step goes, the index's view of
    each worker's prefix, and which options exist, by whom they would be prefilled."""
    return {
        "kind": route["kind"],
        "decode_worker": route["decode_worker"],
        "prefill_worker": route["prefill_worker"],
        "cached_blocks": route["cached_blocks"],
        "overlap": route["overlap"],
        "session_option": route["session_option"],
        "options": [(o["option"], o["available"], o["prefill_worker"]) for o in route["options"]],
    }


def _kill_and_restart(spec: FleetSpec, flags: Sequence[str]) -> str:
    """SIGKILL the fleet's router (no shutdown, nothing flushed) and start it again."""
    running = Fleet.load(spec.run_dir)
    assert running is not None
    os.killpg(running.router.pid, signal.SIGKILL)
    return restart_router(spec, flags).router.url


def _priced_kind(route: dict[str, Any]) -> str:
    """The route a ``/debug/route`` answer prices (its ``kind``), checked against its session
    option where it has one: ``local`` prefills on D, every other option on P."""
    option = route["session_option"]
    if option is not None:
        assert route["kind"] == ("local_prefill" if option == "local" else "remote_prefill"), route["explain"]
    return str(route["kind"])


def _two_steps(router: str, tokenizer: PromptTokenizer, seed: int, session: str) -> tuple[Steps, list[int]]:
    """A session's steps 1 and 2: step 1 on P (D holds none of it: the share guard), step 2
    where the router's prices put it, D holding step 1 and P its prompt (local and remote
    differ by P's prefill of D's generated tokens and a hop: a near-tie the box decides)."""
    x = history(tokenizer, seed)
    out1 = _step(router, x, session, timeout=FIRST_PULL_TIMEOUT_S)  # the first P->D pull pays NIXL's handshake
    x2 = _next(x, out1, tokenizer, 1)
    priced = debug_route(router, x2, conversation_id=session)
    out2 = _step(router, x2, session)
    routes = [out.headers["X-KVPilot-Route"] for out in (out1, out2)]
    assert routes == ["remote_prefill", _priced_kind(priced)], priced["explain"]
    return [(x, out1), (x2, out2)], _next(x2, out2, tokenizer, 2)


def test_a_router_killed_mid_session_serves_the_next_step_as_it_would_have(
    spec: FleetSpec, fleet: Fleet, tokenizer: PromptTokenizer
) -> None:
    """Steps 1 and 2 through the fleet's router (Redis configured), the router killed, then
    step 3 through its restart: the same decision term by term (D's cached prefix, from
    the replayed events; the session option, from the stored placement and D's offer),
    the replayed blocks counted, and the answers equal to a co-located run."""
    router = fleet.router.url  # the same URL across restarts
    session = f"restart-{uuid.uuid4().hex[:8]}"
    steps, x3 = _two_steps(router, tokenizer, 800, session)
    expected = debug_route(router, x3, conversation_id=session)
    assert expected["session_option"] is not None and expected["overlap"]["decode-0"]["GPU"] > 0
    assert total(scrape(router), STORE_ERRORS, op="write") == 0, "a step's record was not written"

    router = _kill_and_restart(spec, STORE_TIMEOUTS)
    after_restart = scrape(router)
    assert total(after_restart, REPLAYED_BLOCKS, worker="decode-0") >= expected["overlap"]["decode-0"]["GPU"]
    assert total(after_restart, STORE_ERRORS, op="connect") == 0
    restored = debug_route(router, x3, conversation_id=session)
    assert total(scrape(router), STORE_ERRORS, op="read") == 0, "the restarted router's read failed"
    assert _decision(restored) == _decision(expected)
    assert total(scrape(router), RESTORED) == 1

    before, d_before = scrape(router), scrape(_decode_url(fleet))
    out3 = complete(router, x3, max_tokens=8, ignore_eos=True, conversation_id=session)
    assert out3.headers["X-KVPilot-Route"] == _priced_kind(expected)
    assert delta(scrape(router), before, OPTIONS, option=expected["session_option"]) == 1
    kept = delta(settled(_decode_url(fleet), d_before), d_before, PROMPT_TOKENS, source="local_cache_hit")
    assert kept == expected["overlap"]["decode-0"]["GPU"] * BLOCK_SIZE  # step 3 kept its KV on D across the restart
    steps.append((x3, out3))
    for n, ((_, out), ref) in enumerate(zip(steps, colocated_steps(_decode_url(fleet), steps), strict=True), 1):
        assert out.same_output(ref), f"step {n}: max logprob diff {out.max_logprob_diff(ref)}"


def test_without_the_store_the_restarted_router_has_the_index_but_not_the_session(
    spec: FleetSpec, fleet: Fleet, tokenizer: PromptTokenizer
) -> None:
    """The control: the same, the router in memory only. After the restart the index is
    rebuilt as before (D's cached prefix is credited) but the session is gone: step 3 is
    priced as a new request (no session option, no affinity credit) by the local-vs-remote
    policy alone."""
    router = restart_router(spec, ["--sessions-store", "memory", *STORE_TIMEOUTS]).router.url
    session = f"no-store-{uuid.uuid4().hex[:8]}"
    steps, x3 = _two_steps(router, tokenizer, 900, session)
    expected = debug_route(router, x3, conversation_id=session)
    assert expected["session_option"] is not None

    router = _kill_and_restart(spec, ["--sessions-store", "memory", *STORE_TIMEOUTS])
    forgotten = debug_route(router, x3, conversation_id=session)
    assert forgotten["overlap"] == expected["overlap"] and forgotten["cached_blocks"] == expected["cached_blocks"]
    assert (forgotten["session_option"], forgotten["options"]) == (None, [])
    before, d_before = scrape(router), scrape(_decode_url(fleet))
    out3 = complete(router, x3, max_tokens=8, ignore_eos=True, conversation_id=session)
    assert out3.headers["X-KVPilot-Route"] == _priced_kind(forgotten)  # the local-vs-remote policy alone
    assert sum(delta(scrape(router), before, OPTIONS, option=o) for o in ("local", "reprefill", "affinity")) == 0
    kept = delta(settled(_decode_url(fleet), d_before), d_before, PROMPT_TOKENS, source="local_cache_hit")
    assert kept == forgotten["overlap"]["decode-0"]["GPU"] * BLOCK_SIZE
    steps.append((x3, out3))
    for n, ((_, out), ref) in enumerate(zip(steps, colocated_steps(_decode_url(fleet), steps), strict=True), 1):
        assert out.same_output(ref), f"step {n}: max logprob diff {out.max_logprob_diff(ref)}"
    restart_router(spec, STORE_TIMEOUTS)  # back to Redis for the next test


def test_a_session_alternating_between_two_replicas_is_served_as_one_router_serves_it(
    spec: FleetSpec, fleet: Fleet, tokenizer: PromptTokenizer
) -> None:
    """Two routers over the fleet, both reading every engine's KV events and sharing the
    session through Redis; the client sends step 1 to A, 2 to B, 3 to A, 4 to B. Every
    later step gets the session option the by-cost single router gives such a step
    (``local``: D holds the whole history), each replica's index credits D's prefix,
    and the answers equal a co-located run. Then B is SIGKILLed (a replica lost) and
    step 5 goes to A, which serves it as B would have: from the record B wrote."""
    a = fleet.router.url
    replica = start_router(spec, "router-b", REPLICA_PORT, STORE_TIMEOUTS)
    try:
        b = f"http://{HOST}:{REPLICA_PORT}"
        session = f"replicas-{uuid.uuid4().hex[:8]}"
        before = {url: scrape(url) for url in (a, b)}
        prompt = history(tokenizer, 1000)
        steps: Steps = []
        for n, router in enumerate((a, b, a, b)):
            if steps:  # this replica's own index shows D holding the last step's prompt
                wait_for_overlap(router, prompt, "decode-0", len(steps[-1][0]) // BLOCK_SIZE)
            out = _ask(router, prompt, session, FIRST_PULL_TIMEOUT_S)
            steps.append((prompt, out))
            prompt = _next(prompt, out, tokenizer, n)
        routes = [out.headers["X-KVPilot-Route"] for _, out in steps]
        assert routes == ["remote_prefill", "local_prefill", "local_prefill", "local_prefill"]
        after = {url: scrape(url) for url in (a, b)}
        assert delta(after[a], before[a], OPTIONS, option="local") == 1  # step 3
        assert delta(after[b], before[b], OPTIONS, option="local") == 2  # steps 2 and 4
        assert delta(after[b], before[b], RESTORED) == 2 and delta(after[a], before[a], RESTORED) == 1

        os.killpg(replica.pid, signal.SIGKILL)  # replica B lost; its clients fail over to A
        wait_for_overlap(a, prompt, "decode-0", len(steps[-1][0]) // BLOCK_SIZE)
        out5 = complete(a, prompt, max_tokens=8, ignore_eos=True, conversation_id=session)
        assert out5.headers["X-KVPilot-Route"] == "local_prefill"
        lost = scrape(a)
        assert delta(lost, after[a], OPTIONS, option="local") == 1 and delta(lost, after[a], RESTORED) == 1
        steps.append((prompt, out5))
        for n, ((_, out), ref) in enumerate(zip(steps, colocated_steps(_decode_url(fleet), steps), strict=True), 1):
            assert out.same_output(ref), f"step {n}: max logprob diff {out.max_logprob_diff(ref)}"
    finally:
        stop_group(replica.pid)
