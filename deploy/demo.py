"""``kvpilot demo``: the main job on the embedded default.

Brings up a 1 P + 1 D tiny fleet, sends a few requests through the router (two of
them share a long prefix; one extends an earlier prompt, like an agent's next
step, and one is an agent's chat step that calls a tool), prints per request: TTFT,
prompt tokens prefilled on P and on D, tokens D received over NIXL, KV bytes NIXL moved
(from the engines' own ``vllm:*`` metrics), and whether D's output equals a co-located run
of the same request (tokens and logprobs; for the chat, its tool call too). Then it brings
the fleet down.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import Prompt, complete
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled
from kvpilot.deploy.tiny_model import TINY_MODEL_ENGINE_ARGS, ensure_tiny_model, whitespace_logit_bias
from kvpilot.kvconnectors.vllm_metrics import NIXL_BYTES_TRANSFERRED, PROMPT_TOKENS_BY_SOURCE, PromptTokenSource
from kvpilot.routing.serve.tokenizer import PromptTokenizer

PROMPT_TOKENS = PROMPT_TOKENS_BY_SOURCE.total
COMPUTED, RECEIVED = PromptTokenSource.LOCAL_COMPUTE.value, PromptTokenSource.EXTERNAL_KV_TRANSFER.value


def demo_prompts(seed: int = 7) -> list[tuple[str, str]]:
    """(label, prompt): a first request (``fleet up`` already did the one-time NIXL
    handshake between P and D), a shared prefix with two tasks, and an agent's next step."""
    rng = random.Random(seed)
    words = [
        "cache",
        "block",
        "prefix",
        "session",
        "decode",
        "prefill",
        "router",
        "engine",
        "token",
        "transfer",
        "kernel",
        "tool",
    ]
    system = "System: you are a coding agent. " + " ".join(rng.choice(words) for _ in range(700))
    task_a = system + "\nTask: fix the failing test in the scheduler."
    task_b = system + "\nTask: add a metric for expired leases."
    step_2 = task_a + "\nTool output: " + " ".join(rng.choice(words) for _ in range(300))
    warm_up = "Warm-up: " + " ".join(rng.choice(words) for _ in range(60))
    return [
        ("first request", warm_up),
        ("task A (cold)", task_a),
        ("task B (shares A's prefix)", task_b),
        ("A, step 2 (extends A)", step_2),
    ]


RUN_TESTS_TOOL = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the repository's tests under a path and return their output.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": ["tests", "src"]}},
            "required": ["path"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


def demo_chat(model_dir: Path, seed: int = 7) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(label, messages, the rest of the body): an agent's chat step: a history with a tool
    call and its result, the tool declared, and the next call forced by name. vLLM forces it
    with structured outputs (the strict tool's arguments pinned to its schema) once the
    reasoning ended (the template's empty thought ends it); the random-weight model is kept
    off whitespace so that it closes the call (:func:`~kvpilot.deploy.tiny_model.whitespace_logit_bias`)."""
    _, task_a, _, step_2 = (prompt for _, prompt in demo_prompts(seed))
    call = {"id": "call-0", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests"}'}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": task_a.split("\n", 1)[0]},
        {"role": "user", "content": "Fix the failing test in the scheduler."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-0", "content": step_2.rsplit("Tool output: ", 1)[1]},
    ]
    named = {"type": "function", "function": {"name": "run_tests"}}
    rest = {"tools": [RUN_TESTS_TOOL], "tool_choice": named, "max_completion_tokens": 80}
    rest |= {"chat_template_kwargs": {"enable_thinking": False}, **whitespace_logit_bias(model_dir)}
    return "agent chat, tool call", messages, rest


@dataclass(frozen=True, slots=True)
class DemoRow:
    label: str
    route: str
    prompt_tokens: int
    ttft_ms: float
    prefilled_on_p: int
    prefilled_on_d: int
    received_by_d: int
    nixl_bytes: int
    same_as_colocated: bool
    max_logprob_diff: float
    tool_call: str = ""
    """The chat's tool call, ``name(arguments)``, as D answered it through the fleet."""


def run_requests(started: fleet_io.Fleet, model_dir: Path) -> list[DemoRow]:
    tokenizer = PromptTokenizer(model_dir)
    prefill, decode = started.by_role("prefill")[0], started.by_role("decode")[0]
    # Co-located reference: the same request, request after request, on D alone under
    # one fresh cache salt, so nothing of the disaggregated runs is reused while prefix
    # hits split each prefill at the same blocks as on the disaggregated path.
    reference_salt = f"demo-ref-{uuid.uuid4().hex}"
    requests: list[tuple[str, Prompt, dict[str, Any]]] = [
        (label, tokenizer.encode(prompt, add_special_tokens=True), {}) for label, prompt in demo_prompts()
    ]  # token ids as vLLM encodes a text prompt (BOS first)
    requests.append(demo_chat(model_dir))
    rows = []
    for label, prompt, extra in requests:
        p0, d0 = scrape(prefill.url), scrape(decode.url)
        disagg = complete(started.client_url, prompt, stream=not extra, **extra)
        p1, d1 = settled(prefill.url, p0), settled(decode.url, d0)
        reference = complete(decode.url, prompt, cache_salt=reference_salt, **extra)
        rows.append(
            DemoRow(
                label=label,
                route=disagg.headers.get("X-KVPilot-Route", "?"),
                prompt_tokens=disagg.prompt_tokens or len(prompt),
                ttft_ms=disagg.ttft_seconds * 1e3,
                prefilled_on_p=int(delta(p1, p0, PROMPT_TOKENS, source=COMPUTED)),
                prefilled_on_d=int(delta(d1, d0, PROMPT_TOKENS, source=COMPUTED)),
                received_by_d=int(delta(d1, d0, PROMPT_TOKENS, source=RECEIVED)),
                nixl_bytes=int(delta(d1, d0, NIXL_BYTES_TRANSFERRED.sum)),
                same_as_colocated=disagg.same_output(reference),
                max_logprob_diff=disagg.max_logprob_diff(reference),
                tool_call=", ".join(f"{name}({args})" for name, args in disagg.tool_calls),
            )
        )
    return rows


def render(rows: list[DemoRow]) -> str:
    head = (
        f"{'request':<28}{'route':<16}{'prompt':>7}{'TTFT ms':>9}{'P prefill':>10}{'D prefill':>10}"
        f"{'D via NIXL':>11}{'NIXL bytes':>12}  same as co-located"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        verdict = (
            "yes (logprobs identical)" if r.same_as_colocated else f"NO (max logprob diff {r.max_logprob_diff:.2e})"
        )
        lines.append(
            f"{r.label:<28}{r.route:<16}{r.prompt_tokens:>7}{r.ttft_ms:>9.0f}{r.prefilled_on_p:>10}{r.prefilled_on_d:>10}"
            f"{r.received_by_d:>11}{r.nixl_bytes:>12,}  {verdict}"
        )
    lines += [f"{r.label}: {r.tool_call}" for r in rows if r.tool_call]
    return "\n".join(lines)


DEMO_GATEWAY_PORT = 8080
"""Envoy's port in the demo: the requests go through Envoy, the router's picker deciding."""


def run_demo(run_dir: Path, disaggregation: str = "always") -> int:
    print("[1/4] tiny model")
    model_dir = ensure_tiny_model()
    print(f"  {model_dir}")
    print(
        "[2/4] fleet up: 1 prefill + 1 decode engine (vLLM CPU, KVPilotConnector over NIXL), "
        f"router ({disaggregation}), Envoy"
    )
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=run_dir,
        disaggregation=disaggregation,
        gateway_port=DEMO_GATEWAY_PORT,
        engine_args=TINY_MODEL_ENGINE_ARGS,
    )
    t0 = time.monotonic()
    started = fleet_io.up(spec)
    print(f"  ready in {time.monotonic() - t0:.0f} s")
    try:
        print(
            f"[3/4] requests through Envoy on {started.client_url}, the router's picker deciding (prefill on P or "
            "locally on D, KV over NIXL, decode on D streamed by Envoy)"
        )
        rows = run_requests(started, model_dir)
        print()
        print(render(rows))
        print()
    finally:
        print("[4/4] fleet down")
        fleet_io.down(run_dir)
    return 0 if all(r.same_as_colocated for r in rows) else 1
