from __future__ import annotations

import json

import pytest

from benchmarks.fleet.trace import (
    FIRST_ORDINARY_ID,
    TRACES_DIR,
    PromptShape,
    PromptSynth,
    TraceRequest,
    arrivals,
    ideal_hits,
    load_trace,
    parse_trace,
    reuse_ceiling,
)


def _req(ts: int, length: int, hash_ids: tuple[int, ...], out: int = 4) -> TraceRequest:
    return TraceRequest(ts, length, out, hash_ids)


def test_a_trace_line_parses_and_a_malformed_one_is_named():
    lines = [
        json.dumps({"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}),
        "",
        json.dumps({"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [7]}),
    ]
    assert parse_trace(lines) == [_req(5, 600, (1, 2), 3), _req(9, 10, (7,), 1)]
    assert parse_trace(lines, max_requests=1) == [_req(5, 600, (1, 2), 3)]
    bad = json.dumps({"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [1]})
    with pytest.raises(ValueError, match=r"trace line 2: .*one hash id per 512"):
        parse_trace([lines[0], bad])


def test_arrivals_start_at_zero_and_scale_with_the_rate():
    reqs = [_req(1000, 1, (1,)), _req(1500, 1, (2,)), _req(3000, 1, (3,))]
    assert arrivals(reqs, 1.0) == [0.0, 0.5, 2.0]
    assert arrivals(reqs, 4.0) == [0.0, 0.125, 0.5]
    with pytest.raises(ValueError, match="positive"):
        arrivals(reqs, 0.0)


def test_the_same_hash_id_gives_the_same_tokens_and_another_id_others():
    synth = PromptSynth(PromptShape(tokens_per_hash=64, block_size=32, vocab_size=2048))
    a = synth.prompt(_req(0, 1024, (1, 2)))
    b = synth.prompt(_req(0, 700, (1, 3)))
    assert len(a) == 128 and len(b) == 64 + 24  # 188 of 512 last tokens, scaled by 64/512, rounded up
    assert a[:64] == b[:64] and a[64:] != b[64:88]
    assert all(FIRST_ORDINARY_ID <= t < 2048 for t in a + b)
    again = PromptSynth(PromptShape(tokens_per_hash=64, block_size=32, vocab_size=2048)).prompt(_req(0, 1024, (1, 2)))
    assert again == a  # seeded: the same in every run and every arm
    other_seed = PromptSynth(PromptShape(tokens_per_hash=64, block_size=32, seed=1)).prompt(_req(0, 1024, (1, 2)))
    assert other_seed != a


def test_full_length_prompts_follow_input_length_and_the_cap_keeps_a_prefix():
    shape = PromptShape(block_size=64)
    request = _req(0, 1100, (4, 5, 6))
    assert len(PromptSynth(shape).prompt(request)) == 1100 == shape.input_tokens(request)
    capped = PromptShape(block_size=64, max_input_tokens=1000)
    prompt = PromptSynth(capped).prompt(request)
    assert prompt == PromptSynth(shape).prompt(request)[:1000]
    assert capped.capped(request) and not shape.capped(request)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tokens_per_hash": 0}, "tokens_per_hash"),
        ({"tokens_per_hash": 1024}, "tokens_per_hash"),
        ({"block_size": 48}, "must divide"),
        ({"vocab_size": 7}, "vocab_size"),
        ({"max_input_tokens": 0}, "max_input_tokens"),
    ],
)
def test_bad_shapes_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        PromptShape(**kw)


def test_the_ceiling_counts_full_blocks_whose_whole_prefix_came_before():
    shape = PromptShape(tokens_per_hash=64, block_size=32)
    reqs = [
        _req(0, 1024, (1, 2)),  # 128 tokens, 4 blocks, nothing before it
        _req(1, 1024, (1, 2)),  # all 4 blocks seen: 128 reused
        _req(2, 1024, (1, 9)),  # block 1's 2 blocks: 64
        _req(3, 1024, (9, 2)),  # 2 at position 1 after another first id: nothing
        _req(4, 300, (1,)),  # 38 tokens: 1 full block (seen), 6 computed
    ]
    ceiling = reuse_ceiling(shape, reqs)
    assert ceiling.input_tokens == 128 * 4 + 38
    assert ceiling.reusable_tokens == 128 + 64 + 32
    assert ceiling.distinct_blocks == 4 + 2 + 4
    assert ceiling.reuse == pytest.approx(224 / 550)
    assert ideal_hits(shape, reqs) == ([0, 128, 64, 0, 32], 10)


def test_the_ceiling_on_the_shared_traces_is_what_their_hash_ids_allow():
    path = TRACES_DIR / "mooncake_synthetic_trace.jsonl"
    if not path.exists():
        pytest.skip(f"no {path}")
    reqs = load_trace(path, max_requests=400)
    full = reuse_ceiling(PromptShape(block_size=512), reqs)
    fine = reuse_ceiling(PromptShape(block_size=32), reqs)
    # At 512-token blocks the ceiling is exactly the trace's repeated (prefix, hash id) pairs
    # that are full; smaller blocks can also reuse the full 32-token blocks of a shared
    # partial last block, so never less.
    assert 0.0 < full.reuse <= fine.reuse < 1.0
    scaled = reuse_ceiling(PromptShape(tokens_per_hash=128, block_size=32), reqs)
    assert scaled.input_tokens < full.input_tokens / 3.5  # every block a quarter (the last rounded up)


def test_a_session_id_is_read_where_a_line_has_one_and_must_be_a_string():
    line = {"timestamp": 5, "input_length": 10, "output_length": 3, "hash_ids": [1]}
    named, unnamed = parse_trace([json.dumps({**line, "session_id": "agent-3"}), json.dumps(line)])
    assert (named.session_id, unnamed.session_id) == ("agent-3", None)
    with pytest.raises(ValueError, match=r"trace line 1: a session_id must be a non-empty string"):
        parse_trace([json.dumps({**line, "session_id": 3})])
