"""The router's names for things, shared by every package of it: workers, KV
tiers, sessions and (P, D) pairs. Pure; imports nothing of kvpilot."""

from __future__ import annotations

from typing import NewType

WorkerId = NewType("WorkerId", str)
Tier = NewType("Tier", str)
"""A KV event's ``medium`` (``"GPU"``, ``"CPU"``, ``"STORAGE"``...); ``None`` reads as ``"GPU"``."""

DEFAULT_TIER = Tier("GPU")

SessionId = NewType("SessionId", str)
"""A session's affinity key, scoped to its ``cache_salt`` (:func:`kvpilot.routing.decide.sessions.scoped`)."""

PAIR_SEPARATOR = "->"
"""Between a pair's prefill and decode worker names in metrics labels and ``/debug/route``."""


def pair_name(prefill: WorkerId, decode: WorkerId) -> str:
    return f"{prefill}{PAIR_SEPARATOR}{decode}"
