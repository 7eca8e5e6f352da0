"""What the router decides for one request: a :class:`Route` (where it goes, and why, with
:meth:`Route.explain`), its :class:`Kind`, and :class:`NoHealthyWorker` when no decode worker is
left. Plain data: :class:`~kvpilot.routing.decide.router.Router` builds them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpilot.policies.disaggregation import LocalRemoteDecision
from kvpilot.policies.session_options import Option, OptionPrice
from kvpilot.routing.config import Worker
from kvpilot.routing.decide.cost import Decision, TierOverlap
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.kvindex import Match


class NoHealthyWorker(Exception):
    """Every worker that could decode this request is unavailable."""


class Kind(str, enum.Enum):
    """How a request is served."""

    REMOTE_PREFILL = "remote_prefill"  # P prefills, D decodes with P's KV
    LOCAL_PREFILL = "local_prefill"  # a P/D fleet, but D prefills itself
    COLOCATED = "colocated"  # one worker does both
    FALLBACK = "fallback"  # routed REMOTE_PREFILL, but P failed: D prefilled itself (Lifecycle.prefill_failed)


@dataclass(frozen=True)
class Route:
    """Where one request goes, and why.

    ``prefill`` is P for a remote prefill, else None (D or the co-located worker
    prefills). ``chain`` names the prompt's blocks (the ledger counts them).
    ``cached_blocks`` is the GPU prefix the prefilling worker holds,
    ``decode_cached_blocks`` D's (what a local fallback on D reuses).
    """

    request_id: str
    kind: Kind
    prefill: Worker | None
    decode: Worker
    prompt_tokens: int
    prompt_blocks: int
    chain: PromptChain
    cached_blocks: int
    decode_cached_blocks: int
    overlap: TierOverlap
    match: Match
    decision: Decision
    local_remote: LocalRemoteDecision | None
    option: Option | None = None
    """The article's option chosen for a session's later step (None otherwise)."""
    options: tuple[OptionPrice, ...] = ()
    """Every option, priced, when ``option`` is set."""

    @property
    def prefill_worker(self) -> Worker:
        """The worker that prefills (P, or D itself)."""
        return self.prefill if self.prefill is not None else self.decode

    def explain(self) -> str:
        """The cost decision term by term, then the local-vs-remote verdict, tagged."""
        head = (
            f"request={self.request_id} kind={self.kind.value} "
            f"prefill={self.prefill_worker.name} decode={self.decode.name} "
            f"prompt_tokens={self.prompt_tokens} cached_blocks={self.cached_blocks}"
        )
        lines = [head, self.decision.explain()]
        if self.local_remote is not None:
            lines.append(f"request={self.request_id} {self.local_remote.explain()}")
        for price in self.options:
            chosen = " <- chosen" if price.option is self.option else ""
            lines.append(f"request={self.request_id} {price.explain()}{chosen}")
        return "\n".join(lines)
