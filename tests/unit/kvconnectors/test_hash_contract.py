"""The hash contract against vLLM's own hashing code (imported here, never patched).

vLLM keeps NONE_HASH in a module global set by ``init_none_hash`` from the
process's PYTHONHASHSEED; these tests set that environment variable and call
vLLM's public functions, exactly as an engine core does at start-up.
"""

from __future__ import annotations

import random
import subprocess
import sys
from typing import get_args

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.config.cache import PrefixCachingHashAlgo
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kvu
from vllm.v1.request import Request

from kvpilot.kvconnectors.hash_contract import (
    DEFAULT_NONE_HASH_SEED,
    HASH_ALGOS,
    NO_SALT_ID,
    BlockHash,
    NoSharedSeedError,
    block_hash_chain,
    hash_function,
    none_hash,
    salt_identity,
    seed_identity,
)

SEEDS = ["0", "4242", ""]
BLOCK_SIZES = [1, 16, 32, 128]
SALTS = [None, "", "tenant-a"]


def _tokens(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 200_000) for _ in range(n)]


def _vllm_none_hash(monkeypatch: pytest.MonkeyPatch, algo: str, seed: str) -> bytes:
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    kvu.init_none_hash(get_hash_fn_by_name(algo))
    return kvu.NONE_HASH


def _vllm_request_hashes(tokens: list[int], block_size: int, algo: str, cache_salt: str | None) -> list[bytes]:
    hasher = kvu.get_request_block_hasher(block_size, get_hash_fn_by_name(algo))
    request = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=hasher,
    )
    return list(request.block_hashes)


def test_algorithms_are_exactly_vllms() -> None:
    assert get_args(PrefixCachingHashAlgo) == HASH_ALGOS


def test_default_seed_is_vllms() -> None:
    assert DEFAULT_NONE_HASH_SEED == kvu.DEFAULT_NONE_HASH_SEED


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("seed", SEEDS)
def test_none_hash_matches_vllm_for_a_set_seed(monkeypatch: pytest.MonkeyPatch, algo: str, seed: str) -> None:
    assert none_hash(algo, seed) == _vllm_none_hash(monkeypatch, algo, seed)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_none_hash_matches_vllm_for_an_unset_seed_with_a_sha(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kvu.init_none_hash(get_hash_fn_by_name(algo))
    assert none_hash(algo, None) == kvu.NONE_HASH


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_unset_seed_with_xxhash_has_no_shared_chain(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kvu.init_none_hash(get_hash_fn_by_name(algo))
    first = kvu.NONE_HASH
    kvu.init_none_hash(get_hash_fn_by_name(algo))
    assert first != kvu.NONE_HASH  # vLLM really draws a fresh seed each time
    with pytest.raises(NoSharedSeedError, match="PYTHONHASHSEED"):
        none_hash(algo, None)


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("cache_salt", SALTS)
def test_chain_equals_vllm_request_block_hashes(
    monkeypatch: pytest.MonkeyPatch, algo: str, block_size: int, cache_salt: str | None
) -> None:
    seed_hash = BlockHash(_vllm_none_hash(monkeypatch, algo, "1234"))
    tokens = _tokens(5 * block_size + block_size // 2)
    expected = _vllm_request_hashes(tokens, block_size, algo, cache_salt)
    assert len(expected) == 5
    chain = block_hash_chain(tokens, block_size, algo, seed_hash, cache_salt)
    assert chain == expected


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("cache_salt", [None, "tenant-a"])
@pytest.mark.parametrize("split_block", [1, 2, 4])
def test_incremental_chain_equals_vllm_over_the_whole_prompt(
    monkeypatch: pytest.MonkeyPatch, algo: str, cache_salt: str | None, split_block: int
) -> None:
    block_size = 16
    seed_hash = BlockHash(_vllm_none_hash(monkeypatch, algo, "99"))
    tokens = _tokens(4 * block_size + 3)
    earlier = block_hash_chain(tokens[: split_block * block_size + 5], block_size, algo, seed_hash, cache_salt)
    later = block_hash_chain(
        tokens[split_block * block_size :],
        block_size,
        algo,
        seed_hash,
        cache_salt,
        parent=earlier[-1],
        start_block=split_block,
    )
    assert earlier + later == _vllm_request_hashes(tokens, block_size, algo, cache_salt)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_a_different_seed_changes_every_block(algo: str) -> None:
    tokens = _tokens(64)
    a = block_hash_chain(tokens, 16, algo, none_hash(algo, "1"))
    b = block_hash_chain(tokens, 16, algo, none_hash(algo, "2"))
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize(("salt_a", "salt_b"), [(None, "s"), ("s", "t"), ("", "s")])
def test_a_different_salt_changes_every_block(algo: str, salt_a: str | None, salt_b: str) -> None:
    tokens, seed_hash = _tokens(64), none_hash(algo, "1")
    a = block_hash_chain(tokens, 16, algo, seed_hash, salt_a)
    b = block_hash_chain(tokens, 16, algo, seed_hash, salt_b)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_an_empty_salt_is_no_salt() -> None:
    tokens, seed_hash = _tokens(32), none_hash("sha256", "1")
    assert block_hash_chain(tokens, 16, "sha256", seed_hash, "") == block_hash_chain(
        tokens, 16, "sha256", seed_hash, None
    )


def test_the_salt_does_not_touch_blocks_after_the_first_in_incremental_calls() -> None:
    seed_hash, parent = none_hash("sha256", "1"), BlockHash(b"\x01" * 32)
    tokens = _tokens(32)
    kwargs = {"parent": parent, "start_block": 3}
    assert block_hash_chain(tokens, 16, "sha256", seed_hash, "s", **kwargs) == block_hash_chain(
        tokens, 16, "sha256", seed_hash, None, **kwargs
    )


def test_a_changed_token_changes_its_block_and_every_later_one() -> None:
    tokens, seed_hash = _tokens(80), none_hash("sha256", "1")
    edited = list(tokens)
    edited[40] += 1  # block 2 of 5
    a = block_hash_chain(tokens, 16, "sha256", seed_hash)
    b = block_hash_chain(edited, 16, "sha256", seed_hash)
    assert [x == y for x, y in zip(a, b, strict=True)] == [True, True, False, False, False]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_numpy_token_ids_hash_like_python_ints(algo: str) -> None:
    tokens, seed_hash = _tokens(48), none_hash(algo, "1")
    as_numpy = np.array(tokens, dtype=np.int64)
    assert block_hash_chain(as_numpy, 16, algo, seed_hash) == block_hash_chain(tokens, 16, algo, seed_hash)


@pytest.mark.parametrize(("num_tokens", "expected_blocks"), [(0, 0), (15, 0), (16, 1), (47, 2)])
def test_only_full_blocks_are_hashed(num_tokens: int, expected_blocks: int) -> None:
    chain = block_hash_chain(_tokens(num_tokens), 16, "sha256", none_hash("sha256", "1"))
    assert len(chain) == expected_blocks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"start_block": -1}, "start_block"),
        ({"start_block": 2}, "parent"),
        ({"parent": BlockHash(b"\x00" * 32)}, "parent"),
        ({"algo": "md5"}, "md5"),
    ],
)
def test_bad_chain_arguments_are_refused(kwargs: dict, message: str) -> None:
    args = {
        "token_ids": _tokens(32),
        "block_size": 16,
        "algo": "sha256",
        "seed_hash": BlockHash(b"\x00" * 32),
    } | kwargs
    with pytest.raises(ValueError, match=message):
        block_hash_chain(**args)


def test_hash_function_refuses_an_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="blake3"):
        hash_function("blake3")  # type: ignore[arg-type]  # not a HashAlgo, on purpose


def test_seed_identity_is_short_stable_and_seed_specific() -> None:
    a, b = none_hash("sha256", "1"), none_hash("sha256", "2")
    assert seed_identity(a) == seed_identity(BlockHash(bytes(a)))
    assert seed_identity(a) != seed_identity(b)
    assert len(seed_identity(a)) == 8
    assert seed_identity(a) not in a.hex()
    assert seed_identity(none_hash("sha256", "1")) != seed_identity(none_hash("sha256_cbor", "1"))


@pytest.mark.parametrize(("salt", "is_none"), [(None, True), ("", True), ("s", False)])
def test_salt_identity(salt: str | None, is_none: bool) -> None:
    assert (salt_identity(salt) == NO_SALT_ID) is is_none
    assert salt_identity(salt) == salt_identity(None if salt is None else str(salt))  # stable
    assert (salt_identity(salt) == salt_identity(f"{salt}-other")) is False  # salt-specific


def test_the_shared_modules_import_without_vllm() -> None:
    """These run without vLLM installed (tests, benchmarks): none may pull it in."""
    code = (
        "import sys\n"
        "import kvpilot.kvconnectors.hash_contract, kvpilot.kvconnectors.transfer_params\n"
        "import kvpilot.kvconnectors.verify, kvpilot.kvconnectors.attach_plan\n"
        "import kvpilot.kvconnectors.pull_policy, kvpilot.kvconnectors.thread_binding\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
