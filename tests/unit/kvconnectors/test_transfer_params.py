"""The kv_transfer_params schema: round trips, sizes, and fuzzed malformed input.

Property tests run without a deadline: the box is shared, and a slow example
is not a failure of the parser.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpilot.kvconnectors.transfer_params as tp
from kvpilot.kvconnectors.hash_contract import (
    HASH_ALGOS,
    BlockHash,
    block_hash_chain,
    none_hash,
    salt_identity,
)
from kvpilot.kvconnectors.transfer_params import (
    DIGEST_BYTES,
    MAX_OFFER_BLOCKS,
    PARAMS_KEY,
    SCHEMA_VERSION,
    BlockOffer,
    ContractId,
    FieldDiff,
    TransferParamsError,
    decode_offer,
    encode_offer,
    pack_digests,
)
from tests.unit.kvconnectors.offer_contract import CONTRACT

TOP_FIELDS = ("version", "contract", "num_blocks", "block_digests")
CONTRACT_FIELDS = ("model", "block_size", "hash_algo", "seed_id", "kv_dtype", "kv_layout")

hex8 = st.text("0123456789abcdef", min_size=8, max_size=8)
names = st.text(min_size=1, max_size=40)
contracts = st.builds(
    ContractId,
    model=names,
    block_size=st.integers(1, 1 << 20),
    hash_algo=st.sampled_from(HASH_ALGOS),
    seed_id=hex8,
    kv_dtype=names,
    kv_layout=names,
    salt_id=st.one_of(st.just(""), hex8),
)
block_hashes = st.lists(st.binary(min_size=DIGEST_BYTES, max_size=32).map(BlockHash), max_size=64)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=10,
)


def _valid(num_hashes: int = 3) -> dict[str, Any]:
    return encode_offer(CONTRACT, [BlockHash(bytes([i]) * 32) for i in range(num_hashes)])


def _field_of(raw: object, reason: str | None = None) -> str:
    with pytest.raises(TransferParamsError, match=reason) as info:
        decode_offer(raw)
    assert repr(info.value.field) in str(info.value)
    return info.value.field


@settings(deadline=None)
@given(contract=contracts, hashes=block_hashes)
def test_round_trip_through_json(contract: ContractId, hashes: list[BlockHash]) -> None:
    wire = json.loads(json.dumps(encode_offer(contract, hashes)))
    assert decode_offer(wire) == BlockOffer(
        version=SCHEMA_VERSION,
        contract=contract,
        packed_digests=b"".join(h[:DIGEST_BYTES] for h in hashes),
    )


@settings(deadline=None)
@given(raw=json_values.filter(lambda v: not isinstance(v, dict)) | st.binary())
def test_a_non_object_names_the_sub_dict(raw: object) -> None:
    assert _field_of(raw) == PARAMS_KEY


@settings(deadline=None)
@given(key=st.sampled_from(TOP_FIELDS))
def test_a_missing_top_level_field_is_named(key: str) -> None:
    raw = _valid()
    del raw[key]
    assert _field_of(raw) == f"{PARAMS_KEY}.{key}"


@settings(deadline=None)
@given(key=st.sampled_from(CONTRACT_FIELDS))
def test_a_missing_contract_field_is_named(key: str) -> None:
    raw = _valid()
    del raw["contract"][key]
    assert _field_of(raw) == f"{PARAMS_KEY}.contract.{key}"


# For each field: a strategy of values of the wrong type (or out of range).
WRONG_VALUES: dict[tuple[str, ...], st.SearchStrategy[Any]] = {
    ("version",): json_values.filter(lambda v: type(v) is not int) | st.binary(),
    ("contract",): json_values.filter(lambda v: not isinstance(v, dict)),
    ("num_blocks",): json_values.filter(lambda v: type(v) is not int) | st.integers(max_value=-1),
    ("block_digests",): json_values.filter(lambda v: not isinstance(v, str)) | st.binary(),
    ("contract", "model"): json_values.filter(lambda v: not isinstance(v, str)) | st.just(""),
    ("contract", "block_size"): json_values.filter(lambda v: type(v) is not int)
    | st.integers(max_value=0)
    | st.integers(min_value=(1 << 20) + 1),
    ("contract", "hash_algo"): json_values.filter(lambda v: v not in HASH_ALGOS),
    ("contract", "seed_id"): json_values.filter(
        lambda v: not (isinstance(v, str) and len(v) == 8 and set(v) <= set("0123456789abcdef"))
    ),
    ("contract", "kv_dtype"): json_values.filter(lambda v: not isinstance(v, str)),
    ("contract", "kv_layout"): json_values.filter(lambda v: not isinstance(v, str)),
    ("contract", "salt_id"): json_values.filter(
        lambda v: not (isinstance(v, str) and (v == "" or len(v) == 8) and set(v) <= set("0123456789abcdef"))
    ),
}


@settings(deadline=None)
@given(data=st.data(), path=st.sampled_from(sorted(WRONG_VALUES)))
def test_a_wrong_type_or_value_is_named(data: st.DataObject, path: tuple[str, ...]) -> None:
    raw = _valid()
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(WRONG_VALUES[path])
    assert _field_of(raw) == ".".join((PARAMS_KEY, *path))


@settings(deadline=None)
@given(version=st.integers().filter(lambda v: v != SCHEMA_VERSION))
def test_an_unknown_version_is_refused_as_such(version: int) -> None:
    raw = _valid()
    raw["version"] = version
    raw["contract"] = "a future schema may change anything else"
    with pytest.raises(TransferParamsError, match="unknown schema version") as info:
        decode_offer(raw)
    assert info.value.field == f"{PARAMS_KEY}.version"


@settings(deadline=None)
@given(key=st.text(min_size=1).filter(lambda k: k not in TOP_FIELDS), value=json_values)
def test_an_unknown_top_level_field_is_named(key: str, value: object) -> None:
    raw = _valid()
    raw[key] = value
    assert _field_of(raw) == f"{PARAMS_KEY}.{key}"


@settings(deadline=None)
@given(key=st.text(min_size=1).filter(lambda k: k not in (*CONTRACT_FIELDS, "salt_id")))
def test_an_unknown_contract_field_is_named(key: str) -> None:
    raw = _valid()
    raw["contract"][key] = 1
    assert _field_of(raw) == f"{PARAMS_KEY}.contract.{key}"


@settings(deadline=None)
@given(num_hashes=st.integers(1, 40), data=st.data())
def test_truncated_digests_are_refused(num_hashes: int, data: st.DataObject) -> None:
    raw = _valid(num_hashes)
    cut = data.draw(st.integers(1, len(raw["block_digests"])))
    raw["block_digests"] = raw["block_digests"][:-cut]
    assert _field_of(raw, "truncated") == f"{PARAMS_KEY}.block_digests"


@settings(deadline=None)
@given(num_hashes=st.integers(0, 40), extra=st.text(min_size=1))
def test_oversized_digests_are_refused(num_hashes: int, extra: str) -> None:
    raw = _valid(num_hashes)
    raw["block_digests"] += extra
    assert _field_of(raw, "oversized") == f"{PARAMS_KEY}.block_digests"


@settings(deadline=None)
@given(num_hashes=st.integers(0, 40), delta=st.integers(-40, 40).filter(bool))
def test_a_count_that_disagrees_with_the_digests_is_refused(num_hashes: int, delta: int) -> None:
    raw = _valid(num_hashes)
    raw["num_blocks"] = num_hashes + delta
    field = _field_of(raw)
    assert field == f"{PARAMS_KEY}.{'num_blocks' if num_hashes + delta < 0 else 'block_digests'}"


@settings(deadline=None)
@given(num_hashes=st.integers(1, 40), data=st.data())
def test_garbage_digests_are_refused(num_hashes: int, data: st.DataObject) -> None:
    raw = _valid(num_hashes)
    length = len(raw["block_digests"])
    garbage = data.draw(st.text(min_size=length, max_size=length))
    bad_at = data.draw(st.integers(0, length - 1))
    bad_char = data.draw(st.characters().filter(lambda c: not (c.isascii() and c.isalnum()) and c not in "+/="))
    raw["block_digests"] = garbage[:bad_at] + bad_char + garbage[bad_at + 1 :]
    assert _field_of(raw, "not base64") == f"{PARAMS_KEY}.block_digests"


@pytest.mark.parametrize(("where", "field"), [((), PARAMS_KEY), (("contract",), f"{PARAMS_KEY}.contract")])
def test_a_non_string_key_is_refused(where: tuple[str, ...], field: str) -> None:
    raw = _valid()
    target = raw
    for key in where:
        target = target[key]
    target[7] = "x"
    assert _field_of(raw) == field


def test_padding_in_the_middle_is_refused() -> None:
    raw = _valid(3)
    raw["block_digests"] = "AAA=" + raw["block_digests"][4:]
    assert _field_of(raw, "not base64|decodes to") == f"{PARAMS_KEY}.block_digests"


def test_more_blocks_than_the_limit_are_refused_before_decoding() -> None:
    raw = _valid(0)
    raw["num_blocks"] = MAX_OFFER_BLOCKS + 1
    assert _field_of(raw) == f"{PARAMS_KEY}.num_blocks"
    assert decode_offer(_valid(4), max_blocks=4).num_blocks == 4
    with pytest.raises(TransferParamsError, match="limit of 3"):
        decode_offer(_valid(4), max_blocks=3)


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    paths = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            paths += _paths(child, (*prefix, key))
    return paths


@settings(deadline=None)
@given(data=st.data(), replacement=json_values | st.binary())
def test_any_mutation_decodes_or_raises_transfer_params_error(data: st.DataObject, replacement: object) -> None:
    raw = _valid(data.draw(st.integers(0, 5)))
    path = data.draw(st.sampled_from(_paths(raw)))
    if not path:
        raw = replacement
    else:
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = replacement
    error: TransferParamsError | None = None
    try:
        decode_offer(copy.deepcopy(raw))
    except TransferParamsError as exc:
        error = exc
    assert error is None or error.field.startswith(PARAMS_KEY)


@pytest.mark.parametrize(
    ("bad_contract", "field"),
    [
        ({"seed_id": "not-hex!"}, "seed_id"),
        ({"block_size": 0}, "block_size"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"salt_id": "xyz"}, "salt_id"),
    ],
)
def test_encode_refuses_an_invalid_contract_on_p(bad_contract: dict, field: str) -> None:
    contract = ContractId(**(tp.msgspec.to_builtins(CONTRACT) | bad_contract))
    with pytest.raises(TransferParamsError) as info:
        encode_offer(contract, [])
    assert info.value.field == f"{PARAMS_KEY}.contract.{field}"


def test_encode_refuses_a_hash_shorter_than_a_digest() -> None:
    with pytest.raises(TransferParamsError, match="block 1"):
        encode_offer(CONTRACT, [BlockHash(b"\0" * 32), BlockHash(b"\0" * 7)])


def test_packed_digests_are_the_hash_prefixes_in_order() -> None:
    hashes = [BlockHash(bytes(range(i, i + 32))) for i in range(3)]
    assert pack_digests(hashes) == bytes(range(8)) + bytes(range(1, 9)) + bytes(range(2, 10))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, ()),
        ({"block_size": 128}, (FieldDiff("block_size", 16, 128),)),
        (
            {"model": "other", "salt_id": salt_identity("s")},
            (FieldDiff("model", CONTRACT.model, "other"), FieldDiff("salt_id", "", salt_identity("s"))),
        ),
        ({"hash_algo": "xxhash"}, (FieldDiff("hash_algo", "sha256", "xxhash"),)),
    ],
)
def test_contract_diff_lists_each_differing_field(changes: dict, expected: tuple) -> None:
    other = ContractId(**(tp.msgspec.to_builtins(CONTRACT) | changes))
    assert CONTRACT.diff(other) == expected
    assert other.diff(CONTRACT) == tuple(FieldDiff(d.field, d.other, d.this) for d in expected)


PROMPT_TOKENS = 65_536


@pytest.mark.parametrize(("block_size", "digest_chars", "total_bytes"), [(16, 43_692, 43_950), (128, 5_464, 5_722)])
def test_encoded_size_of_a_64k_token_prompt(block_size: int, digest_chars: int, total_bytes: int) -> None:
    """The figures the module docstring states, computed from a real chain."""
    seed_hash = none_hash("sha256", "0")
    hashes = block_hash_chain(range(PROMPT_TOKENS), block_size, "sha256", seed_hash)
    contract = ContractId(**(tp.msgspec.to_builtins(CONTRACT) | {"block_size": block_size}))
    params = encode_offer(contract, hashes)
    assert params["num_blocks"] == PROMPT_TOKENS // block_size
    assert len(params["block_digests"]) == digest_chars
    assert digest_chars == 4 * math.ceil(PROMPT_TOKENS // block_size * DIGEST_BYTES / 3)
    assert f"{digest_chars:,}" in tp.__doc__
    total = len(json.dumps({PARAMS_KEY: params}))
    assert f"{total:,}" in tp.__doc__
    assert total == total_bytes
    assert len(CONTRACT.model) == 18
    assert 220 <= total - digest_chars - len(CONTRACT.model) <= 260  # "about 240 bytes"
    assert decode_offer(json.loads(json.dumps(params))).packed_digests == pack_digests(hashes)


def test_tail_tokens_round_trip_and_count() -> None:
    hashes = [BlockHash(bytes([i]) * 32) for i in range(3)]
    params = encode_offer(CONTRACT, hashes, tail_token_ids=[5, 6, 7])
    offer = decode_offer(json.loads(json.dumps(params)))
    assert offer.tail_token_ids == (5, 6, 7)
    assert offer.num_tokens == 3 * CONTRACT.block_size + 3


@pytest.mark.parametrize(
    "tail",
    [[-1], ["a"], [1 << 40], "not a list"],
)
def test_bad_tail_tokens_are_named(tail: object) -> None:
    params = encode_offer(CONTRACT, [BlockHash(b"\x01" * 32)])
    with pytest.raises(TransferParamsError) as err:
        decode_offer({**params, "tail_token_ids": tail})
    assert err.value.field.startswith("kvpilot.tail_token_ids")


def test_tail_must_be_shorter_than_a_block() -> None:
    params = encode_offer(CONTRACT, [])
    with pytest.raises(TransferParamsError) as err:
        decode_offer({**params, "tail_token_ids": list(range(CONTRACT.block_size))})
    assert err.value.field == "kvpilot.tail_token_ids"
