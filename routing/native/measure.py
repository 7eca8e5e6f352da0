"""CPU per decision: the compiled core (``bench_decision.c``, the Envoy module's steps) against
the Python router (``Router.route`` of a simulator placement) on the same prompt, fleet and
cached prefixes; and a body's parse (C against ``json.loads`` and msgspec). Prints JSON.

    .venv/bin/python -m kvpilot.routing.native.measure --workers 64 --ids 12000
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

HERE = Path(__file__).parent
SOURCES = ["bench_decision.c", "kvp_index.c", "kvp_cost.c", "kvp_msgpack.c", "kvp_body.c"]


def _workload(workers: int, n_ids: int, block: int, seed: int) -> tuple[list[int], bytes, list[tuple[int, list[int]]]]:
    """A prompt, its completions body, and per worker a cached prefix of it (a random depth)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(7, 32_000) for _ in range(n_ids)]
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 16}).encode()
    blocks = n_ids // block
    stored = [(w, prompt[: rng.randrange(0, blocks + 1) * block]) for w in range(workers)]
    return prompt, body, [(w, toks) for w, toks in stored if toks]


def _c_side(
    workers: int,
    prompt: list[int],
    body: bytes,
    stored: list[tuple[int, list[int]]],
    block: int,
    iterations: int,
    keep: Path | None,
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        exe, data = folder / "bench_decision", folder / "workload"
        flags = ["-O2", "-std=c11", "-D_GNU_SOURCE"]
        subprocess.run(["gcc", *flags, "-o", str(exe), *(str(HERE / s) for s in SOURCES)], check=True)
        words = [block, workers, len(prompt), *prompt]
        padded = body + b" " * (-len(body) % 4)
        parts = [np.array([*words, len(body)], dtype="<u4").tobytes(), padded]
        for worker, tokens in stored:
            parts.append(np.array([worker, len(tokens), *tokens], dtype="<u4").tobytes())
        data.write_bytes(b"".join(parts))
        out = subprocess.run([str(exe), str(data), str(iterations)], check=True, capture_output=True, text=True)
        result: dict[str, float] = json.loads(out.stdout)
        return result


def _python_side(
    workers: int, prompt: list[int], body: bytes, stored: list[tuple[int, list[int]]], iterations: int
) -> dict[str, float]:
    from benchmarks.sim.fleet import DEFAULT_SPEC
    from benchmarks.sim.kvpilot import KvpilotPlacement
    from kvpilot.routing.index.events import BlockStored

    placement = KvpilotPlacement(workers, DEFAULT_SPEC)
    block = DEFAULT_SPEC.block_size
    for worker, tokens in stored:
        hashes = [(worker << 32) | j for j in range(len(tokens) // block)]
        placement.index.apply(placement.names[worker], BlockStored(hashes, None, tokens, block, medium="GPU"))  # type: ignore[arg-type]
    router, decoder = placement.router, msgspec.json.Decoder()
    t0 = time.process_time()
    for i in range(iterations):
        router.route(prompt, str(i))
    t1 = time.process_time()
    for _ in range(iterations):
        json.loads(body)
    t2 = time.process_time()
    for _ in range(iterations):
        decoder.decode(body)
    t3 = time.process_time()
    return {
        "route_us": 1e6 * (t1 - t0) / iterations,
        "json_loads_us": 1e6 * (t2 - t1) / iterations,
        "msgspec_us": 1e6 * (t3 - t2) / iterations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--ids", type=int, default=12_000)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep the C benchmark and its workload here (for callgrind)")
    args = parser.parse_args()
    block = 64
    prompt, body, stored = _workload(args.workers, args.ids, block, args.seed)
    c = _c_side(args.workers, prompt, body, stored, block, args.iterations * 10, args.keep)
    py = _python_side(args.workers, prompt, body, stored, args.iterations)
    print(json.dumps({"workers": args.workers, "ids": args.ids, "body_bytes": len(body), "c": c, "python": py}))


if __name__ == "__main__":
    main()
