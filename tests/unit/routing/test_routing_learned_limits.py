"""The engines' max_model_len learned at start (kvpilot.routing.serve.learned_limits): settled
against the config, engines that disagree refused by name, and no start with length checks
off unless the config allows it; against the shared fake engine's ``/v1/models``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvpilot.routing.config import Role, RouterConfig, ServerConfig, Worker
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.serve.app import build_server
from kvpilot.routing.serve.learned_limits import EngineLimitsError, settled_max_model_len, stated_max_model_len
from tests.fakes.engine import FakeEngine

A, B = "http://a:1", "http://b:1"


@pytest.mark.parametrize(
    ("configured", "stated", "allow", "expected"),
    [
        (0, {A: 4096, B: 4096}, False, 4096),
        (4096, {A: 4096, B: None}, False, 4096),  # an engine that states nothing does not count
        (2048, {A: None}, False, 2048),  # nothing stated: the config's
        (0, {A: None}, True, 0),  # length checks off, as allowed
    ],
)
def test_the_length_is_the_engines_or_the_config_s_where_they_agree(configured, stated, allow, expected) -> None:
    assert settled_max_model_len(configured, stated, allow_unchecked=allow) == expected


@pytest.mark.parametrize(
    ("configured", "stated", "message"),
    [
        (0, {A: 4096, B: 2048}, "the engines disagree on max_model_len (http://a:1: 4096, http://b:1: 2048)"),
        (8192, {A: 4096}, "is 8192, but the engines state 4096 (http://a:1)"),
        (0, {A: None, B: None}, "server.allow_unchecked_lengths: true"),
        (0, {}, "no engines"),
    ],
)
def test_a_length_that_cannot_be_settled_is_refused_by_name(configured, stated, message) -> None:
    with pytest.raises(EngineLimitsError, match=r"server\.max_model_len") as caught:
        settled_max_model_len(configured, stated, allow_unchecked=False)
    assert message in str(caught.value)


def test_the_served_model_s_card_is_read() -> None:
    listing = {"data": [{"id": "other", "max_model_len": 8}, {"id": "tiny", "max_model_len": 4096}]}
    assert stated_max_model_len(listing, "tiny") == 4096
    assert stated_max_model_len(listing, "absent") is None
    assert stated_max_model_len({"data": [{"id": "tiny", "max_model_len": None}]}, "tiny") is None
    assert stated_max_model_len(["not", "a", "listing"], "tiny") is None


def _start(model_dir: Path, engines: list[FakeEngine], **server: Any) -> tuple[int, int, str]:
    """Start the router in front of ``engines``: its learned max_model_len, and the status and
    message of a completion one token over it (0 and '' when the start was refused, which
    raises)."""

    async def main() -> tuple[int, int, str]:
        fronts = [TestServer(e.app(), host="127.0.0.1") for e in engines]
        for front in fronts:
            await front.start_server()
        workers = tuple(
            Worker(name=f"w{i}", role=Role.DECODE, url=str(f.make_url("/")).rstrip("/")) for i, f in enumerate(fronts)
        )
        cfg = RouterConfig(server=ServerConfig(model_dir=str(model_dir), **server), workers=workers)
        router = build_server(cfg, fleet_from_config(cfg), feed_index=False)
        try:
            async with TestClient(TestServer(router.app(), host="127.0.0.1")) as client:
                length = router.core.intake.limits.max_model_len
                over = list(range(10, 10 + max(length, 1) + 1))
                resp = await client.post("/v1/completions", json={"prompt": over, "max_tokens": 1})
                return length, resp.status, (await resp.json())["error"]["message"] if resp.status != 200 else ""
        finally:
            for front in fronts:
                await front.close()

    return asyncio.run(main())


def test_the_router_checks_lengths_against_what_the_engines_state(model_dir: Path) -> None:
    length, status, message = _start(
        model_dir, [FakeEngine("d0", max_model_len=64), FakeEngine("d1", max_model_len=64)]
    )
    assert length == 64
    assert status == 400 and "maximum context length is 64 tokens" in message, message


def test_engines_that_disagree_keep_the_router_from_starting(model_dir: Path) -> None:
    with pytest.raises(
        EngineLimitsError,
        match=r"disagree on max_model_len \(http://127.0.0.1:\d+: (64|128), http://127.0.0.1:\d+: (128|64)\)",
    ):
        _start(model_dir, [FakeEngine("d0", max_model_len=64), FakeEngine("d1", max_model_len=128)])


def test_no_length_anywhere_keeps_the_router_from_starting_unless_allowed(model_dir: Path) -> None:
    silent = FakeEngine("d0", max_model_len=None)
    with pytest.raises(EngineLimitsError, match="unknown: no engine stated it"):
        _start(model_dir, [silent])
    length, status, _ = _start(model_dir, [silent], allow_unchecked_lengths=True)
    assert (length, status) == (0, 200)  # the engine gets it: the router checked no length


def test_a_config_that_contradicts_the_engines_keeps_the_router_from_starting(model_dir: Path) -> None:
    with pytest.raises(EngineLimitsError, match="is 128, but the engines state 64"):
        _start(model_dir, [FakeEngine("d0", max_model_len=64)], max_model_len=128)
