"""Per session, the last value a cache kept for it, bounded in sessions and in weight.

:class:`SessionCache` is the store behind what the router keeps of a session's last prompt
(:mod:`kvpilot.routing.serve.incremental_tokens`, :mod:`kvpilot.routing.serve.incremental_chat`):
the least recently used sessions are dropped past ``max_sessions`` or past ``max_weight``
in all, and a value heavier than ``max_weight`` is not kept. Thread-safe: one lock guards the
entries, held only to read or replace one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class SessionCache(Generic[T]):
    """The last value kept per session key, least recently used dropped first (module doc)."""

    def __init__(self, *, max_sessions: int, max_weight: int) -> None:
        if max_sessions < 0 or max_weight < 0:
            raise ValueError("max_sessions and max_weight must be at least 0")
        self.max_sessions = max_sessions
        self.max_weight = max_weight
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._held = 0

    def get(self, session: str) -> T | None:
        """``session``'s last kept value, or None."""
        with self._lock:
            entry = self._entries.get(session)
        return None if entry is None else entry[0]

    def keep(self, session: str, value: T, weight: int) -> None:
        """Keep ``value`` (of ``weight``) as ``session``'s last, replacing what it had; the
        least recently used sessions are dropped past the bounds."""
        with self._lock:
            if (dropped := self._entries.pop(session, None)) is not None:
                self._held -= dropped[1]
            if weight > self.max_weight or not self.max_sessions:
                return
            self._entries[session] = (value, weight)
            self._held += weight
            while len(self._entries) > self.max_sessions or self._held > self.max_weight:
                _, (_, w) = self._entries.popitem(last=False)
                self._held -= w

    @property
    def held(self) -> tuple[int, int]:
        """The sessions kept and their weight in all."""
        with self._lock:
            return len(self._entries), self._held
