"""DynamoIndex against BlockIndex: the same scenarios, the same matches.

Every scenario runs on both backends (the ``backend`` fixture) against the
same expected matches; the last tests pin the differences the
kvpilot.routing.index.dynamo docstring lists.
"""

from __future__ import annotations

import pytest

from kvpilot.routing.index.block_index import BlockIndex, PromptChain
from kvpilot.routing.index.dynamo import DynamoIndex
from kvpilot.routing.index.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.fakes.kv_events import BLOCK_SIZE as BS
from tests.fakes.kv_events import PROMPTS as BASE
from tests.fakes.kv_events import block_hash, removed, stored

BACKENDS = {"kvpilot": BlockIndex, "dynamo": DynamoIndex}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]


@pytest.mark.parametrize(
    ("events", "prompt", "salt", "expected"),
    [
        ([stored(BASE[0], 0, 6)], BASE[0], None, {"w": {"GPU": 6}}),
        ([stored(BASE[0], 0, 6, as_int=True)], BASE[0], None, {"w": {"GPU": 6}}),  # int hashes >= 2**63
        ([stored(BASE[0], 0, 3), stored(BASE[0], 3, 6)], BASE[0] + [7], None, {"w": {"GPU": 6}}),
        ([stored(BASE[0], 0, 6)], BASE[1], None, {"w": {"GPU": 3}}),  # shared 3-block prefix
        ([stored(BASE[0], 0, 6), removed(BASE[0], [2])], BASE[0], None, {"w": {"GPU": 2}}),
        ([stored(BASE[0], 0, 6), removed(BASE[0], [5, 4])], BASE[0], None, {"w": {"GPU": 4}}),
        ([stored(BASE[0], 0, 6), removed(BASE[0], [0])], BASE[0], None, {}),
        ([stored(BASE[0], 0, 6), AllBlocksCleared()], BASE[0], None, {}),
        ([stored(BASE[0], 0, 6, salt="s")], BASE[0], None, {}),  # salted blocks, unsalted prompt
        ([stored(BASE[0], 0, 6)], BASE[0], "s", {}),  # unsalted blocks, salted prompt
        ([stored(BASE[0], 0, 6, salt="s")], BASE[0], "s", {"w": {"GPU": 6}}),
        ([stored(BASE[0], 0, 6, salt="s")], BASE[0], "t", {}),  # another salt
        ([stored(BASE[0], 0, 4), stored(BASE[0], 0, 6, medium="CPU")], BASE[0], None, {"w": {"GPU": 4, "CPU": 6}}),
        (
            [stored(BASE[0], 0, 6), stored(BASE[0], 0, 6, medium="CPU"), removed(BASE[0], [1])],
            BASE[0],
            None,
            {"w": {"GPU": 1, "CPU": 6}},
        ),
        ([stored(BASE[0], 0, 6), stored(BASE[0], 0, 6, medium="CPU"), AllBlocksCleared()], BASE[0], None, {}),
        ([stored(BASE[0], 0, 6, medium=None)], BASE[0], None, {"w": {"GPU": 6}}),  # None reads GPU
        ([stored(BASE[0], 2, 4)], BASE[0], None, {}),  # unknown parent: skipped
        ([stored(BASE[0], 0, 6, group_idx=1)], BASE[0], None, {}),  # another KV group
        ([stored(BASE[0], 0, 6, group_idx=0)], BASE[0], None, {"w": {"GPU": 6}}),
        ([stored(BASE[2], 0, 4)], BASE[2][:6], None, {"w": {"GPU": 3}}),  # repeated blocks
        ([stored(BASE[0], 0, 6)], BASE[0][:1], None, {}),  # no full block
    ],
)
def test_match_table(backend, events, prompt, salt, expected):
    index = backend(BS)
    index.apply_all("w", events)
    match = index.match(PromptChain(prompt, BS, cache_salt=salt))
    assert match.blocks == expected
    assert match.prompt_blocks == len(prompt) // BS


def test_prefix_depth_per_worker_and_tier(backend):
    index = backend(BS)
    index.apply("a", stored(BASE[0], 0, 6))
    index.apply("b", stored(BASE[1], 0, 5))
    index.apply("b", stored(BASE[0], 0, 2, medium="CPU"))
    index.apply("c", stored(BASE[2], 0, 4))
    assert index.match(PromptChain(BASE[0], BS)).blocks == {"a": {"GPU": 6}, "b": {"GPU": 3, "CPU": 2}}
    assert index.match(PromptChain(BASE[1], BS)).blocks == {"a": {"GPU": 3}, "b": {"GPU": 5, "CPU": 2}}
    assert index.match(PromptChain([], BS)).blocks == {}


def test_lora_and_salt_namespace(backend):
    """vLLM puts (lora, salt) in block 0's extra keys and the LoRA name in the others'."""
    index = backend(BS)
    extra = [["lora", "s"]] + [["lora"]] * 5
    ev = BlockStored(
        [block_hash(BASE[0], k, "ls") for k in range(6)], None, BASE[0], BS, lora_name="lora", extra_keys=extra
    )
    assert index.apply("w", ev) == "applied"
    assert (
        index.apply(
            "w",
            BlockStored([b"next"], block_hash(BASE[0], 5, "ls"), [7, 8], BS, lora_name="lora", extra_keys=[["lora"]]),
        )
        == "applied"
    )
    prompt = BASE[0] + [7, 8]
    assert index.match(PromptChain(prompt, BS, lora_name="lora", cache_salt="s")).blocks == {"w": {"GPU": 7}}
    assert index.match(PromptChain(prompt, BS, cache_salt="s")).blocks == {}
    assert index.match(PromptChain(prompt, BS, lora_name="lora")).blocks == {}


def test_skips_are_counted_not_raised(backend):
    index = backend(BS)
    index.apply("w", stored(BASE[0], 0, 3))
    assert index.apply("w", stored(BASE[0], 4, 6)) == "unknown_parent"
    assert index.apply("w", removed(BASE[0], [0], medium="CPU")) == "unknown_slot"
    assert index.apply("v", removed(BASE[0], [0])) == "unknown_slot"
    assert index.apply("w", BlockStored([b"x"], None, [1, 2, 3], 3)) == "block_size"
    assert index.apply("w", stored(BASE[1], 0, 5, group_idx=1)) == "other_group"
    assert index.apply("w", BlockRemoved([block_hash(BASE[0], 0, None)], group_idx=2)) == "other_group"
    assert index.apply("w", BlockStored([b"y"], None, [1, -2], BS)) == "bad_token_ids"
    assert index.apply("w", removed(BASE[1], [4, 0])) == "applied"  # 4 unknown, 0 removed
    assert index.counters == {
        "applied": 2,
        "unknown_parent": 1,
        "unknown_slot": 2,
        "block_size": 1,
        "other_group": 2,
        "bad_token_ids": 1,
        "unknown_block": 1,
        "blocks_stored": 3,
        "blocks_removed": 1,
    }
    assert index.match(PromptChain(BASE[0], BS)).blocks == {}
    assert index.workers() == ["w"]


def test_block_count_follows_stores_and_removals(backend):
    index = backend(BS)
    index.apply("w", stored(BASE[0], 0, 6))
    index.apply("w", stored(BASE[0], 0, 3, medium="CPU"))
    index.apply("w", removed(BASE[0], [5, 4]))
    assert (index.block_count("w"), index.block_count("w", "CPU")) == (4, 3)
    assert index.block_count("w", "STORAGE") == index.block_count("x") == 0
    assert (index.counters["blocks_stored"], index.counters["blocks_removed"]) == (9, 2)


def test_clear_worker_forgets_all_tiers_and_names(backend):
    index = backend(BS)
    index.apply("w", stored(BASE[0], 0, 3))
    index.apply("w", stored(BASE[0], 0, 3, medium="CPU"))
    index.apply("v", stored(BASE[0], 0, 2))
    assert index.apply("w", AllBlocksCleared()) == "applied"
    assert (index.block_count("w"), index.block_count("w", "CPU")) == (0, 0)
    assert index.apply("w", stored(BASE[0], 3, 6)) == "unknown_parent"
    assert index.match(PromptChain(BASE[0], BS)).blocks == {"v": {"GPU": 2}}
    assert index.apply("w", stored(BASE[0], 0, 6)) == "applied"  # the restarted engine refills
    assert index.match(PromptChain(BASE[0], BS)).blocks == {"v": {"GPU": 2}, "w": {"GPU": 6}}


def test_remove_worker(backend):
    index = backend(BS)
    index.apply("a", stored(BASE[0], 0, 6))
    index.apply("b", stored(BASE[0], 0, 2))
    index.remove_worker("a")
    index.remove_worker("nobody")
    assert index.workers() == ["b"]
    assert index.block_count("a") == 0
    assert index.apply("a", removed(BASE[0], [0])) == "unknown_slot"
    index.apply("c", stored(BASE[1], 0, 5))
    assert index.match(PromptChain(BASE[0], BS)).blocks == {"b": {"GPU": 2}, "c": {"GPU": 3}}
    index.apply("a", stored(BASE[0], 0, 1))  # back again
    assert index.match(PromptChain(BASE[0], BS)).blocks == {"a": {"GPU": 1}, "b": {"GPU": 2}, "c": {"GPU": 3}}
    index.clear_worker("c")
    assert index.block_count("c") == 0
    assert sorted(index.workers()) == ["a", "b", "c"]


def test_backends_agree_event_by_event():
    stream = [
        ("a", stored(BASE[0], 0, 4)),
        ("b", stored(BASE[1], 0, 5)),
        ("a", stored(BASE[0], 4, 6)),
        ("b", stored(BASE[0], 0, 6, salt="s")),
        ("a", stored(BASE[0], 0, 6, medium="CPU")),
        ("a", removed(BASE[0], [5])),
        ("b", removed(BASE[1], [4, 3])),
        ("a", stored(BASE[0], 5, 6)),
        ("b", removed(BASE[0], [0], salt="s")),
        ("a", AllBlocksCleared()),
        ("b", stored(BASE[2], 0, 4)),
    ]
    prompts = [(p, salt) for p in [*BASE, BASE[0][:5], BASE[2][:3]] for salt in (None, "s")]
    ours, dyn = BlockIndex(BS), DynamoIndex(BS)
    for worker, event in stream:
        assert ours.apply(worker, event) == dyn.apply(worker, event)
        for prompt, salt in prompts:
            chain = PromptChain(prompt, BS, cache_salt=salt)
            assert dyn.match(chain).blocks == ours.match(chain).blocks
    assert dyn.counters == ours.counters


# ---- where Dynamo differs (module docstring) --------------------------------


def outcomes(index, events):
    return [index.apply("w", event) for event in events]


def test_multimodal_blocks_are_cut_but_the_prefix_matches():
    mm = BlockStored(
        [block_hash(BASE[0], k, None) for k in range(4)],
        None,
        BASE[0][:8],
        BS,
        extra_keys=[None, None, [["img", 0]], None],
    )
    child = stored(BASE[0], 4, 6)
    ours, dyn = BlockIndex(BS), DynamoIndex(BS)
    assert outcomes(ours, [mm, child]) == ["applied", "applied"]
    assert outcomes(dyn, [mm, child]) == ["unsupported_extra_keys", "unknown_parent"]
    chain = PromptChain(BASE[0], BS)
    assert dyn.match(chain).blocks == ours.match(chain).blocks == {"w": {"GPU": 2}}
    assert dyn.block_count("w") == 2


def test_store_whose_parent_is_in_another_tier_is_refused():
    events = [stored(BASE[0], 0, 3, medium="CPU"), stored(BASE[0], 3, 6, medium="GPU")]
    ours, dyn = BlockIndex(BS), DynamoIndex(BS)
    assert outcomes(ours, events) == ["applied", "applied"]
    assert outcomes(dyn, events) == ["applied", "refused"]
    chain = PromptChain(BASE[0], BS)
    assert dyn.match(chain).blocks == ours.match(chain).blocks == {"w": {"CPU": 3}}


def test_removal_drops_the_subtree_in_dynamo():
    events = [stored(BASE[0], 0, 6), removed(BASE[0], [2]), stored(BASE[0], 2, 3)]
    ours, dyn = BlockIndex(BS), DynamoIndex(BS)
    assert outcomes(ours, events) == outcomes(dyn, events) == ["applied"] * 3
    chain = PromptChain(BASE[0], BS)
    assert ours.match(chain).blocks == {"w": {"GPU": 6}}  # blocks 3-5 still cached: credited again
    assert dyn.match(chain).blocks == {"w": {"GPU": 3}}
    assert outcomes(dyn, [stored(BASE[0], 5, 6), removed(BASE[0], [4, 1])]) == ["refused", "already_dropped"]
    assert dyn.match(chain).blocks == {"w": {"GPU": 1}}
    assert dyn.block_count("w") == 4  # follows the events: 0, 2, 3, 5
