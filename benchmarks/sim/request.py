"""What a simulated engine holds and reports: a request as it sees it (:class:`SimRequest`),
its restore from the host tier (:class:`HostLoad`), a cached generated block
(:class:`GeneratedBlock`), a stored block (:data:`Stored`) and what a pass did
(:class:`PassResult`). Plain data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class SimRequest:
    """A request as the engine sees it: ``blocks`` names its full prompt blocks (each key
    names its whole prefix), ``arrival_ms`` when the client sent it."""

    rid: int
    prompt_len: int
    output_len: int
    blocks: Sequence[object]
    arrival_ms: float
    hash_ids: Sequence[int] = ()
    """The trace's hash ids of its prompt (a router that names tokens synthesizes them)."""
    session: str | None = None
    """The trace's ``session_id`` (a router that knows sessions is told it)."""
    transferred: bool = False
    """Its prompt's KV was computed elsewhere and moved here: admitted computed (module doc)."""
    computed: int = 0
    generated: int = 0
    reused_tokens: int = 0
    held: list[object] = field(default_factory=list)
    """The cached blocks this request pins (in order)."""
    private_blocks: int = 0
    """Blocks it holds that no other request can reuse (its partial and generated blocks)."""
    first_token_ms: float | None = None
    token_ms: list[float] = field(default_factory=list)
    host_reused_tokens: int = 0
    """Of ``reused_tokens``, those restored from the host tier (the rest were on the GPU)."""
    next_store_block: int = 0
    """The host tier's write-through cursor: its prompt blocks before this were offered."""
    load: HostLoad | None = None
    """Its restore from the host tier, while it loads and until it is admitted."""

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


@dataclass(slots=True)
class HostLoad:
    """A request's restore from the host tier: its GPU hit when it looked, the host blocks
    it restores after it, and when that H2D ends (``None`` once activated)."""

    g1_blocks: int
    blocks: list[object]
    deadline_ms: float | None
    transfer: int


@dataclass(frozen=True, slots=True)
class GeneratedBlock:
    """A full block of a finished request's generated tokens, cached under a name no prompt
    has (its evictions are not reported: no router was told of it)."""

    rid: int
    index: int


Stored = tuple[SimRequest, int]
"""A block that became cached: the request that computed it and the block's index in its prompt."""


@dataclass(slots=True)
class PassResult:
    """What a pass did: when it ends, the blocks it stored and evicted (its KV events), who
    emits a token."""

    end_ms: float
    stored: list[Stored]
    evicted: list[object]
    emitting: list[SimRequest]
    host_stored: list[Stored] = field(default_factory=list)
    """Blocks whose copy to the host tier completed since the last pass ended, up to this
    one's end (its host-tier events; set by :meth:`SimEngine.finish_pass`)."""
    host_evicted: list[object] = field(default_factory=list)
    """Blocks the host tier evicted in the same span."""
