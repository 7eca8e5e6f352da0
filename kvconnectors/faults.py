"""A fault injector for the data plane, to prove the digest and the read deadline: it
acts on the reading engine's worker (:mod:`kvpilot.kvconnectors.worker`) between the
inner connector's report that a read landed and kvpilot's check of it.

Off by default, and refused unless ``allow_fault_injection`` is set beside it
(:class:`kvpilot.kvconnectors.config.KVPilotConfig`): a production config that carries
an injector by mistake fails to load. Pure: the randomness is a seeded ``random.Random``.

The kinds (:class:`FaultKind`), one per read at most:

* ``corrupt_block``: flip one byte of the first block the read filled, before the digest
  check (a torn or misdirected write); the check must catch it;
* ``reused_block``: replace the first block the read filled, in every layer of its group,
  with the bytes of another block (the holder freed the block and reused it for other
  tokens before the read: well-formed KV of the wrong tokens); the check must catch it;
* ``stall_read``: hold the read's completion for ``stall_s`` (a read that hangs); past the
  read's deadline it is abandoned, and the late completion is dropped, never attached;
* ``drop_completion``: never report the read's completion (a lost notification, as in
  nixl#2047); only the deadline ends the wait.
"""

from __future__ import annotations

import enum
import random
from typing import Annotated

import msgspec


class FaultKind(enum.Enum):
    """What the injector does to one read. Values are config strings and a metric label."""

    CORRUPT_BLOCK = "corrupt_block"
    REUSED_BLOCK = "reused_block"
    STALL_READ = "stall_read"
    DROP_COMPLETION = "drop_completion"


FAULT_KINDS: tuple[str, ...] = tuple(kind.value for kind in FaultKind)

_Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
_Seconds = Annotated[float, msgspec.Meta(gt=0.0)]
_RequestId = Annotated[str, msgspec.Meta(min_length=1)]


class FaultInjection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which reads get a fault, and which. A read whose request id contains a key of
    ``request_ids`` gets that key's fault (vLLM wraps a client's ``request_id`` in a prefix
    and suffixes); any other read, with probability ``rate``, one of ``kinds`` at random."""

    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    rate: _Rate = 0.0
    request_ids: dict[_RequestId, FaultKind] = {}
    stall_s: _Seconds = 60.0
    """How long ``stall_read`` holds a completion (longer than the deadline to test it)."""
    seed: int = 0


class FaultInjector:
    """Picks the fault of each read, once, from a :class:`FaultInjection`."""

    def __init__(self, spec: FaultInjection) -> None:
        if spec.rate and not spec.kinds:
            raise ValueError("a fault rate needs at least one kind")
        self.spec = spec
        self._rng = random.Random(spec.seed)

    def pick(self, request_id: str) -> FaultKind | None:
        """The fault for the read of ``request_id``, or ``None``. Advances the RNG once
        per call that is not decided by ``request_ids``."""
        for chosen, kind in self.spec.request_ids.items():
            if chosen in request_id:
                return kind
        if self.spec.rate and self._rng.random() < self.spec.rate:
            return self._rng.choice(self.spec.kinds)
        return None
