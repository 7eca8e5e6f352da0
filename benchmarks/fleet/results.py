"""The fleet benchmark's results: what each streamed request measured, and each arm's
summary as the JSON keeps it. Pure: no processes, no HTTP.

Definitions (every arm alike):

* TTFT: from the moment the client sent the request to its first streamed token.
* ITL: a request's decode time over its later tokens, ``(last token - first token) /
  (tokens - 1)`` (what vLLM's benchmarks call TPOT); ``itl_mean_s`` is its mean over the
  requests with at least two tokens.
* throughput: completed requests over the span from the first send to the last answer.
* prefix reuse: prompt tokens the workers served from their own prefix caches, over
  all prompt tokens they were sent (the workers' own counts: see ``bench_fleet``).
* CPU per request: a process's user + system CPU seconds over the arm, over the
  requests sent.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.agent.results import pct

REQUIRED_KEYS = (
    "ttft_mean_s",
    "ttft_p99_s",
    "itl_mean_s",
    "throughput_rps",
    "prefix_reuse",
    "completed",
    "failed",
)
"""What every arm's JSON object holds at least (other tools read these)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One streamed request of one arm; times in seconds after the arm's start."""

    index: int
    """The request's position in the trace."""
    sent: float
    first_token: float | None
    last_token: float | None
    output_tokens: int
    queued_s: float = 0.0
    """How long the request waited for a free client slot (``--concurrency``) after its arrival time."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """The prompt tokens the worker served from its prefix cache (its usage block's
    ``prompt_tokens_details.cached_tokens``)."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def itl(self) -> float | None:
        """The mean time between this request's tokens after the first; ``None`` with fewer than two."""
        if self.first_token is None or self.last_token is None or self.output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class ReuseCounts:
    """Prompt tokens the workers were sent and served from cache, by their own counts."""

    prompt_tokens: float
    cached_tokens: float

    @property
    def reuse(self) -> float:
        """Cached over prompt tokens; NaN when no prompt token was counted."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan


def reuse_from_computed(input_tokens: int, full_blocks: int, computed_blocks: int, block_size: int) -> ReuseCounts:
    """Reuse from the workers' KV events: of the prompts' ``full_blocks``, those not
    computed (stored) by any worker came from a cache. A partial last block is always
    computed, so it only counts in ``input_tokens``. No input: NaN reuse."""
    if not input_tokens:
        return ReuseCounts(0.0, 0.0)
    return ReuseCounts(float(input_tokens), float((full_blocks - computed_blocks) * block_size))


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def summarize(
    outcomes: Sequence[Outcome],
    reuse: ReuseCounts,
    cpu_seconds: dict[str, float],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One arm's JSON object: the :data:`REQUIRED_KEYS`, TTFT p50, output throughput,
    client queueing, errors by message, ``cpu_s_per_request`` per process name
    (``cpu_seconds`` over the requests sent), then ``extra`` as given."""
    ok = [o for o in outcomes if o.ok]
    ttfts = [t for o in ok if (t := o.ttft) is not None]
    itls = [t for o in ok if (t := o.itl) is not None]
    span = max((o.last_token or o.first_token or o.sent for o in outcomes), default=0.0) - min(
        (o.sent for o in outcomes), default=0.0
    )
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            message = (o.error or "no token")[:120]
            errors[message] = errors.get(message, 0) + 1
    return {
        "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p99_s": pct(ttfts, 99),
        "itl_mean_s": _mean(itls),
        "throughput_rps": len(ok) / span if span > 0 else math.nan,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / span if span > 0 else math.nan,
        "prefix_reuse": reuse.reuse,
        "prompt_tokens_counted": reuse.prompt_tokens,
        "cached_tokens_counted": reuse.cached_tokens,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": errors,
        "client_queued_mean_s": _mean([o.queued_s for o in outcomes]),
        "span_s": span,
        "cpu_s_per_request": {name: s / len(outcomes) if outcomes else math.nan for name, s in cpu_seconds.items()},
        **(extra or {}),
    }
