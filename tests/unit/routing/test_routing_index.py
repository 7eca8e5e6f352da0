"""Tests of kvpilot.routing.index.block_index: table-driven cases and a model-based property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.chain import PromptChain, chain_keys
from kvpilot.routing.index.events import AllBlocksCleared, BlockStored
from tests.fakes.kv_events import BLOCK_SIZE as BS
from tests.fakes.kv_events import PROMPTS as BASE
from tests.fakes.kv_events import block_hash, removed, stored

SALTS = [None, "s"]


@pytest.mark.parametrize(
    ("events", "prompt", "salt", "expected"),
    [
        ([stored(BASE[0], 0, 6)], BASE[0], None, {"w": {"GPU": 6}}),
        ([stored(BASE[0], 0, 3), stored(BASE[0], 3, 6)], BASE[0] + [7], None, {"w": {"GPU": 6}}),
        ([stored(BASE[0], 0, 6)], BASE[1], None, {"w": {"GPU": 3}}),  # shared 3-block prefix
        ([stored(BASE[0], 0, 6), removed(BASE[0], [2])], BASE[0], None, {"w": {"GPU": 2}}),
        ([stored(BASE[0], 0, 6), removed(BASE[0], [0])], BASE[0], None, {}),
        ([stored(BASE[0], 0, 6), AllBlocksCleared()], BASE[0], None, {}),
        ([stored(BASE[0], 0, 6, salt="s")], BASE[0], None, {}),  # salted blocks, unsalted prompt
        ([stored(BASE[0], 0, 6)], BASE[0], "s", {}),  # unsalted blocks, salted prompt
        ([stored(BASE[0], 0, 6, salt="s")], BASE[0], "s", {"w": {"GPU": 6}}),
        ([stored(BASE[0], 0, 4), stored(BASE[0], 0, 6, medium="CPU")], BASE[0], None, {"w": {"GPU": 4, "CPU": 6}}),
        (
            [stored(BASE[0], 0, 6), stored(BASE[0], 0, 6, medium="CPU"), removed(BASE[0], [1])],
            BASE[0],
            None,
            {"w": {"GPU": 1, "CPU": 6}},
        ),
        ([stored(BASE[0], 2, 4)], BASE[0], None, {}),  # unknown parent: skipped
        ([stored(BASE[0], 0, 6, group_idx=1)], BASE[0], None, {}),  # another KV group
        ([stored(BASE[2], 0, 4)], BASE[2][:6], None, {"w": {"GPU": 3}}),  # repeated blocks
    ],
)
def test_match_table(events, prompt, salt, expected):
    index = BlockIndex(BS)
    index.apply_all("w", events)
    assert index.match(PromptChain(prompt, BS, cache_salt=salt)).blocks == expected


def test_skips_are_counted_not_raised():
    index = BlockIndex(BS)
    assert index.apply("w", stored(BASE[0], 2, 4)) == "unknown_parent"
    assert index.apply("w", removed(BASE[0], [0])) == "unknown_slot"
    assert index.apply("w", BlockStored([b"x"], None, [1, 2, 3], 3)) == "block_size"
    assert index.counters["unknown_parent"] == 1
    assert index.apply("w", BlockStored([b"y"], None, [1, -2], 2)) == "bad_token_ids"
    assert index.apply("w", BlockStored([b"z"], None, [1, 2**40], 2)) == "bad_token_ids"
    assert index.block_count("w") == 0 and index.match(PromptChain([1, 2, 3, 4], BS)).blocks == {}


def test_chain_keys_continue_incrementally_and_depend_on_position():
    keys = chain_keys(BASE[0], BS, 0, 0)
    assert chain_keys(BASE[0][6:], BS, 3, keys[2]) == keys[3:]
    swapped = BASE[0][2:4] + BASE[0][0:2]
    assert chain_keys(swapped, BS, 0, 0)[1] != keys[1]
    assert len(set(chain_keys([5, 5] * 6, BS, 0, 0))) == 6


def test_remove_worker_frees_its_slots_and_restart_clears():
    index = BlockIndex(BS)
    index.apply("a", stored(BASE[0], 0, 6))
    index.apply("b", stored(BASE[0], 0, 2))
    index.remove_worker("a")
    assert index.workers() == ["b"]
    index.apply("c", stored(BASE[1], 0, 5))  # reuses a's bit
    assert index.match(PromptChain(BASE[0], BS)).blocks == {"b": {"GPU": 2}, "c": {"GPU": 3}}
    index.clear_worker("c")
    assert index.block_count("c") == 0


def test_incremental_match_sees_removals_and_new_blocks():
    index = BlockIndex(BS)
    index.apply("a", stored(BASE[0], 0, 4))
    chain = PromptChain(BASE[0] + [77], BS, incremental=True)
    assert index.match(chain).blocks == {"a": {"GPU": 4}}
    index.apply("a", stored(BASE[0], 4, 6))
    assert index.match(chain).blocks == {"a": {"GPU": 6}}
    index.apply("a", removed(BASE[0], [2]))
    assert index.match(chain).blocks == {"a": {"GPU": 2}}
    chain.extend([78, 79])
    assert index.match(chain).blocks == {"a": {"GPU": 2}}


def reference(held, prompt, salt):
    out = {}
    for (worker, tier), prefixes in held.items():
        d = 0
        while d < len(prompt) // BS and (salt, tuple(prompt[: (d + 1) * BS])) in prefixes:
            d += 1
        if d:
            out.setdefault(worker, {})[tier] = d
    return out


op = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from("ab"),
        st.sampled_from(["GPU", "CPU"]),
        st.integers(0, 2),
        st.sampled_from([0, 0, 0, 2, 3]),
        st.integers(1, 6),
        st.sampled_from(SALTS),
    ),
    st.tuples(
        st.just("remove"),
        st.sampled_from("ab"),
        st.sampled_from(["GPU", "CPU"]),
        st.integers(0, 2),
        st.lists(st.integers(0, 5), max_size=3),
        st.sampled_from(SALTS),
    ),
    st.tuples(st.just("clear"), st.sampled_from("ab")),
    st.tuples(st.just("drop"), st.sampled_from("ab")),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(op, max_size=25), st.integers(0, 2), st.sampled_from(SALTS), st.integers(1, 4))
def test_full_and_incremental_match_equal_the_model(ops, which, salt, log_capacity):
    index = BlockIndex(BS, log_capacity=log_capacity)
    held: dict = {}
    names: dict = {}  # worker -> engine hashes the worker announced (any tier)
    prompt = BASE[which] + [77]
    chain = PromptChain(list(prompt), BS, cache_salt=salt, incremental=True)
    for o in ops:
        if o[0] == "store":
            _, w, tier, p, a, n, s = o
            toks, b = BASE[p], min(6 if p != 1 else 5, a + n)
            if a >= b:
                continue
            ok = a == 0 or block_hash(toks, a - 1, s) in names.get(w, set())
            index.apply(w, stored(toks, a, b, salt=s, medium=tier))
            if ok:
                for k in range(a, b):
                    held.setdefault((w, tier), set()).add((s, tuple(toks[: (k + 1) * BS])))
                    names.setdefault(w, set()).add(block_hash(toks, k, s))
        elif o[0] == "remove":
            _, w, tier, p, ks, s = o
            toks = BASE[p]
            ks = [k for k in ks if k < len(toks) // BS]
            index.apply(w, removed(toks, ks, salt=s, medium=tier))
            for k in ks:
                held.get((w, tier), set()).discard((s, tuple(toks[: (k + 1) * BS])))
                still = any((s, tuple(toks[: (k + 1) * BS])) in held.get((w, t), ()) for t in ("GPU", "CPU"))
                if not still:
                    names.get(w, set()).discard(block_hash(toks, k, s))
        else:
            w = o[1]
            index.clear_worker(w) if o[0] == "clear" else index.remove_worker(w)
            held = {slot: v for slot, v in held.items() if slot[0] != w}
            names.pop(w, None)
        want = reference(held, prompt, salt)
        assert index.match(chain).blocks == want
        assert index.match(PromptChain(prompt, BS, cache_salt=salt)).blocks == want
        for (w, tier), blocks in held.items():  # each slot's count, kept without per-slot key sets
            assert index.block_count(w, tier) == len(blocks)
        # a name shared between workers stays only while a slot holds its block (no leak)
        assert all(key in index._masks[ns] for ns, shared in index._shared_names.items() for key in shared)


def test_a_long_prompt_is_named_the_same_when_packed_whole():
    tokens = [(i * 7919) % 50_000 for i in range(10_000)]
    chain = PromptChain(tokens, 16)
    assert chain.keys(10) == chain_keys(tokens[:160], 16, 0, 0)
    assert chain.keys(625) == chain_keys(tokens, 16, 0, 0)  # past 4,096 tokens: packed once
    assert tokens == [(i * 7919) % 50_000 for i in range(10_000)]  # the caller's list untouched
