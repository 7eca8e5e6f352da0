"""Events hashed ahead by the thread that reads them (``KVIndex.prepare``) leave the index
exactly as events applied whole do: the same matches, counts and skips."""

from __future__ import annotations

import random

import pytest

from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.events import BlockRemoved, BlockStored

BS = 4


def _events(rng: random.Random) -> list[object]:
    """Chains of stored blocks (some with a LoRA, an extra key, a bad token id, another block
    size, an unknown parent) and removals."""
    events: list[object] = []
    for chain in range(6):
        parent = None
        for step in range(rng.randrange(1, 4)):
            n = rng.randrange(1, 5)
            tokens = [rng.randrange(50) for _ in range(n * BS)]
            hashes = [f"{chain}-{step}-{j}".encode() for j in range(n)]
            kind = rng.random()
            extra = None
            if kind < 0.1:
                extra = [["mm", 1]] * n
            elif kind < 0.15:
                tokens[0] = -1  # refused
            elif kind < 0.2:
                parent = b"never-stored"
            size = 2 * BS if kind > 0.95 else BS
            events.append(BlockStored(hashes, parent, tokens, size, medium="GPU", extra_keys=extra))  # type: ignore[arg-type]
            parent = hashes[-1]
        if rng.random() < 0.3:
            events.append(BlockRemoved([f"{chain}-0-0".encode()], medium="GPU"))  # type: ignore[arg-type]
    return events


@pytest.mark.parametrize("seed", range(25))
def test_prepared_events_apply_as_whole_ones(seed):
    rng = random.Random(seed)
    events = _events(rng)
    whole, ahead = BlockIndex(BS), BlockIndex(BS)
    worker = WorkerId("w")
    whole.apply_all(worker, events)  # type: ignore[arg-type]
    ahead.apply_prepared(worker, ahead.prepare(events))  # type: ignore[arg-type]
    assert whole.counters == ahead.counters
    assert whole.block_count(worker) == ahead.block_count(worker)
    for stored in (e for e in events if isinstance(e, BlockStored)):
        chain = PromptChain(list(stored.token_ids), BS)
        if all(isinstance(t, int) and t >= 0 for t in stored.token_ids):
            assert whole.match(chain) == ahead.match(chain)
