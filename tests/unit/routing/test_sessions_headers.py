"""The session key read from the headers that agents and Dynamo's clients send, and the
precedence of kvpilot's own names over them (routing/decide/sessions.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpilot.routing.decide.sessions import SESSION_HEADERS, InvalidSessionKey, session_key
from kvpilot.routing.ids import SessionId

AGENT_HEADERS = [
    ("X-Session-ID", "kvpilot's own, and OpenCode's"),
    ("X-Dynamo-Session-ID", "NVIDIA Dynamo"),
    ("X-Claude-Code-Session-Id", "Claude Code"),
    ("session_id", "OpenAI Codex CLI"),
    ("x-session-affinity", "OpenCode"),
    ("x-opencode-session", "OpenCode, to its own providers"),
]


@pytest.mark.parametrize(("header", "sender"), AGENT_HEADERS)
def test_each_header_names_the_session_in_any_case(header: str, sender: str) -> None:
    for spelled in (header, header.lower(), header.upper()):
        assert session_key({}, {spelled: "s-1", "User-Agent": sender}) == "s-1"


def test_every_header_is_listed_in_precedence_order() -> None:
    assert [h.lower() for h, _ in AGENT_HEADERS] == list(SESSION_HEADERS)


@pytest.mark.parametrize("winner", range(len(AGENT_HEADERS)))
def test_the_earliest_header_wins_over_every_later_one(winner: int) -> None:
    sent = {name: f"from-{i}" for i, (name, _) in reversed(list(enumerate(AGENT_HEADERS))) if i >= winner}
    assert list(sent)[-1] == AGENT_HEADERS[winner][0]  # sent last, still first by precedence
    assert session_key({}, sent) == f"from-{winner}"


def test_the_body_s_fields_come_before_any_header() -> None:
    every = {name: "header" for name, _ in AGENT_HEADERS}
    assert session_key({"conversation_id": "c", "prompt_cache_key": "p"}, every) == "c"
    assert session_key({"prompt_cache_key": "p"}, every) == "p"
    assert session_key({"conversation_id": None}, {"X-Dynamo-Session-ID": "d"}) == "d"


def test_no_session_header_is_no_session() -> None:
    assert session_key({}, {"X-Request-Id": "r", "x-session": "not ours", "session-idx": "no"}) is None


@pytest.mark.parametrize("bad", ["", "x" * 257])
@pytest.mark.parametrize(("header", "sender"), AGENT_HEADERS)
def test_a_bad_key_is_refused_naming_the_header_even_beside_a_good_later_one(
    header: str, sender: str, bad: str
) -> None:
    later = {"x-opencode-session": "fine"} if header.lower() != "x-opencode-session" else {}
    with pytest.raises(InvalidSessionKey, match=f"^{header.lower()} must be a non-empty string"):
        session_key({}, {header: bad, **later})


def test_of_one_header_sent_twice_the_first_counts() -> None:
    class Twice:
        def items(self) -> list[tuple[str, str]]:
            return [("X-Dynamo-Session-ID", "first"), ("x-dynamo-session-id", "second")]

    assert session_key({}, Twice()) == "first"  # type: ignore[arg-type]


def test_each_header_sent_by_the_openai_sdk_names_a_session_at_the_router(model_dir: Path) -> None:
    """Parity: what the OpenAI Python SDK sends (its own header casing and framing) through the
    router's HTTP front keeps a session under each header's key."""
    openai = pytest.importorskip("openai")
    from tests.unit.routing.test_routing_server import PD, PROMPT, run

    async def scenario(client: Any, router: Any, engines: Any) -> None:
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
        sessions = router.core.router.sessions
        for i, (header, _) in enumerate(AGENT_HEADERS):
            key = SessionId(f"agent-{i}")
            await sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_headers={header: key})
            assert key in sessions, header
        before = len(sessions)
        await sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
        assert len(sessions) == before  # no header: no session
        await sdk.close()

    run(model_dir, PD, scenario)
