"""Mooncake traces as the fleet benchmark's requests: loading, prompts, arrivals and the
trace's own ceiling for prefix reuse. No processes, no HTTP; pure but for :func:`load_trace`,
which reads the trace's file.

A trace line (``benchmarks/traces/README.md``) is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ..., 2354]}

``hash_ids`` name the prompt's 512-token blocks; equal ids at the same position are
reusable prefix KV. An optional ``session_id`` (a string; not in Mooncake's format, written
by :mod:`agent_trace`) names the agent session a request is a step of.
:class:`PromptSynth` turns a request into token ids: each hash id
is a fixed, seeded run of ``tokens_per_hash`` token ids in ``[FIRST_ORDINARY_ID,
vocab_size)`` (the same id gives the same run wherever it appears), the last block cut
to the request's share. With ``tokens_per_hash`` < 512 every block is scaled down by
the same factor (its last block by the same ratio, rounded up), so the prefix structure
is the trace's and only the lengths shrink. With ``max_input_tokens`` a longer prompt
keeps its first ``max_input_tokens`` tokens (a prefix: what it shares stays shared).

:func:`reuse_ceiling` is the reuse an ideal fleet could reach: one cache that never
evicts, in arrival order, at the engines' block granularity: the full blocks of each
prompt whose whole prefix appeared in an earlier prompt, over all prompt tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACES_DIR = Path(__file__).resolve().parents[1] / "traces"
"""The public Mooncake traces kept in the repository (their README and license beside them)."""
TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in a Mooncake trace."""
FIRST_ORDINARY_ID = 7
"""Ids below this are not drawn (the tiny model's first special tokens; a mocker gives no id
a meaning, so the traces keep the range they were first measured with)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    """The session the request is a step of, where the trace names one."""

    def __post_init__(self) -> None:
        if self.session_id is not None and not (isinstance(self.session_id, str) and self.session_id):
            raise ValueError(f"a session_id must be a non-empty string, got {self.session_id!r}")
        blocks = -(-self.input_length // TRACE_BLOCK_TOKENS)
        if self.input_length < 1 or self.output_length < 1 or len(self.hash_ids) != blocks:
            raise ValueError(
                f"a request needs input and output tokens and one hash id per {TRACE_BLOCK_TOKENS} input tokens, "
                f"got input {self.input_length}, output {self.output_length}, {len(self.hash_ids)} hash ids"
            )


def parse_trace(lines: Iterable[str], max_requests: int | None = None) -> list[TraceRequest]:
    """The first ``max_requests`` requests (all if ``None``), in file order; blank lines
    are skipped. Raises ValueError naming the line for a malformed one."""
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        if max_requests is not None and len(requests) >= max_requests:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            requests.append(
                TraceRequest(
                    int(row["timestamp"]),
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row["hash_ids"]),
                    row.get("session_id"),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {number}: {exc}") from None
    return requests


def load_trace(path: Path, max_requests: int | None = None) -> list[TraceRequest]:
    """:func:`parse_trace` of the file at ``path``."""
    with path.open() as lines:
        return parse_trace(lines, max_requests)


def arrivals(requests: Sequence[TraceRequest], rate_scale: float) -> list[float]:
    """Each request's send time in seconds after the first request's: its trace
    timestamp divided by ``rate_scale`` (2.0: twice the trace's request rate)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be positive, got {rate_scale}")
    if not requests:
        return []
    start = requests[0].timestamp_ms
    return [(r.timestamp_ms - start) / 1000.0 / rate_scale for r in requests]


@dataclass(frozen=True, slots=True)
class PromptShape:
    """How trace requests become prompts (see the module doc)."""

    tokens_per_hash: int = TRACE_BLOCK_TOKENS
    block_size: int = 32
    """The engines' KV block size: must divide ``tokens_per_hash``."""
    vocab_size: int = 2048
    max_input_tokens: int | None = None
    seed: int = 20261201

    def __post_init__(self) -> None:
        if not 0 < self.tokens_per_hash <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"tokens_per_hash must be in 1..{TRACE_BLOCK_TOKENS}, got {self.tokens_per_hash}")
        if self.block_size < 1 or self.tokens_per_hash % self.block_size:
            raise ValueError(f"block_size {self.block_size} must divide tokens_per_hash {self.tokens_per_hash}")
        if self.vocab_size <= FIRST_ORDINARY_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_ORDINARY_ID}")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ValueError("max_input_tokens must be positive")

    def block_lengths(self, request: TraceRequest) -> list[int]:
        """Tokens of each of the request's hash blocks in its prompt, before the cap."""
        last = request.input_length - TRACE_BLOCK_TOKENS * (len(request.hash_ids) - 1)
        last_scaled = -(-last * self.tokens_per_hash // TRACE_BLOCK_TOKENS)
        return [self.tokens_per_hash] * (len(request.hash_ids) - 1) + [last_scaled]

    def input_tokens(self, request: TraceRequest) -> int:
        """The length of the request's prompt."""
        length = sum(self.block_lengths(request))
        return length if self.max_input_tokens is None else min(length, self.max_input_tokens)

    def capped(self, request: TraceRequest) -> bool:
        """Whether ``max_input_tokens`` cut this request's prompt."""
        return self.input_tokens(request) < sum(self.block_lengths(request))


class PromptSynth:
    """Token ids for trace requests under one :class:`PromptShape` (caches each hash
    id's run; deterministic from ``shape.seed``)."""

    def __init__(self, shape: PromptShape) -> None:
        self.shape = shape
        self._runs: dict[int, list[int]] = {}

    def run(self, hash_id: int) -> list[int]:
        """The ``tokens_per_hash`` token ids of ``hash_id``: the same on every call."""
        run = self._runs.get(hash_id)
        if run is None:
            rng = np.random.default_rng([self.shape.seed, hash_id])
            ids = rng.integers(FIRST_ORDINARY_ID, self.shape.vocab_size, self.shape.tokens_per_hash)
            run = self._runs[hash_id] = [int(i) for i in ids]
        return run

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's prompt: each hash id's run, the last one cut to its share, the
        whole capped at ``max_input_tokens``."""
        tokens: list[int] = []
        for hash_id, length in zip(request.hash_ids, self.shape.block_lengths(request), strict=True):
            tokens += self.run(hash_id)[:length]
        return tokens[: self.shape.input_tokens(request)]


BlockKey = tuple[int, int]
"""A full engine block: (the id of its hash-id prefix, its index within its hash block)."""


class PrefixIds:
    """Interns hash-id prefixes: two requests get the same id for position ``i`` exactly
    when their first ``i + 1`` hash ids are equal."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def of(self, hash_ids: Sequence[int]) -> list[int]:
        """The prefix id of each position of ``hash_ids``."""
        ids: list[int] = []
        parent = -1
        for hash_id in hash_ids:
            parent = self._ids.setdefault((parent, hash_id), len(self._ids))
            ids.append(parent)
        return ids


def full_block_keys(shape: PromptShape, request: TraceRequest, prefixes: PrefixIds) -> list[BlockKey]:
    """The request's full engine blocks, in order, each named by its whole prefix
    (two requests share a block exactly when they share its key)."""
    per_hash = shape.tokens_per_hash // shape.block_size
    full = shape.input_tokens(request) // shape.block_size
    prefix = prefixes.of(request.hash_ids)
    return [(prefix[index // per_hash], index % per_hash) for index in range(full)]


@dataclass(frozen=True, slots=True)
class Ceiling:
    """What the trace allows (see :func:`reuse_ceiling`)."""

    input_tokens: int
    reusable_tokens: int
    distinct_blocks: int

    @property
    def reuse(self) -> float:
        """Reusable over input tokens; 0.0 for no input."""
        return self.reusable_tokens / self.input_tokens if self.input_tokens else 0.0


def ideal_hits(shape: PromptShape, requests: Sequence[TraceRequest]) -> tuple[list[int], int]:
    """Each request's prompt tokens that one cache that never evicts holds when it arrives
    (``requests`` in order): its full blocks whose key (their whole prefix) was in an
    earlier request's prompt; and how many distinct full blocks all the prompts have.
    A hit is always a prefix of its prompt (a block's key names its whole prefix).
    Partial blocks are always computed."""
    prefixes = PrefixIds()
    seen: set[BlockKey] = set()
    hits: list[int] = []
    for request in requests:
        keys = full_block_keys(shape, request, prefixes)
        hits.append(shape.block_size * sum(key in seen for key in keys))
        seen.update(keys)
    return hits, len(seen)


def reuse_ceiling(shape: PromptShape, requests: Sequence[TraceRequest]) -> Ceiling:
    """The most prefix reuse any fleet can reach on ``requests`` in order: the
    :func:`ideal_hits` over all prompt tokens."""
    hits, distinct = ideal_hits(shape, requests)
    return Ceiling(sum(shape.input_tokens(r) for r in requests), sum(hits), distinct)


def block_digest(tokens: Sequence[int]) -> int:
    """A block's identity by its token ids (Python's tuple hash: the same in every run
    for ints); two prompts' blocks collide only if their tokens are equal."""
    return hash(tuple(tokens))


def prompt_block_digests(synth: PromptSynth, requests: Sequence[TraceRequest]) -> set[int]:
    """The digests of every full engine block of every request's prompt: what tells a
    worker's stored prompt block from a block of generated tokens."""
    size = synth.shape.block_size
    digests: set[int] = set()
    for request in requests:
        prompt = synth.prompt(request)
        digests.update(block_digest(prompt[i : i + size]) for i in range(0, len(prompt) - size + 1, size))
    return digests
