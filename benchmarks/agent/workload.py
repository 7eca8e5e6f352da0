"""The coding agent of the article (sections 5 and 9.2), scaled to the tiny model and sent
as an agent client sends it: chat messages with a tool declared and tool calls in the
history, deterministic from a seed. Pure: no processes, no HTTP.

Every session starts from the same system prompt (the agent's instructions and the
repository's files, with the tool :data:`TOOLS` declared): its first step is the user's task
with the first tool output; each later step resends the session's history plus a ``tool``
message with the step's output, answering the call the last step made. The model answers
``G`` tokens (greedy, ``ignore_eos``); its text becomes the next assistant turn of the history,
as the reasoning that preceded a ``run_tests`` call (the call is the client's: a random-weight
model makes none of its own), so the next step resends what the reference trajectory
generated and every arm sends the same messages. A session edits its history the way clients
do (article section 5.2):

* ``strip``: the reasoning of the last assistant turn dropped;
* ``rerender``: the last assistant turn re-rendered (16 characters in the middle of its
  reasoning changed);
* ``truncate``: the history truncated (the two oldest tool steps dropped).

An edit "at step k" changes the history that step ``k + 1`` resends.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import SPECIAL_TOKENS

FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)
"""Ids below this are the tiny model's special tokens (``<s>``, ``</s>``, ``<tool_call>``, ...):
the token-id prompts of the warm-ups stay above them."""

EDIT_KINDS = ("strip", "rerender", "truncate")
EDIT_NAMES = {"strip": "reasoning trace stripped", "rerender": "message re-rendered", "truncate": "history truncated"}


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 4
    steps: int = 20
    prefix_tokens: int = 1000
    """Words of repository files in the system prompt."""
    tool_tokens: int = 100
    """Words of each tool output."""
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


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the repository's tests under a path and return their output.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]
"""The tool every request declares (``tools``)."""

Message = dict[str, Any]


def _call_id(session: int, step: int) -> str:
    return f"call-{session}-{step}"


@dataclass
class Workload:
    """The messages of every session, built step by step from the generated text."""

    spec: WorkloadSpec
    system: Message
    tasks: dict[int, str]
    tool_outputs: dict[tuple[int, int], str]
    histories: dict[int, list[Message]] = field(default_factory=dict)
    """Each session's history after its last :meth:`advance`: what the next step resends."""
    edits_done: list[tuple[int, int, str]] = field(default_factory=list)
    """(session, step, kind) of every edit applied."""

    @property
    def shared_prefix(self) -> list[Message]:
        """What every session's prompt starts with: the system prompt."""
        return [self.system]

    def prompt(self, session: int, step: int) -> list[Message]:
        """Step ``step``'s messages: the session's history plus the step's tool output (the
        first step's with the user's task)."""
        output = self.tool_outputs[(session, step)]
        if step == 1:
            return [self.system, {"role": "user", "content": f"{self.tasks[session]}\n{output}"}]
        reply = {"role": "tool", "tool_call_id": _call_id(session, step - 1), "content": output}
        return [*self.histories[session], reply]

    def advance(self, session: int, step: int, generated: str) -> None:
        """Step ``step`` generated ``generated``: the history the next step resends."""
        arguments = json.dumps({"path": f"tests/test_step_{step}.py"})
        call = {
            "id": _call_id(session, step),
            "type": "function",
            "function": {"name": "run_tests", "arguments": arguments},
        }
        turn = {"role": "assistant", "content": None, "reasoning": generated, "tool_calls": [call]}
        history = [*self.prompt(session, step), turn]
        kind = self.spec.edit_plan.get(step) if self.spec.edits(session) else None
        if kind is not None:
            history = _edit(history, kind)
            self.edits_done.append((session, step, kind))
        self.histories[session] = history


def _edit(history: list[Message], kind: str) -> list[Message]:
    """``history`` edited as ``kind`` says (the module doc); the last message is the turn just made."""
    *head, last = history
    if kind == "strip":
        return [*head, {k: v for k, v in last.items() if k != "reasoning"}]
    if kind == "rerender":
        text = last["reasoning"]
        mid = len(text) // 2
        return [*head, {**last, "reasoning": text[: mid - 8] + text[mid - 8 : mid + 8][::-1].upper() + text[mid + 8 :]}]
    if kind == "truncate":  # system, task, then (assistant, tool) pairs: the two oldest pairs go
        return [*history[:2], *history[6:]]
    raise ValueError(f"unknown edit {kind!r}")


def build(spec: WorkloadSpec) -> Workload:
    """The shared system prompt (instructions and repository files), each session's task and
    one distinct tool output per (session, step): a header naming them, then seeded draws
    from the repository's words."""
    rng = random.Random(spec.seed)
    files = filler_text(spec.prefix_tokens, spec.seed % 13)
    system = {
        "role": "system",
        "content": "You are a coding agent. You call tools to read, edit and test the repository.\n"
        f"Repository files:\n{files}",
    }
    words = files.split()
    tasks = {s: f"Session {s}: fix the failing test." for s in range(spec.sessions)}
    tools: dict[tuple[int, int], str] = {}
    for s in range(spec.sessions):
        for k in range(1, spec.steps + 1):
            body = " ".join(rng.choice(words) for _ in range(spec.tool_tokens))
            tools[(s, k)] = f"tool output, session {s}, step {k}:\n{body}"
    return Workload(spec, system, tasks, tools)
