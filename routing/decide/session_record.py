"""A session's shared state: what another router replica, or this router after a
restart, needs to route the session's next step as the router that served the last
one would. Pure: the record's schema, the rule that merges it into a local
:class:`~kvpilot.routing.decide.sessions.SessionState`, how long it lives, and the contract of
the store that keeps it (:class:`SessionStateStore`; Redis: :mod:`kvpilot.routing.state.redis_store`).

What is shared, per session: its *placement* (the D that served the last step and
holds its newest KV), its *affinity* (the P that prefilled it, for option 3), D's
*offer* of that KV with its wall-clock expiry (option 2), and the number of steps
served (which of two records is newer). The prompt chain is not shared: a router
that lacks it names the next prompt's blocks afresh (hashing only), and the index,
rebuilt from the engines' KV events, says what each worker caches.

A record lives as long as D's hold on the session's blocks when D stated one (its
offer's ``kvpilot_expires_at``), else ``sessions.store_ttl_s``: past D's lease the
offer cannot be pulled and D may have freed the blocks.

Example::

    >>> state = SessionState(block_size=32)
    >>> state.last_worker, state.steps = WorkerId("decode-0"), 3
    >>> record = SessionRecord.of(state)
    >>> restored = SessionState(block_size=32)
    >>> merge(restored, SessionRecord.from_bytes(record.to_bytes()))
    True
    >>> restored.last_worker, restored.steps
    ('decode-0', 3)
    >>> merge(restored, record)   # not newer than what this router knows: kept as is
    False
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import msgspec

from kvpilot.routing.decide.sessions import SessionOffer, SessionState
from kvpilot.routing.ids import SessionId, WorkerId

RECORD_VERSION = 1


class StoreOp(str, enum.Enum):
    """What the router asks of the session store (the ``op`` label of its metrics)."""

    CONNECT = "connect"
    READ = "read"
    WRITE = "write"


class StoreUnavailable(Exception):
    """The store did not answer (down, unreachable, timed out, refused the command):
    the router decides from its local state and the request goes on."""


class RecordError(ValueError):
    """A stored value is not a record of :data:`RECORD_VERSION` (another router version
    wrote it, or it is corrupt): it is ignored, as if absent."""


class OfferRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """:class:`~kvpilot.routing.decide.sessions.SessionOffer` as stored."""

    holder: str
    params: dict[str, Any]
    expires_at: float | None


class SessionRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One session's shared state (module doc), versioned; msgpack on the wire."""

    version: int
    steps: int
    decode: str | None
    prefill: str | None
    offer: OfferRecord | None = None

    @classmethod
    def of(cls, state: SessionState) -> SessionRecord:
        offer = state.offer
        return cls(
            RECORD_VERSION,
            state.steps,
            state.last_worker,
            state.last_prefill,
            None if offer is None else OfferRecord(offer.holder, dict(offer.params), offer.expires_at),
        )

    def to_bytes(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionRecord:
        """Raises :class:`RecordError` for bytes that are not a record of this version."""
        try:
            record = _DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise RecordError(f"not a session record: {exc}") from None
        if record.version != RECORD_VERSION:
            raise RecordError(f"session record version {record.version}, this router reads {RECORD_VERSION}")
        return record

    def ttl_s(self, now: float, default_s: float) -> float:
        """Seconds the record should live from ``now`` (Unix seconds): to D's lease when its
        offer states one, else ``default_s``. 0 or less: D's hold already ended."""
        if self.offer is not None and self.offer.expires_at is not None:
            return self.offer.expires_at - now
        return default_s


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SessionRecord)


def merge(state: SessionState, record: SessionRecord) -> bool:
    """Take ``record`` into ``state`` when it is newer (more steps served) than what
    ``state`` knows; returns whether it did. The chain is left as it is."""
    if record.steps <= state.steps:
        return False
    state.steps = record.steps
    state.last_worker = None if record.decode is None else WorkerId(record.decode)
    state.last_prefill = None if record.prefill is None else WorkerId(record.prefill)
    offer = record.offer
    state.offer = None if offer is None else SessionOffer(WorkerId(offer.holder), dict(offer.params), offer.expires_at)
    return True


class SessionStateStore(Protocol):
    """Where session records live between routers: bytes by session id, each with its
    own time to live. Every method raises :class:`StoreUnavailable` when the store
    cannot serve it; none retries."""

    async def open(self) -> None:
        """Connect now, so that the first session's read after a start does not pay the
        connection's round trips inside its read timeout."""
        ...

    async def load(self, key: SessionId) -> bytes | None:
        """The value stored for ``key``, ``None`` if none (or it expired)."""
        ...

    async def save(self, key: SessionId, value: bytes, ttl_s: float) -> None:
        """Store ``value`` for ``key``, replacing any, expiring ``ttl_s`` seconds from now
        (rounded up to a millisecond)."""
        ...

    async def close(self) -> None:
        """Release the connections (idempotent)."""
        ...


__all__ = [
    "RECORD_VERSION",
    "OfferRecord",
    "RecordError",
    "SessionRecord",
    "SessionStateStore",
    "StoreOp",
    "StoreUnavailable",
    "merge",
]
