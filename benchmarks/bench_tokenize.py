"""The router's token ids: computed at the router, or asked of the engine's ``POST /tokenize``.

The router routes on the token ids the engine will compute for a request
(``routing/serve/prompt.py``). It can compute them itself (the model's ``tokenizer.json`` and
chat template, rendered as vLLM renders them: no vLLM on the router's box) or ask an engine,
whose ``/tokenize`` returns exactly its own ids. This times both on request shapes of a coding
agent, in one run on one engine (a co-located tiny engine started here, the tiny model shaped
like real ones): per shape, the median of ``--repeats`` calls each way (the engine's over one
kept-alive connection, as a router's client would hold it), and checks the two give the same
ids. An agent's chat step is also timed as a session's next step, rendered and tokenized from
the session's last prompt (the step before it, kept beforehand and untimed:
``routing/serve/incremental_chat.py``, ``routing/serve/incremental_tokens.py``), beside the
whole tokenization and that rendering alone, and its ids checked against the engine's
too. ::

    python -m benchmarks.bench_tokenize --repeats 200 --json docs/benchmarks/results/tokenize.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.provenance import provenance, recorded_argv
from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import TINY_MODEL_ENGINE_ARGS, ensure_tiny_model
from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from kvpilot.routing.serve.upstream import Api

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} in the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    for name in ("read_file", "edit_file", "run_tests", "grep")
]


def _agent_history(steps: int, tool_words: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + filler_text(600, 1)},
        {"role": "user", "content": "Fix the failing scheduler test."},
    ]
    for k in range(steps):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "t"}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": filler_text(tool_words, 10 + k)})
    return messages


def _agent_chat(steps: int) -> dict[str, Any]:
    return {"messages": _agent_history(steps, 150), "tools": TOOLS}


SHAPES: tuple[tuple[str, Api, dict[str, Any], dict[str, Any] | None], ...] = (
    ("completions, 200-word text", Api.COMPLETIONS, {"prompt": filler_text(200, 1)}, None),
    ("completions, 6,000-word text", Api.COMPLETIONS, {"prompt": filler_text(6000, 2)}, None),
    ("chat, agent step 2 (tools, tool calls)", Api.CHAT, _agent_chat(2), _agent_chat(1)),
    ("chat, agent step 30 (tools, tool calls)", Api.CHAT, _agent_chat(30), _agent_chat(29)),
)
"""Each shape's request, and for an agent's step the request of its step before (a session's last prompt)."""


def _engine_ids(conn: http.client.HTTPConnection, body: dict[str, Any]) -> list[int]:
    conn.request("POST", "/tokenize", json.dumps({"model": "tiny", **body}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    if resp.status != 200:
        raise RuntimeError(f"/tokenize answered {resp.status}: {payload}")
    return list(payload["tokens"])


def _ms(call: Any) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def _session_step(
    prompts: EnginePrompt, body: dict[str, Any], previous: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """``body`` as a session's next step after ``previous``: its ids, and the medians of the
    step with the session's last prompt kept, of the whole tokenization and of that step's
    rendering alone. Each repeat has its own sessions, all primed with ``previous`` first;
    each way is then timed over all repeats in turn, so that every timed call follows a call
    of its own kind (a call right after a long prompt's whole tokenization runs on caches
    that tokenization filled)."""
    chats = prompts.chats
    assert chats is not None
    for k in range(repeats):
        prompts.token_ids(Api.CHAT, previous, session=f"bench-{k}")
        chats.render(f"render-{k}", previous)
    step = prompts.token_ids
    times = {
        "session_ms": [_ms(lambda k=k: step(Api.CHAT, body, session=f"bench-{k}")) for k in range(repeats)],
        "local_ms": [_ms(lambda: prompts.token_ids(Api.CHAT, body)) for _ in range(repeats)],
        "render_ms": [_ms(lambda k=k: chats.render(f"render-{k}", body)) for k in range(repeats)],
    }
    prompts.token_ids(Api.CHAT, previous, session="bench-ids")
    ids = prompts.token_ids(Api.CHAT, body, session="bench-ids")
    return {"session_ids": ids, **{name: statistics.median(values) for name, values in times.items()}}


def measure(repeats: int) -> list[dict[str, Any]]:
    model_dir = ensure_tiny_model()
    prompts = EnginePrompt(PromptTokenizer(model_dir), ChatTemplate.from_model_dir(model_dir))
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=Path(tempfile.mkdtemp(prefix="kvpilot-bench-tokenize-")),
        prefill=0,
        decode=0,
        colocated=1,
        engine_port=8930,
        side_channel_port=6930,
        events_port=7030,
        router_port=8920,
        engine_args=TINY_MODEL_ENGINE_ARGS,
    )
    started = fleet_io.up(spec, progress=lambda _: None)
    rows = []
    try:
        host, port = started.engines[0].url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        for name, api, body, previous in SHAPES:
            local = prompts.token_ids(api, body)
            engine = _engine_ids(conn, body)
            engine_ms = statistics.median(_ms(lambda b=body: _engine_ids(conn, b)) for _ in range(repeats))
            row: dict[str, Any] = {"shape": name, "tokens": len(engine)}
            if previous is None:
                times = (_ms(lambda a=api, b=body: prompts.token_ids(a, b)) for _ in range(repeats))
                row |= {"local_ms": statistics.median(times), "session_ms": None, "render_ms": None}
                session_ids = local
            else:
                row |= _session_step(prompts, body, previous, repeats)
                session_ids = row.pop("session_ids")
            row["same_ids"] = local == engine == session_ids
            row["engine_ms"] = engine_ms
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
        conn.close()
    finally:
        fleet_io.down(spec.run_dir)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| request | prompt tokens | same ids | at the router (ms) | from the session's last prompt (ms) "
            "| of it, rendering (ms) | engine's `/tokenize` (ms) | engine / router |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["engine_ms"] / r["local_ms"] if r["local_ms"] else float("inf")
        same = "yes" if r["same_ids"] else "NO"
        session, render = (f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("session_ms", "render_ms"))
        lines.append(
            f"| {r['shape']} | {r['tokens']:,} | {same} | {r['local_ms']:.2f} | {session} | {render} "
            f"| {r['engine_ms']:.2f} | {ratio:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="calls per shape and way (median)")
    parser.add_argument("--json", type=Path, help="write the results file here")
    args = parser.parse_args(argv)
    rows = measure(args.repeats)
    print(table(rows))
    if args.json is not None:
        run = {"argv": recorded_argv(), "repeats": args.repeats}
        args.json.write_text(json.dumps({"run": run, "provenance": provenance(), "tokenize": rows}, indent=1) + "\n")
    return 0 if all(r["same_ids"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
