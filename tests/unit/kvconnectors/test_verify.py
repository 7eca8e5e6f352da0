"""verify_offer: table-driven edge cases, contract mismatches, and real chains."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.kvconnectors.hash_contract import (
    BlockHash,
    block_hash_chain,
    none_hash,
    salt_identity,
    seed_identity,
)
from kvpilot.kvconnectors.transfer_params import (
    SCHEMA_VERSION,
    BlockOffer,
    ContractId,
    FieldDiff,
    decode_offer,
    encode_offer,
    pack_digests,
)
from kvpilot.kvconnectors.verify import Reason, Verdict, verify_offer
from tests.unit.kvconnectors.offer_contract import CONTRACT


def _hash(label: str) -> BlockHash:
    return BlockHash(hashlib.sha256(label.encode()).digest())


def _hashes(labels: str) -> list[BlockHash]:
    """One block per character: equal characters are equal blocks."""
    return [_hash(c) for c in labels]


def _offer(labels: str, contract: ContractId = CONTRACT) -> BlockOffer:
    return BlockOffer(
        version=SCHEMA_VERSION,
        contract=contract,
        packed_digests=pack_digests(_hashes(labels)),
    )


class Case(NamedTuple):
    offered: str
    own: str
    local_hit: int
    reason: Reason
    verified: int
    attach: range
    first_mismatch: int | None
    rejected: range


V, T = Reason.VERIFIED_ALL, Reason.TOKEN_MISMATCH
CASES = {
    "both empty": Case("", "", 0, V, 0, range(0), None, range(0)),
    "empty offer": Case("", "abc", 1, V, 0, range(1, 1), None, range(1, 1)),
    "nothing of D's own": Case("abc", "", 0, V, 0, range(0), None, range(0)),
    "all verified, no local hit": Case("abcd", "abcd", 0, V, 4, range(4), None, range(4, 4)),
    "all verified beyond a local hit": Case("abcd", "abcd", 2, V, 4, range(2, 4), None, range(4, 4)),
    "all verified, all local": Case("abcd", "abcd", 4, V, 4, range(4, 4), None, range(4, 4)),
    "P offers more than D has": Case("abcdef", "abcd", 1, V, 4, range(1, 4), None, range(4, 4)),
    "P offers fewer than D has": Case("ab", "abcde", 0, V, 2, range(2), None, range(2, 2)),
    "P differs only beyond D's blocks": Case("abcX", "abc", 0, V, 3, range(3), None, range(3, 3)),
    "mismatch at block 0": Case("abcd", "Xbcd", 0, T, 0, range(0), 0, range(4)),
    "mismatch mid-way": Case("abcde", "abXYZ", 0, T, 2, range(2), 2, range(2, 5)),
    "mismatch mid-way after a local hit": Case("abcde", "abXYZ", 1, T, 2, range(1, 2), 2, range(2, 5)),
    "mismatch at D's last block": Case("abcdef", "abcX", 0, T, 3, range(3), 3, range(3, 4)),
    "mismatch in P's shorter offer": Case("abX", "abcde", 0, T, 2, range(2), 2, range(2, 3)),
    "local hit beyond the verified run": Case("abcde", "aXYZW", 3, T, 1, range(3, 3), 1, range(3, 5)),
    "mismatch inside a full local hit": Case("abcde", "abXYZ", 5, T, 2, range(5, 5), 2, range(5, 5)),
    "a later match does not extend the run": Case("aXc", "aYc", 0, T, 1, range(1), 1, range(1, 3)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_verdict(case: Case) -> None:
    verdict = verify_offer(_offer(case.offered), CONTRACT, _hashes(case.own), case.local_hit)
    assert verdict == Verdict(
        reason=case.reason,
        num_offered_blocks=len(case.offered),
        num_own_blocks=len(case.own),
        num_local_hit_blocks=case.local_hit,
        num_verified_blocks=case.verified,
        attach_blocks=case.attach,
        first_mismatch_block=case.first_mismatch,
        rejected_blocks=case.rejected,
        contract_diffs=(),
    )


def _contract(**changes: object) -> ContractId:
    return msgspec.convert(msgspec.to_builtins(CONTRACT) | changes, ContractId)


CONTRACT_CASES = {
    "model": ({"model": "other-model"}, 0),
    "block size": ({"block_size": 128}, 1),
    "hash algorithm": ({"hash_algo": "xxhash"}, 2),
    "seed": ({"seed_id": seed_identity(none_hash("sha256", "1"))}, 3),
    "salt": ({"salt_id": salt_identity("tenant-b")}, 4),
    "kv dtype": ({"kv_dtype": "fp8_e4m3"}, 0),
    "kv layout": ({"kv_layout": "HND"}, 2),
    "several fields": ({"model": "m2", "kv_dtype": "float16"}, 1),
}


@pytest.mark.parametrize(("changes", "local_hit"), CONTRACT_CASES.values(), ids=CONTRACT_CASES.keys())
def test_a_contract_mismatch_attaches_nothing(changes: dict, local_hit: int) -> None:
    offered = _contract(**changes)
    verdict = verify_offer(_offer("abcd", offered), CONTRACT, _hashes("abcd"), local_hit)
    assert verdict.reason is Reason.CONTRACT_MISMATCH
    assert verdict.num_verified_blocks == 0
    assert not verdict.attach_blocks
    assert verdict.first_mismatch_block is None
    assert verdict.rejected_blocks == range(local_hit, 4)
    assert verdict.contract_diffs == tuple(
        FieldDiff(name, value, getattr(CONTRACT, name)) for name, value in changes.items()
    )
    line = verdict.explain()
    for name, value in changes.items():
        assert f"{name} peer={value!r} here={getattr(CONTRACT, name)!r}" in line


@pytest.mark.parametrize("local_hit", [-1, 4])
def test_a_local_hit_outside_d_s_blocks_is_refused(local_hit: int) -> None:
    with pytest.raises(ValueError, match="num_local_hit_blocks"):
        verify_offer(_offer("abc"), CONTRACT, _hashes("abc"), local_hit)


def test_digests_compare_the_offer_s_truncation() -> None:
    own = _hashes("ab")
    differs_after_digest = BlockHash(own[1][:8] + bytes(24))
    verdict = verify_offer(_offer("ab"), CONTRACT, [own[0], differs_after_digest], 0)
    assert verdict.num_verified_blocks == 2


@pytest.mark.parametrize(
    ("offered", "own", "local_hit", "expected"),
    [
        (
            "abcd",
            "abcd",
            1,
            "verified 4 blocks: attach blocks [1, 4) (peer offered 4 blocks, this engine has 4, local hit 1)",
        ),
        (
            "abcd",
            "abXY",
            0,
            (
                "token mismatch at block 2: verified 2 blocks, attach blocks [0, 2), "
                "recompute blocks [2, 4) (peer offered 4 blocks, this engine has 4, local hit 0)"
            ),
        ),
        (
            "abcd",
            "XYZW",
            0,
            (
                "token mismatch at block 0: verified 0 blocks, attach no blocks, "
                "recompute blocks [0, 4) (peer offered 4 blocks, this engine has 4, local hit 0)"
            ),
        ),
    ],
)
def test_explain(offered: str, own: str, local_hit: int, expected: str) -> None:
    assert verify_offer(_offer(offered), CONTRACT, _hashes(own), local_hit).explain() == expected


EDITS = {
    # (description): (edit applied to P's prompt X to get D's prompt X', verified blocks)
    "identical": (lambda x: x, 8),
    "D's prompt extends P's": (lambda x: x + [7] * 40, 8),
    "a token changed in block 3": (lambda x: [*x[:50], x[50] + 1, *x[51:]], 3),
    "a span cut from the middle": (lambda x: x[:70] + x[90:], 4),
    "the front truncated": (lambda x: x[16:], 0),
}


@pytest.mark.parametrize(("edit", "expected_verified"), EDITS.values(), ids=EDITS.keys())
@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_real_chains_through_the_wire_format(edit, expected_verified: int, algo: str) -> None:
    prompt_p = list(range(1000, 1000 + 8 * 16 + 5))
    prompt_d = edit(prompt_p)
    seed_hash = none_hash(algo, "0")
    contract = _contract(hash_algo=algo, seed_id=seed_identity(seed_hash))
    offer = decode_offer(encode_offer(contract, block_hash_chain(prompt_p, 16, algo, seed_hash)))
    own = block_hash_chain(prompt_d, 16, algo, seed_hash)
    verdict = verify_offer(offer, contract, own, 0)
    assert verdict.num_verified_blocks == expected_verified
    assert verdict.attach_blocks == range(expected_verified)


def test_another_salt_is_a_contract_mismatch_and_a_token_mismatch_too() -> None:
    seed_hash = none_hash("sha256", "0")
    tokens = list(range(64))
    p_contract = _contract(salt_id=salt_identity("a"))
    d_contract = _contract(salt_id=salt_identity("b"))
    offer = decode_offer(encode_offer(p_contract, block_hash_chain(tokens, 16, "sha256", seed_hash, "a")))
    own = block_hash_chain(tokens, 16, "sha256", seed_hash, "b")
    assert verify_offer(offer, d_contract, own, 0).reason is Reason.CONTRACT_MISMATCH
    # Even if both sides forgot the salt in the contract, block 0 would not verify.
    assert verify_offer(offer, p_contract, own, 0).first_mismatch_block == 0


@settings(deadline=None)
@given(
    offered=st.text("abc", max_size=40),
    own=st.text("abc", max_size=40),
    data=st.data(),
)
def test_the_verified_run_is_the_longest_common_prefix(offered: str, own: str, data) -> None:
    local_hit = data.draw(st.integers(0, len(own)))
    verdict = verify_offer(_offer(offered), CONTRACT, _hashes(own), local_hit)
    common = next(
        (i for i, (a, b) in enumerate(zip(offered, own, strict=False)) if a != b), min(len(offered), len(own))
    )
    assert verdict.num_verified_blocks == common
    assert verdict.attach_blocks == range(local_hit, max(local_hit, common))
    assert all(offered[i] == own[i] for i in verdict.attach_blocks)
    assert verdict.rejected_blocks == range(max(local_hit, common), max(local_hit, common, min(len(offered), len(own))))


def test_an_own_hash_shorter_than_a_digest_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 8 bytes"):
        verify_offer(_offer("ab"), CONTRACT, [_hash("a"), BlockHash(b"short")], 0)
