"""Tolerant decoding of vLLM's KV-event wire format (no vLLM import).

vLLM 0.32 (``vllm/distributed/kv_events.py``) publishes one msgpack message per
scheduler step: a ``KVEventBatch`` encoded *array-like* as
``[ts, events, data_parallel_rank]`` (the rank is omitted when it is ``None``),
whose events are *tagged maps*: ``{"type": "BlockStored", ...}``,
``{"type": "BlockRemoved", ...}``, ``{"type": "AllBlocksCleared"}``. Block hashes
are ``bytes`` (or 64-bit ints under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

The structs below restate vLLM's with the same field names, tags and defaults,
so an unknown *field* (a newer vLLM) is ignored, while an unknown *tag*, a
wrong type, or a shape that cannot be indexed (token count not equal to
``len(block_hashes) * block_size``) is rejected.

Contract of :meth:`EventDecoder.decode`: it never raises. A batch that cannot
be decoded at all is one :class:`Rejection`; inside a decodable batch each bad
event is one :class:`Rejection` and the good events around it are kept, in
order. Every rejection is counted in :attr:`EventDecoder.rejections` by
:class:`RejectReason`.

Example::

    >>> import msgspec
    >>> raw = msgspec.msgpack.encode([1.5, [{"type": "AllBlocksCleared"}, {"type": "Nope"}]])
    >>> batch = EventDecoder().decode(raw)
    >>> [type(e).__name__ for e in batch.events], [r.reason.name for r in batch.rejected]
    (['AllBlocksCleared'], ['UNKNOWN_TAG'])
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import Any, NamedTuple

import msgspec

ExternalBlockHash = bytes | int
"""An engine's name for a block, as published (vLLM's ``ExternalBlockHash``)."""


class _Event(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """Base of the three event kinds (the tag is the class's wire name)."""


class BlockStored(_Event, tag="BlockStored"):
    """Blocks that became cached, in chain order; mirrors vLLM's struct.

    ``token_ids`` holds ``block_size`` tokens per entry of ``block_hashes``;
    ``parent_block_hash`` is the engine hash of the block before the first one
    (``None`` when the first one is block 0). ``extra_keys`` has one untagged
    entry per block (LoRA name, ``[mm_id, offset]`` pairs, cache salt, ...).
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    """Blocks evicted from ``medium``; mirrors vLLM's struct."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    """The engine dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _TagOnly(msgspec.Struct, gc=False):
    type: Any = None


class RejectReason(enum.Enum):
    """Why a payload or one event in it was skipped."""

    UNDECODABLE_BATCH = "undecodable_batch"
    """Not msgpack, or not ``[ts, events, rank?]`` with the right types."""
    UNKNOWN_TAG = "unknown_tag"
    """An event whose ``type`` is missing or not one of :data:`KNOWN_TAGS`."""
    WRONG_TYPE = "wrong_type"
    """A known event with a missing field or a field of the wrong type."""
    INCONSISTENT = "inconsistent"
    """Well-typed but not indexable: sizes that do not add up."""


class Rejection(NamedTuple):
    reason: RejectReason
    detail: str


class DecodedBatch(NamedTuple):
    """What one message carried: the good events in order, and the rejections."""

    ts: float
    data_parallel_rank: int | None
    events: list[KVEvent]
    rejected: list[Rejection]


_MAX_DETAIL = 200


def _shape_error(event: KVEvent) -> str | None:
    if isinstance(event, BlockStored):
        n = len(event.block_hashes)
        if event.block_size <= 0:
            return f"block_size {event.block_size} is not positive"
        if len(event.token_ids) != n * event.block_size:
            return f"{len(event.token_ids)} token_ids for {n} blocks of {event.block_size}"
        if event.extra_keys is not None and len(event.extra_keys) != n:
            return f"{len(event.extra_keys)} extra_keys entries for {n} blocks"
    return None


class EventDecoder:
    """Decodes KV-event messages; keeps counts of what it rejected.

    Not thread-safe: one decoder per consuming thread.
    """

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(_RawBatch)
        self._event = msgspec.msgpack.Decoder(KVEvent)
        self._tag = msgspec.msgpack.Decoder(_TagOnly)
        self.rejections: Counter[RejectReason] = Counter()
        self.events_decoded = 0

    def decode(self, payload: bytes) -> DecodedBatch:
        """Decode one message body (the third ZMQ frame). Never raises.

        An undecodable batch comes back as a batch with ``ts = nan``, no
        events and one ``UNDECODABLE_BATCH`` rejection.
        """
        try:
            raw = self._batch.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._reject_batch(str(exc))
        except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
            return self._reject_batch(f"{type(exc).__name__}: {exc}")
        events: list[KVEvent] = []
        rejected: list[Rejection] = []
        for item in raw.events:
            outcome = self._decode_event(item)
            if isinstance(outcome, Rejection):
                self.rejections[outcome.reason] += 1
                rejected.append(outcome)
            else:
                events.append(outcome)
        self.events_decoded += len(events)
        return DecodedBatch(raw.ts, raw.data_parallel_rank, events, rejected)

    def _reject_batch(self, detail: str) -> DecodedBatch:
        rejection = Rejection(RejectReason.UNDECODABLE_BATCH, detail[:_MAX_DETAIL])
        self.rejections[rejection.reason] += 1
        return DecodedBatch(float("nan"), None, [], [rejection])

    def _decode_event(self, item: msgspec.Raw) -> KVEvent | Rejection:
        try:
            event = self._event.decode(item)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Rejection(self._classify(item), str(exc)[:_MAX_DETAIL])
        except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
            return Rejection(RejectReason.WRONG_TYPE, f"{type(exc).__name__}: {exc}")
        problem = _shape_error(event)
        if problem is not None:
            return Rejection(RejectReason.INCONSISTENT, problem)
        return event

    def _classify(self, item: msgspec.Raw) -> RejectReason:
        try:
            tag = self._tag.decode(item).type
        except Exception:  # noqa: BLE001 - not even a map with a tag
            return RejectReason.UNKNOWN_TAG
        known = isinstance(tag, str) and tag in KNOWN_TAGS  # a fuzzed tag may be a list
        return RejectReason.WRONG_TYPE if known else RejectReason.UNKNOWN_TAG
