"""The coding agent of the article (sections 5 and 9.2), scaled to the tiny model:
prompts as token ids, deterministic from a seed. Pure: no processes, no HTTP.

Every session starts from the same system + repository prefix. Step ``k`` sends the
session's history plus a new tool output and generates a tool call of ``G`` tokens;
the next step resends that history plus the tool call (what the reference
trajectory generated, so that every arm sends the same prompts), possibly edited
the way clients edit it (article section 5.2):

* ``strip``: the reasoning trace is stripped (the middle half of the last
  generated span dropped);
* ``rerender``: the message is re-rendered (4 tokens inside the last generated span
  changed);
* ``truncate``: the history is truncated (the oldest non-prefix tokens dropped,
  two steps' worth).

An edit "at step k" changes the history that step ``k + 1`` resends.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.tokenizer import PromptTokenizer

FIRST_ORDINARY_ID = 7
"""Ids below this are the tiny model's special tokens (``<s>``, ``</s>``, ...)."""

EDIT_KINDS = ("strip", "rerender", "truncate")
EDIT_NAMES = {"strip": "reasoning trace stripped", "rerender": "message re-rendered", "truncate": "history truncated"}


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 4
    steps: int = 20
    prefix_tokens: int = 1000
    tool_tokens: int = 100
    generated: int = 32
    editing_sessions: int = 1
    """The last ``editing_sessions`` sessions edit their history at ``edit_steps``."""
    edit_steps: tuple[int, ...] | None = None
    """Steps after which an editing session edits; ``None``: at 1/4, 1/2, 3/4 of the run."""
    seed: int = 20261201

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.steps < 1 or self.generated < 4:
            raise ValueError("need at least 1 session, 1 step and 4 generated tokens")
        if not 0 <= self.editing_sessions <= self.sessions:
            raise ValueError("editing_sessions must be between 0 and sessions")

    @property
    def edit_plan(self) -> dict[int, str]:
        """Step -> edit kind, cycling strip, rerender, truncate (steps < ``steps`` only:
        an edit after the last step changes no prompt)."""
        steps = self.edit_steps
        if steps is None:
            steps = tuple(sorted({max(1, round(self.steps * f)) for f in (0.25, 0.5, 0.75)}))
        steps = tuple(s for s in steps if 1 <= s < self.steps)
        return {step: EDIT_KINDS[i % len(EDIT_KINDS)] for i, step in enumerate(steps)}

    def edits(self, session: int) -> bool:
        return session >= self.sessions - self.editing_sessions

    @property
    def truncate_tokens(self) -> int:
        return 2 * (self.tool_tokens + self.generated)


def _ordinary(token: int, vocab_size: int) -> int:
    span = vocab_size - FIRST_ORDINARY_ID
    return FIRST_ORDINARY_ID + (token - FIRST_ORDINARY_ID) % span


@dataclass
class Workload:
    """The prompts of every session, built step by step from the generated tokens."""

    spec: WorkloadSpec
    prefix: list[int]
    tool_outputs: dict[tuple[int, int], list[int]]
    vocab_size: int
    histories: dict[int, list[int]] = field(default_factory=dict)
    """Each session's history after its last :meth:`advance`: what the next step resends."""
    edits_done: list[tuple[int, int, str]] = field(default_factory=list)
    """(session, step, kind) of every edit applied."""

    def prompt(self, session: int, step: int) -> list[int]:
        """Step ``step``'s prompt: the session's history plus the step's tool output."""
        history = self.histories.get(session, self.prefix)
        return history + self.tool_outputs[(session, step)]

    def advance(self, session: int, step: int, generated: list[int]) -> None:
        """Step ``step`` generated ``generated``: the history the next step resends."""
        history = self.prompt(session, step) + list(generated)
        kind = self.spec.edit_plan.get(step) if self.spec.edits(session) else None
        if kind is not None:
            history = self._edit(history, len(generated), kind)
            self.edits_done.append((session, step, kind))
        self.histories[session] = history

    def _edit(self, history: list[int], n_gen: int, kind: str) -> list[int]:
        head, gen = history[:-n_gen], history[-n_gen:]
        if kind == "strip":
            return head + gen[: n_gen // 4] + gen[3 * n_gen // 4 :]
        if kind == "rerender":
            mid = n_gen // 2
            changed = [_ordinary(t + 1, self.vocab_size) for t in gen[mid - 2 : mid + 2]]
            return head + gen[: mid - 2] + changed + gen[mid + 2 :]
        if kind == "truncate":
            p = len(self.prefix)
            return history[:p] + history[p + self.spec.truncate_tokens :]
        raise ValueError(f"unknown edit {kind!r}")


def _exactly(ids: list[int], n: int, filler: list[int]) -> list[int]:
    while len(ids) < n:
        ids = ids + filler
    return ids[:n]


def build(spec: WorkloadSpec, tokenizer: PromptTokenizer) -> Workload:
    """The shared prefix (a system prompt and repository files, as text tokenized)
    and one distinct tool output per (session, step): a tokenized header naming
    them, then seeded draws from the repository's tokens."""
    rng = random.Random(spec.seed)
    system = tokenizer.text_token_ids(
        "<|system|>\nYou are a coding agent. You call tools to read, edit and test the repository.<|end|>\n"
        "<|user|>\nRepository files:\n"
    )
    repo = tokenizer.text_token_ids(filler_text(spec.prefix_tokens, spec.seed % 13))
    pool = [t for t in repo if t >= FIRST_ORDINARY_ID] or list(range(FIRST_ORDINARY_ID, 64))
    prefix = _exactly(system + repo, spec.prefix_tokens, pool)
    tools: dict[tuple[int, int], list[int]] = {}
    for s in range(spec.sessions):
        for k in range(1, spec.steps + 1):
            header = tokenizer.text_token_ids(f"<|end|>\n<|user|>\ntool output, session {s}, step {k}:\n")
            body = [rng.choice(pool) for _ in range(spec.tool_tokens)]
            tools[(s, k)] = (header + body)[: spec.tool_tokens]
    return Workload(spec, prefix, tools, tokenizer.vocab_size)
