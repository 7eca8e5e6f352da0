"""The reference article's coding agent as a Mooncake trace, for the fleet benchmark
(``bench_fleet.py --trace``): sessions of agent steps on a shared prefix, at fleet scale.

The article's running example (section 1.2): every session starts from the same 32,000
tokens (system prompt, tool schemas, repository snapshot) plus a ~100-token task; each
step's prompt is the whole history, the model emits a ~150-token tool call and the tool
returns ~1,500 tokens, so step ``k``'s prompt is ``prefix + task + k * (call + output)``
tokens (about 63,000 at step 20).

As a trace (:class:`fleet_trace.TraceRequest`, 512-token hash ids): a hash block lying
wholly in the shared prefix has the same id in every session; every other block of a
session has an id of that session's, the same at every step that reaches it. A step's
partial last block keeps the id the block has once full: :class:`fleet_trace.PromptSynth`
cuts a hash id's token run to its share, so the partial block's tokens are a prefix of
the full block's, as an appended history's are. What the trace cannot say: the tokens a
worker generated are not the next prompt's (the synthetic tool call stands in for them),
so reuse counts prompt tokens only, as for any Mooncake trace.

Each request carries its session's id (``session_id``: ``agent-<n>``), which the fleet
benchmark sends as the session headers kvpilot's router and Dynamo's frontend read.

Arrivals, seeded: sessions start at exponential gaps of mean ``session_gap_s``; a session's
step follows its previous step by ``step_gap_s`` (the model's answer and the tool's run),
except, with ``steps_per_turn``, the first step of each human turn after the first: it
follows by an exponential gap of mean ``human_gap_s`` (the article's section 5.3: tool gaps
of seconds, human gaps of tens of seconds to minutes).
Pure but for :func:`main`, which writes the trace.

    python -m benchmarks.make_agent_trace --sessions 64 --steps 20 --out /tmp/agent-trace.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.fleet.trace import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class AgentShape:
    """The article's agent, in tokens, and how sessions arrive."""

    sessions: int = 64
    steps: int = 20
    shared_prefix: int = 32_000
    task: int = 100
    call: int = 150
    tool_output: int = 1_500
    session_gap_s: float = 0.5
    step_gap_s: float = 2.0
    steps_per_turn: int = 0
    """Steps the agent runs on its own between two human turns (0: no human in the loop)."""
    human_gap_s: float = 0.0
    """The mean gap before a human turn's first step (the person reads and answers),
    exponential, in place of ``step_gap_s``."""
    seed: int = 20261202

    def __post_init__(self) -> None:
        counts = (self.sessions, self.steps, self.task, self.call, self.tool_output)
        if min(counts) < 1 or self.shared_prefix < 0:
            raise ValueError(f"sessions, steps, task, call and tool output must be positive: {self}")
        if min(self.session_gap_s, self.step_gap_s, self.human_gap_s, self.steps_per_turn) < 0:
            raise ValueError("gaps and steps per turn must not be negative")

    def prompt_tokens(self, step: int) -> int:
        """Step ``step``'s prompt (0-based): the prefix, the task, and each earlier step's
        call and tool output."""
        return self.shared_prefix + self.task + step * (self.call + self.tool_output)


def hash_ids(shape: AgentShape, session: int, tokens: int) -> tuple[int, ...]:
    """The hash ids of session ``session``'s first ``tokens`` history tokens: the shared
    prefix's whole blocks first (ids ``0..``), then the session's own blocks (ids above
    every shared one and every other session's)."""
    shared = shape.shared_prefix // TRACE_BLOCK_TOKENS
    per_session = -(-shape.prompt_tokens(shape.steps - 1) // TRACE_BLOCK_TOKENS)
    blocks = -(-tokens // TRACE_BLOCK_TOKENS)
    own = shared + session * per_session
    return tuple(j if j < shared else own + j - shared for j in range(blocks))


def session_name(session: int) -> str:
    """The trace's ``session_id`` of session number ``session``."""
    return f"agent-{session}"


def agent_trace(shape: AgentShape) -> list[TraceRequest]:
    """Every step of every session, in arrival order (ties by session), timestamps in ms
    from the first session's start."""
    rng = np.random.default_rng(shape.seed)
    starts = np.cumsum(rng.exponential(shape.session_gap_s, shape.sessions))
    starts -= starts[0]
    timed: list[tuple[int, int, TraceRequest]] = []
    for session, start in enumerate(starts):
        at_s = float(start)
        for step in range(shape.steps):
            if step and shape.steps_per_turn and step % shape.steps_per_turn == 0:
                at_s += float(rng.exponential(shape.human_gap_s))
            elif step:
                at_s += shape.step_gap_s
            tokens = shape.prompt_tokens(step)
            at_ms = round(1000 * at_s)
            ids = hash_ids(shape, session, tokens)
            timed.append((at_ms, session, TraceRequest(at_ms, tokens, shape.call, ids, session_name(session))))
    return [request for _, _, request in sorted(timed, key=lambda t: (t[0], t[1]))]


def to_jsonl(requests: Sequence[TraceRequest]) -> str:
    """``requests`` as Mooncake JSONL lines, each with its ``session_id`` where it has one."""
    return "".join(json.dumps(_line(r)) + "\n" for r in requests)


def _line(request: TraceRequest) -> dict[str, object]:
    line: dict[str, object] = {
        "timestamp": request.timestamp_ms,
        "input_length": request.input_length,
        "output_length": request.output_length,
        "hash_ids": list(request.hash_ids),
    }
    if request.session_id is not None:
        line["session_id"] = request.session_id
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = AgentShape()
    for name in ("sessions", "steps", "shared_prefix", "task", "call", "tool_output", "steps_per_turn", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("session_gap_s", "step_gap_s", "human_gap_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--out", type=Path, required=True, help="the Mooncake JSONL file to write")
    args = parser.parse_args(argv)
    shape = AgentShape(**{k: v for k, v in vars(args).items() if k != "out"})
    requests = agent_trace(shape)
    args.out.write_text(to_jsonl(requests))
    print(f"{len(requests)} requests ({shape.sessions} sessions x {shape.steps} steps) -> {args.out}")
    return 0
