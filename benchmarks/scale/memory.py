"""Index memory per (block, worker) entry, for one index backend in a process of its own
(the scale benchmark runs one per backend, shape and way of measuring, so that no run
inherits another's heap).

``--workers`` workers each store ``--blocks`` blocks (block size 16), as vLLM
``BlockStored`` events of 32 blocks carrying their token ids, applied with the backend's
own ``apply``. Shapes: ``distinct`` (no two workers hold the same block: entries =
distinct blocks) and ``shared`` (every worker holds the same chains: one block, many
workers, as a prefix cached fleet-wide). Ways of measuring: ``rss`` (the process's
resident set after building, less before, after a GC: everything, Rust's RadixTree
included, and what the allocators keep) and ``tracemalloc`` (Python objects still
allocated: not Dynamo's RadixTree, which lives in Rust). ``--backend radix-tree`` is
Dynamo's ``RadixTree`` alone, fed Dynamo's own events (``apply_event``, its block and
token hashes precomputed as a Dynamo worker's publisher sends them): Dynamo's index
without kvpilot's wrapper (:mod:`kvpilot.routing.index.dynamo` keeps, per worker, the engine
hashes it holds and their namespaces), the control for Dynamo's own figure. Prints one
JSON object.

    python -m benchmarks.scale.memory --backend kvpilot --shape shared --measure rss
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import sys
import tracemalloc
from array import array

from kvpilot.routing.config import IndexBackend
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.events import BlockStored
from kvpilot.routing.index.kvindex import KVIndex

BLOCK_SIZE, EVENT_BLOCKS = 16, 32
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def make_index(backend: IndexBackend) -> KVIndex:
    if backend is IndexBackend.DYNAMO:
        from kvpilot.routing.index.dynamo import DynamoIndex

        return DynamoIndex(BLOCK_SIZE)
    from kvpilot.routing.index.block_index import BlockIndex

    return BlockIndex(BLOCK_SIZE)


def chain_tokens(chain: int) -> list[int]:
    """Chain ``chain``'s tokens: a fixed seeded run, the same on every worker."""
    return array("H", random.Random(chain).randbytes(2 * EVENT_BLOCKS * BLOCK_SIZE)).tolist()


def ehash(chain: int, k: int) -> int:
    """The engine's hash of block ``k`` of ``chain`` (engines sharing a seed agree)."""
    return (chain * 1_000_003 + k + 1) & ((1 << 63) - 1)


RADIX_TREE = "radix-tree"


class BareRadixTree:
    """Dynamo's ``RadixTree`` fed Dynamo's own stored events (see the module doc)."""

    def __init__(self) -> None:
        from dynamo.llm import RadixTree, compute_block_hash_for_seq

        self.tree = RadixTree()
        self.local = compute_block_hash_for_seq
        self.counters = {"applied": 0}
        self._ids: dict[str, int] = {}

    def apply(self, worker: WorkerId, ev: BlockStored) -> str:
        wid = self._ids.setdefault(worker, len(self._ids))
        local = self.local(ev.token_ids, BLOCK_SIZE)
        blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(ev.block_hashes, local, strict=True)]
        self.counters["applied"] += 1
        event = {"event_id": self.counters["applied"], "data": {"stored": {"parent_hash": None, "blocks": blocks}}}
        self.tree.apply_event(wid, json.dumps(event).encode())
        return "applied"


def build(index: KVIndex | BareRadixTree, workers: int, blocks: int, shared: bool) -> int:
    """Every worker stores ``blocks`` blocks (chains of one event each); returns entries."""
    chains = blocks // EVENT_BLOCKS
    for w in range(workers):
        worker = WorkerId(f"w{w}")
        for c in range(chains):
            chain = c if shared else w * chains + c
            hashes: list[bytes | int] = [ehash(chain, k) for k in range(EVENT_BLOCKS)]
            index.apply(worker, BlockStored(hashes, None, chain_tokens(chain), BLOCK_SIZE, medium="GPU"))
    return workers * chains * EVENT_BLOCKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backends = [*(b.value for b in IndexBackend), RADIX_TREE]
    parser.add_argument("--backend", choices=backends, default=IndexBackend.KVPILOT.value)
    parser.add_argument("--shape", choices=["distinct", "shared"], default="distinct")
    parser.add_argument("--measure", choices=["rss", "tracemalloc"], default="rss")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=8192, help="blocks per worker (a multiple of 32)")
    args = parser.parse_args(argv)
    index = BareRadixTree() if args.backend == RADIX_TREE else make_index(IndexBackend(args.backend))
    chain_tokens(0)  # warm the harness's own code paths before the baseline
    gc.collect()
    if args.measure == "tracemalloc":
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if args.measure == "tracemalloc" else rss_bytes()
    entries = build(index, args.workers, args.blocks, args.shape == "shared")
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if args.measure == "tracemalloc" else rss_bytes()
    applied = index.counters["applied"]
    out = {
        "backend": args.backend,
        "shape": args.shape,
        "measure": args.measure,
        "workers": args.workers,
        "blocks_per_worker": args.blocks,
        "entries": entries,
        "events_applied": applied,
        "bytes": after - before,
        "bytes_per_entry": (after - before) / entries,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(out))
    return 0 if applied == entries // EVENT_BLOCKS else 1


if __name__ == "__main__":
    sys.exit(main())
