"""A session's next chat rendered in time proportional to the messages it appends.

An agent's step re-sends its whole conversation with new messages at the end. Where the
model's chat template is a head, one loop that renders each message alone, and a tail
(:mod:`kvpilot.routing.serve.template_loop`), :class:`IncrementalChat` keeps, per session,
the last chat's messages and variables and its text up to the end of the loop; a next chat
of the same session with the same variables whose messages start with all of those (and
add at least one) renders as that text, the new messages through the loop alone, and the
tail. The text is always exactly the whole render's (the module above says when the split
holds); any other chat (a first step, an edited or shortened history, other variables, a
template of another form) is rendered whole.

Bounded (:class:`~kvpilot.routing.serve.session_cache.SessionCache`): least recently used
sessions are dropped past ``max_sessions`` or past ``max_chars`` characters of kept text in
all (the messages kept beside a text are about as long). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.session_cache import SessionCache

MAX_SESSIONS = 4096
"""Sessions whose last chat is kept, by default."""
MAX_CHARS = 1 << 24
"""Characters of rendered text kept in all, by default."""


@dataclass(frozen=True, slots=True)
class _Chat:
    """A session's last chat: the request's messages (as sent), its variables, and its text
    up to the end of the template's message loop (never mutated once kept)."""

    messages: list[Any]
    variables: dict[str, Any]
    looped: str


@dataclass(frozen=True, slots=True)
class ChatStats:
    """What :meth:`IncrementalChat.render` did since the start."""

    chats: int
    """Chats rendered for a session."""
    appended: int
    """Of those, the ones rendered from the session's last chat."""
    reused_messages: int
    """Messages whose text was taken from the session's last chat rather than rendered."""


class IncrementalChat:
    """Per session, the last chat's text, and the next chat rendered from it (module doc)."""

    def __init__(self, template: ChatTemplate, *, max_sessions: int = MAX_SESSIONS, max_chars: int = MAX_CHARS) -> None:
        self.template = template
        self._chats: SessionCache[_Chat] = SessionCache(max_sessions=max_sessions, max_weight=max_chars)
        self._lock = threading.Lock()
        self._stats = ChatStats(0, 0, 0)

    def render(self, session: str, body: Mapping[str, Any]) -> str:
        """The prompt text of the chat request ``body``, equal to ``template.render(body)``;
        kept as ``session``'s last chat where the template's form allows. Raises
        :class:`~kvpilot.routing.serve.chat.ChatError` naming the bad field."""
        template = self.template
        raw = body.get("messages")
        if template.message_loop is None or not isinstance(raw, list):
            return template.render(body)  # the whole render names a bad field
        variables = template.variables(body)
        last = self._chats.get(session)
        kept = 0 if last is None else len(last.messages)
        if (
            last is not None
            and template.message_loop.min_messages <= kept < len(raw)
            and last.variables == variables
            and raw[:kept] == last.messages
        ):
            messages = template.conversation(raw, start=kept)
            looped = last.looped + template.turns(messages, variables)
            text = looped + template.tail(variables)
        else:
            kept = 0
            messages = template.conversation(raw)
            text = template.whole(messages, variables)
            tail = template.tail(variables)
            if not text.endswith(tail):  # the split does not hold here: nothing is kept
                return template.finished(text, messages[-1], variables)
            looped = text[: len(text) - len(tail)]
        self._keep(session, _Chat(list(raw), variables, looped), kept)
        return template.finished(text, messages[-1], variables)

    def _keep(self, session: str, chat: _Chat, reused: int) -> None:
        with self._lock:
            s = self._stats
            self._stats = ChatStats(s.chats + 1, s.appended + (reused > 0), s.reused_messages + reused)
        self._chats.keep(session, chat, len(chat.looped))

    @property
    def stats(self) -> ChatStats:
        """What :meth:`render` did since the start."""
        return self._stats

    @property
    def held(self) -> tuple[int, int]:
        """The sessions kept and the characters of text they hold."""
        return self._chats.held
