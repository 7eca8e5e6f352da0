"""What one request costs the router's Python, stage by stage, against what compiled code costs
for the same work: the bound on how far compiling the request path could take the picker.

In one process, one core, no I/O: a :class:`~kvpilot.routing.index.block_index.BlockIndex`
holding ``--warm-prompts`` prompts of ``--prompt-tokens`` tokens per worker (the shape of
``bench_router_scale.py``'s warm fleet), for each worker count of ``--workers``. Then, per
request (a warm prompt of a random worker plus 64 new tokens, ``--requests`` of them):

- ``parse``: msgspec decodes the completions body (the prompt as token ids), as the relay
  and the picker do; ``parse, compiled floor``: numpy's C parser reads the same prompt's
  digits into a uint32 array, no Python object per token (a lower bound for any compiled parser
  of that text);
- ``decision``: :meth:`~kvpilot.routing.decide.router.Router.route` of the parsed prompt (the
  chain, the index match, every candidate's cost); ``hash + match, Dynamo (Rust)``: Dynamo's
  ``compute_block_hash_for_seq`` and ``RadixTree.find_matches`` on the same prompt and the
  same blocks, its compiled index;
- ``event decode`` and ``event apply``: the KV event the request's prefill publishes (one
  ``BlockStored`` of its blocks), decoded from vLLM's msgpack and applied to the index, in
  the router's feeder thread (off the request, but on the same cores and GIL).

Each stage is timed alone over the same requests (the mean and p99 of each), so the sum is
the Python a request costs the router before any I/O. What the picker's process spends beyond
it (gRPC, the event loop, the access log) is in ``bench_fleet.py``'s CPU column::

    python -m benchmarks.bench_request_path --json docs/benchmarks/results/request-path.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from dynamo.llm import RadixTree, compute_block_hash_for_seq

from benchmarks.provenance import provenance, recorded_argv
from kvpilot.routing.config import RouterConfig
from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.router import Router
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.events import BlockStored, EventDecoder

BLOCK_SIZE = 32
"""Tokens per block: the Dynamo mocker's, as in ``bench_router_scale.py``."""
NEW_TOKENS = 64
VOCAB = 50_000
STAGES = ("parse", "parse, compiled floor", "decision", "hash + match, Dynamo (Rust)", "event decode", "event apply")


def _router(workers: int) -> Router:
    config = msgspec.convert(
        {
            "index": {"block_size": BLOCK_SIZE},
            "workers": [
                {"name": f"w{i}", "role": "colocated", "url": f"http://127.0.0.1:1/w{i}"} for i in range(workers)
            ],
        },
        RouterConfig,
    )
    return Router(
        fleet_from_config(config), config, BlockIndex(BLOCK_SIZE), LoadLedger(), SessionStore(BLOCK_SIZE, 16), None
    )


def _stored(rng: random.Random, tokens: list[int]) -> bytes:
    """vLLM's msgpack KV-event batch storing ``tokens``' full blocks from block 0."""
    blocks = len(tokens) // BLOCK_SIZE
    event = BlockStored([rng.getrandbits(63) for _ in range(blocks)], None, tokens[: blocks * BLOCK_SIZE], BLOCK_SIZE)
    return msgspec.msgpack.encode([time.time(), [event]])


def _timed(run: Callable[[int], object], count: int) -> list[float]:
    """Seconds of ``run(i)`` for i in range(count), each alone, the collector off."""
    out = []
    gc.collect()
    gc.disable()
    try:
        for i in range(count):
            start = time.perf_counter()
            run(i)
            out.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return out


def measure(workers: int, prompt_tokens: int, warm_prompts: int, requests: int, seed: int) -> dict[str, Any]:
    """Every stage's mean and p99 (ms) at ``workers`` workers; see the module doc."""
    rng = random.Random(seed)
    router, tree, decoder = _router(workers), RadixTree(), EventDecoder()
    warm: list[tuple[int, list[int]]] = []
    event_id = 0
    for w in range(workers):
        for _ in range(warm_prompts):
            tokens = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
            warm.append((w, tokens))
            router.index.apply_all(WorkerId(f"w{w}"), decoder.decode(_stored(rng, tokens)).events)
            hashes = compute_block_hash_for_seq(tokens, BLOCK_SIZE)
            blocks = [{"block_hash": h, "tokens_hash": h} for h in hashes]
            stored = {"event_id": event_id, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}
            tree.apply_event(w, json.dumps(stored).encode())
            event_id += 1
    tree.find_matches([0])  # waits for the tree's thread to apply them all
    prompts = [rng.choice(warm)[1] + [rng.randrange(VOCAB) for _ in range(NEW_TOKENS)] for _ in range(requests)]
    bodies = [json.dumps({"model": "m", "prompt": p, "max_tokens": 1}).encode() for p in prompts]
    digits = [json.dumps(p)[1:-1] for p in prompts]
    parsed = [msgspec.json.decode(b)["prompt"] for b in bodies]
    events = [_stored(rng, p) for p in prompts]
    decoded = [decoder.decode(e).events[0] for e in events]
    json_decoder = msgspec.json.Decoder()
    fresh = BlockIndex(BLOCK_SIZE)

    def dynamo_match(i: int) -> object:
        return tree.find_matches(compute_block_hash_for_seq(parsed[i], BLOCK_SIZE))

    runs: dict[str, Callable[[int], object]] = {
        "parse": lambda i: json_decoder.decode(bodies[i]),
        "parse, compiled floor": lambda i: np.fromstring(digits[i], dtype=np.uint32, sep=","),
        "decision": lambda i: router.route(parsed[i], f"r{i}"),
        "hash + match, Dynamo (Rust)": dynamo_match,
        "event decode": lambda i: decoder.decode(events[i]),
        "event apply": lambda i: fresh.apply(WorkerId(f"w{i % workers}"), decoded[i]),
    }
    stages = {}
    for name in STAGES:
        runs[name](0)  # warm whatever it builds on first use
        seconds = _timed(runs[name], requests)
        stages[name] = {
            "mean_ms": statistics.fmean(seconds) * 1e3,
            "p99_ms": float(np.quantile(seconds, 0.99)) * 1e3,
        }
    return {
        "workers": workers,
        "index_entries": workers * warm_prompts * (prompt_tokens // BLOCK_SIZE),
        "stages": stages,
    }


def table(results: dict[str, Any]) -> str:
    """The stages per worker count (mean / p99 ms), then the Python stages' sum against the compiled ones'."""
    rows = results["request_path"]
    lines = [
        "| stage | " + " | ".join(f"{r['workers']} workers, mean / p99 ms" for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for name in STAGES:
        cells = [f"{r['stages'][name]['mean_ms']:.3f} / {r['stages'][name]['p99_ms']:.3f}" for r in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    python = ("parse", "decision", "event decode", "event apply")
    compiled = ("parse, compiled floor", "hash + match, Dynamo (Rust)")
    sums = [
        f"{sum(r['stages'][s]['mean_ms'] for s in python):.3f} / {sum(r['stages'][s]['mean_ms'] for s in compiled):.3f}"
        for r in rows
    ]
    lines.append(
        "| **sum of means: kvpilot's four Python stages / the compiled parse and Dynamo's hash + match** | "
        + " | ".join(sums)
        + " |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64,256", help="worker counts, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=14_336)
    parser.add_argument("--warm-prompts", type=int, default=2, help="prompts each worker holds")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    rows = [
        measure(int(w), args.prompt_tokens, args.warm_prompts, args.requests, args.seed)
        for w in args.workers.split(",")
    ]
    results = {"run": {"argv": recorded_argv()}, "provenance": provenance(), "request_path": rows}
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
