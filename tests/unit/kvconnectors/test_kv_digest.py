"""The per-block KV digest (:mod:`kvpilot.kvconnectors.kv_digest`) over real CPU tensors,
in vLLM's CPU layout and in a GPU-style layout whose block dimension is not first."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kvconnectors.kv_digest import DigestLayoutError, GroupKV, algo_for, digest_blocks, mismatched
from kvpilot.kvconnectors.transfer_params import DIGEST_BYTES, KV_DIGEST_ALGOS

NUM_BLOCKS = 24
ALGOS = list(KV_DIGEST_ALGOS)


def cpu_caches(layers: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM-CPU's layout: [num_blocks, kv_heads, block_size, 2 * head_size], bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, 32, 16, generator=gen).to(torch.bfloat16) for i in range(layers)}


def group(caches: dict[str, torch.Tensor]) -> GroupKV:
    return GroupKV.of(caches, list(caches), NUM_BLOCKS)


@pytest.mark.parametrize("algo", ALGOS)
def test_equal_bytes_give_equal_digests_in_block_order(algo: str) -> None:
    a, b = cpu_caches(), cpu_caches()
    ids = [5, 3, 17]
    packed = digest_blocks(group(a), ids, algo)  # type: ignore[arg-type]
    assert len(packed) == 3 * DIGEST_BYTES
    assert packed == digest_blocks(group(b), ids, algo)  # type: ignore[arg-type]
    single = [digest_blocks(group(a), [i], algo) for i in ids]  # type: ignore[arg-type]
    assert packed == b"".join(single)
    assert len(set(single)) == 3


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("bit", [0, 7, 15])
def test_one_flipped_bit_in_any_layer_fails_exactly_that_block(algo: str, layer: int, bit: int) -> None:
    holder, reader = cpu_caches(), cpu_caches()
    words = reader[f"layer.{layer}"][9].view(-1).view(torch.int16)
    words[37] ^= 1 << bit
    ids = list(range(4, 14))
    expected = digest_blocks(group(holder), ids, algo)  # type: ignore[arg-type]
    assert mismatched(expected, digest_blocks(group(reader), ids, algo)) == [9 - 4]  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ALGOS)
def test_a_block_from_another_position_is_caught(algo: str) -> None:
    """A read that lands the holder's block 6 where block 5 belongs (a misdirected write)."""
    holder = cpu_caches()
    reader = {name: t.clone() for name, t in holder.items()}
    for t in reader.values():
        t[5] = t[6]
    expected = digest_blocks(group(holder), [4, 5, 6], algo)  # type: ignore[arg-type]
    assert mismatched(expected, digest_blocks(group(reader), [4, 5, 6], algo)) == [1]  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ALGOS)
def test_a_gpu_style_layout_digests_along_its_block_dimension(algo: str) -> None:
    """[2, num_blocks, block, heads, head]: K and V apart, the block dimension second."""
    cache = torch.randn(2, NUM_BLOCKS, 16, 2, 8).to(torch.float16)
    g = GroupKV.of({"l": cache}, ["l"], NUM_BLOCKS)
    before = digest_blocks(g, [2, 3], algo)  # type: ignore[arg-type]
    cache[1, 3, 0, 0, 0] += 1  # V of block 3
    assert mismatched(before, digest_blocks(g, [2, 3], algo)) == [1]  # type: ignore[arg-type]


def test_the_digest_follows_the_device_of_the_cache() -> None:
    assert algo_for(group(cpu_caches())) == "xxh3_64"


def test_no_blocks_digest_to_nothing() -> None:
    assert digest_blocks(group(cpu_caches()), []) == b""


@pytest.mark.parametrize("algo", ALGOS)
def test_a_block_id_beyond_the_cache_is_an_error(algo: str) -> None:
    with pytest.raises(IndexError):
        digest_blocks(group(cpu_caches()), [NUM_BLOCKS], algo)  # type: ignore[arg-type]


def test_a_cache_without_a_block_dimension_is_refused_by_name() -> None:
    with pytest.raises(DigestLayoutError, match=r"layer x: no dimension of 24 blocks in shape \(4, 8\)"):
        GroupKV.of({"x": torch.zeros(4, 8)}, ["x"], NUM_BLOCKS)


def test_a_block_of_odd_bytes_is_refused() -> None:
    with pytest.raises(DigestLayoutError, match="3 bytes, not a multiple of 8"):
        GroupKV.of({"x": torch.zeros(NUM_BLOCKS, 3, dtype=torch.uint8)}, ["x"], NUM_BLOCKS)


def test_digests_of_unequal_length_cannot_be_compared() -> None:
    with pytest.raises(ValueError, match="cannot be compared"):
        mismatched(b"\0" * 8, b"\0" * 16)
