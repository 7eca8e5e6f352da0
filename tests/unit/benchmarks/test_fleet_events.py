from __future__ import annotations

from benchmarks.fleet.events import StoredPromptBlocks
from benchmarks.fleet.trace import PromptShape, PromptSynth, TraceRequest, prompt_block_digests


def test_only_blocks_of_the_prompts_count_as_computed_prompt_blocks():
    synth = PromptSynth(PromptShape(tokens_per_hash=64, block_size=32))
    requests = [TraceRequest(0, 1024, 8, (1, 2)), TraceRequest(1, 600, 8, (1, 3))]
    digests = prompt_block_digests(synth, requests)
    assert len(digests) == 4  # (1, 2): 4 blocks; (1, 3): 64 + 11 tokens, its 2 full blocks (1, 2) has too
    counts = StoredPromptBlocks(digests, 32)
    prompt = synth.prompt(requests[0])
    generated = [5] * 32
    counts.stored("w0", prompt[:64])  # one event, two blocks
    counts.stored("w1", prompt[64:96] + generated)
    counts.stored("w1", prompt[96:110])  # a partial block is never stored; ignored if it were
    assert counts.prompt_blocks == {"w0": 2, "w1": 1} and counts.other_blocks == {"w1": 1}
    assert counts.total == 3
