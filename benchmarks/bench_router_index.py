"""kvpilot's block index against Dynamo's RadixTree + compute_block_hash_for_seq.

One synthetic stream, both sides in one process, pinned to one core, timed
alternately so they share the box's noise::

    taskset -c 1 python -m benchmarks.bench_router_index

Stream: 16 workers x ~50K blocks of 16 tokens, as vLLM BlockStored events of
32 blocks (msgpack, int block hashes derived from content, as engines sharing a
seed publish). Worker 0 holds a 64K-token prompt X, workers 1-3 its first 32K.

Ingest, blocks/s: kvpilot decodes vLLM's msgpack and applies it. Dynamo "same
stream" decodes the same bytes, hashes token_ids with compute_block_hash_for_seq
and applies a RouterEvent; Dynamo "apply only" gets pre-built RouterEvents
(what its Rust publisher would send) and is its best case.

Decisions, a 64K-token prompt the router has no session for: (a) nothing
cached, (b) X's first 32K cached on 4 workers then 32K new, (c) all of X.
kvpilot: PromptChain + BlockIndex.match; Dynamo: hash + find_matches. The
"+cost" row adds kvpilot's full cost over 16 workers.

Agent session, step 20: prompt 63,000 tokens, 1,650 new since step 19; between
steps the serving worker stores the last prompt's blocks and other workers
churn (stores and removals). Step 20's prompt is freshly parsed from JSON for
every trial, as the router receives it. kvpilot: SessionState.advance (compares the whole
prompt) or .extend (the front passes the new tokens) + match; Dynamo: hash the
whole prompt + find_matches (it has no incremental path).
"""

from __future__ import annotations

import gc
import json
import os
import random
import time
from array import array
from typing import Any

import msgspec
from dynamo.llm import RadixTree, compute_block_hash_for_seq

from kvpilot.routing.config import CostConfig, TierClass
from kvpilot.routing.decide.cost import Candidate, CandidateTable, CostModel, tier_overlap
from kvpilot.routing.decide.ledger import WorkerLoad
from kvpilot.routing.decide.sessions import SessionState
from kvpilot.routing.ids import DEFAULT_TIER, WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.events import BlockRemoved, BlockStored, EventDecoder

BS, WORKERS, PER_WORKER, EVENT_BLOCKS, CHAIN = 16, 16, 50_000, 32, 1024
TRIALS = 200
rng = random.Random(0)


def tokens(n: int) -> list[int]:
    return array("H", rng.randbytes(2 * n)).tolist()


def ehash(chain_id: int, k: int) -> int:
    return (chain_id * 1_000_003 + k) & ((1 << 63) - 1)


class Stream:
    """Per worker: (chain_id, tokens, first block, last block) spans to store."""

    def __init__(self) -> None:
        self.x = tokens(65536)
        self.chains: dict[int, list[int]] = {0: self.x}
        self.spans: list[tuple[int, int, int, int]] = []  # worker, chain, a, b
        next_id = 1
        for w in range(WORKERS):
            held = 0
            if w < 4:
                nb = 4096 if w == 0 else 2048
                self.spans += [(w, 0, a, min(nb, a + EVENT_BLOCKS)) for a in range(0, nb, EVENT_BLOCKS)]
                held = nb
            while held < PER_WORKER:
                self.chains[next_id] = tokens(CHAIN * BS)
                self.spans += [(w, next_id, a, a + EVENT_BLOCKS) for a in range(0, CHAIN, EVENT_BLOCKS)]
                held += CHAIN
                next_id += 1
        self.blocks = sum(b - a for _, _, a, b in self.spans)


def ours_msg(chain: list[int], cid: int, a: int, b: int) -> bytes:
    ev = BlockStored(
        [ehash(cid, k) for k in range(a, b)], ehash(cid, a - 1) if a else None, chain[a * BS : b * BS], BS, medium="GPU"
    )
    return msgspec.msgpack.encode([time.time(), [ev]])


def dyn_event(msg: dict[str, Any], eid: int) -> bytes:
    local = compute_block_hash_for_seq(msg["token_ids"], BS)
    blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(msg["block_hashes"], local, strict=False)]
    return json.dumps(
        {"event_id": eid, "data": {"stored": {"parent_hash": msg["parent_block_hash"], "blocks": blocks}}}
    ).encode()


def dyn_remove(hashes: list[int], eid: int) -> bytes:
    return json.dumps({"event_id": eid, "data": {"removed": {"block_hashes": hashes}}}).encode()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def ingest(stream: Stream) -> tuple[BlockIndex, RadixTree, dict[str, float]]:
    msgs = [(WorkerId(f"w{w}"), w, ours_msg(stream.chains[c], c, a, b)) for w, c, a, b in stream.spans]
    results: dict[str, list[float]] = {"ours": [], "dyn_same": [], "dyn_apply": []}
    for _ in range(3):
        gc.collect()
        dec, index = EventDecoder(), BlockIndex(BS)
        t = time.perf_counter()
        for worker, _, m in msgs:
            index.apply_all(worker, dec.decode(m).events)
        results["ours"].append(stream.blocks / (time.perf_counter() - t))
        del index
        gc.collect()
        tree = RadixTree()
        t = time.perf_counter()
        for i, (_, w, m) in enumerate(msgs):
            tree.apply_event(w, dyn_event(msgspec.msgpack.decode(m)[1][0], i))
        tree.find_matches([0])  # waits for the tree's worker thread
        results["dyn_same"].append(stream.blocks / (time.perf_counter() - t))
    prebuilt = [(w, dyn_event(msgspec.msgpack.decode(m)[1][0], i)) for i, (_, w, m) in enumerate(msgs)]
    del tree
    gc.collect()
    tree = RadixTree()
    t = time.perf_counter()
    for w, e in prebuilt:
        tree.apply_event(w, e)
    tree.find_matches([0])
    results["dyn_apply"].append(stream.blocks / (time.perf_counter() - t))
    index, dec = BlockIndex(BS), EventDecoder()
    for worker, _, m in msgs:
        index.apply_all(worker, dec.decode(m).events)
    return index, tree, {k: max(v) for k, v in results.items()}


def decide_all(index: BlockIndex, model: CostModel, chain: PromptChain) -> str:
    match = index.match(chain)
    tiers = {"GPU": TierClass.GPU}
    cands = CandidateTable.of(
        [
            Candidate(f"w{w}", tier_overlap(match.blocks.get(WorkerId(f"w{w}"), {}), tiers), WorkerLoad())
            for w in range(WORKERS)
        ]
    )
    return model.decide("bench", chain.num_blocks, cands).chosen


def cold(index: BlockIndex, tree: RadixTree, stream: Stream) -> list[tuple[str, list[float], list[float]]]:
    prompts = {
        "(a) nothing cached": tokens(65536),
        "(b) 32K cached on 4 workers": stream.x[:32768] + tokens(32768),
        "(c) all 64K cached on worker 0": stream.x,
    }
    model = CostModel(CostConfig())
    rows = []
    for name, p in prompts.items():
        ours, full, dyn = [], [], []
        for _ in range(TRIALS):
            t = time.perf_counter()
            index.match(PromptChain(p, BS))
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            tree.find_matches(compute_block_hash_for_seq(p, BS))
            dyn.append(time.perf_counter() - t)
            t = time.perf_counter()
            decide_all(index, model, PromptChain(p, BS))
            full.append(time.perf_counter() - t)
        rows.append((f"cold 64K {name}", ours, dyn))
        rows.append((f"cold 64K {name} +cost", full, dyn))
    return rows


def chain_of(state: SessionState) -> PromptChain:
    """The session's chain, which its first ``advance`` or ``extend`` made."""
    if state.chain is None:
        raise RuntimeError("the session has no prompt yet")
    return state.chain


def session(index: BlockIndex, tree: RadixTree, stream: Stream) -> list[tuple[str, list[float], list[float]]]:
    seq = tokens(63000)
    lengths = [63000 - (20 - k) * 1650 for k in range(1, 21)]
    sid, worker = 10**6, 5
    churn_rng, eid = random.Random(1), 10**7
    stats = {"dynamo_refused_removals": 0}
    by_worker: dict[int, list[tuple[int, int, int, int]]] = {}
    for span in stream.spans:
        if span[1] != 0:
            by_worker.setdefault(span[0], []).append(span)
    sessions = [SessionState(BS) for _ in range(TRIALS)]
    extenders = [SessionState(BS) for _ in range(TRIALS)]

    def store_prompt(n_tokens: int, done: int) -> int:
        nonlocal eid
        nb = n_tokens // BS
        for a in range(done, nb, EVENT_BLOCKS):
            b = min(nb, a + EVENT_BLOCKS)
            raw = ours_msg(seq, sid, a, b)
            index.apply_all(WorkerId(f"w{worker}"), EventDecoder().decode(raw).events)
            tree.apply_event(worker, dyn_event(msgspec.msgpack.decode(raw)[1][0], eid))
            eid += 1
        return nb

    def churn() -> None:
        nonlocal eid
        for _ in range(8):
            w = churn_rng.randrange(WORKERS)
            _, c, _a, b = by_worker[w].pop(churn_rng.randrange(len(by_worker[w])))
            gone = [ehash(c, k) for k in range(b - 4, b)]
            index.apply(WorkerId(f"w{w}"), BlockRemoved(list(gone), medium="GPU"))
            try:
                tree.apply_event(w, dyn_remove(gone, eid))
            except RuntimeError:  # Dynamo refuses removing a block that still has children
                stats["dynamo_refused_removals"] += 1
            eid += 1

    done = 0
    for step, n in enumerate(lengths[:-1]):
        for s in sessions:
            s.advance(seq[:n])
            index.match(chain_of(s))
        for s in extenders:
            s.extend(seq[lengths[step - 1] if step else 0 : n])
            index.match(chain_of(s))
        done = store_prompt(n, done)
        churn()
    # Each step's prompt arrives as freshly parsed ints (JSON body or tokenizer), not
    # as the very int objects of the last prompt: list compares cannot take the
    # identity shortcut, so give every trial its own copy.
    raw20, raw_new = msgspec.json.encode(seq[: lengths[-1]]), msgspec.json.encode(seq[lengths[-2] : lengths[-1]])
    adv, ext, dyn = [], [], []
    for s, e in zip(sessions, extenders, strict=True):
        prompt20, new = msgspec.json.decode(raw20), msgspec.json.decode(raw_new)
        t = time.perf_counter()
        s.advance(prompt20)
        index.match(chain_of(s))
        adv.append(time.perf_counter() - t)
        t = time.perf_counter()
        e.extend(new)
        index.match(chain_of(e))
        ext.append(time.perf_counter() - t)
        t = time.perf_counter()
        tree.find_matches(compute_block_hash_for_seq(prompt20, BS))
        dyn.append(time.perf_counter() - t)
    check = index.match(chain_of(sessions[0])).blocks.get(WorkerId(f"w{worker}"), {}).get(DEFAULT_TIER)
    assert check == lengths[-2] // BS, check
    print(f"session churn: {stats}")
    return [("session step 20, advance(full prompt)", adv, dyn), ("session step 20, extend(new tokens)", ext, dyn)]


def main() -> None:
    t0 = time.perf_counter()
    stream = Stream()
    # The synthetic stream's 13M token ints are the harness's, not the router's: keep the
    # cyclic GC from re-scanning them (the indexes built below stay subject to it).
    gc.collect()
    gc.freeze()
    print(
        f"stream: {WORKERS} workers, {stream.blocks} blocks of {BS} tokens, "
        f"{len(stream.spans)} events; affinity={sorted(os.sched_getaffinity(0))}"
    )
    index, tree, rates = ingest(stream)
    print("\n| measure | kvpilot | Dynamo | ratio (kvpilot/Dynamo) |\n|---|---|---|---|")
    for key, label in (("dyn_same", "same vLLM stream"), ("dyn_apply", "RadixTree.apply_event only")):
        print(
            f"| ingest blocks/s vs {label} | {rates['ours']:,.0f} | {rates[key]:,.0f} | "
            f"{rates['ours'] / rates[key]:.2f}x (target >= 1.0) |"
        )
    for name, ours, dyn in cold(index, tree, stream) + session(index, tree, stream):
        target = "0.1" if name.startswith("session") else "1.0"
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            print(
                f"| {name} {label} us | {pct(ours, q):,.0f} | {pct(dyn, q):,.0f} | "
                f"{pct(ours, q) / pct(dyn, q):.3f}x (target <= {target}) |"
            )
    print(f"\n{TRIALS} trials per decision row, sides alternated; total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
