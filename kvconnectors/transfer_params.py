"""What kvpilot adds to vLLM's ``kv_transfer_params``: a versioned, typed offer.

P's ``request_finished`` returns ``kv_transfer_params``; kvpilot puts its own
sub-dict under :data:`PARAMS_KEY` (``"kvpilot"``). It crosses vLLM's OpenAI
server and an HTTP proxy as JSON, so the wire form holds only JSON types::

    {"version": 1,
     "contract": {"model": ..., "block_size": 16, "hash_algo": "sha256",
                  "seed_id": "1f0c9a2e", "kv_dtype": "bfloat16",
                  "kv_layout": "NHD", "salt_id": ""},
     "num_blocks": 4096,
     "block_digests": "<base64 of num_blocks * 8 bytes>",
     "tail_token_ids": [17, 4, 99],
     "kv_digest_algo": "xxh3_64",
     "kv_digests": ["<base64 of 8 bytes per offered block of KV-cache group 0>", ...]}

``block_digests`` packs, for each full block P offers (block 0 first), the
first :data:`DIGEST_BYTES` bytes of vLLM's block hash (the same hashes vLLM
puts in its KV events; see :mod:`kvpilot.kvconnectors.hash_contract`).
``tail_token_ids`` are the token ids of the partial block after them (fewer
than ``block_size``; vLLM hashes only full blocks). Given a verified chain up
to it, equal tail tokens mean equal KV for the tail, so D may load it too
instead of recomputing it (which would split D's prefill at another point).

``kv_digests`` (version 2 on) are digests of the offered blocks' KV *bytes*, one string
per KV-cache group, aligned with that group's ``remote_block_ids``
(:mod:`kvpilot.kvconnectors.kv_digest` says how they are computed and their collision
bound); ``kv_digest_algo`` names the digest. Both are empty when the holder computed none
(``kv_digest: false``, or an engine with more than one worker); the reader then attaches on
the token check alone.

Why 8 bytes per block is enough
-------------------------------
D compares P's digest of block ``i`` with its own digest of block ``i`` and
stops at the first difference; there is no set lookup, so no birthday bound.
Hashes are chained, so once the prompts diverge at block ``j`` every later
digest pair is an independent 64-bit coin: a wrong block is attached only if
the pair at ``j`` collides, with probability 2**-64 (5.4e-20) **per request,
whatever the prompt length**. A fleet serving a million requests a second for
a hundred years (3.2e15 requests) would see one with probability 1.7e-4.
Truncation does not weaken an adversarial setting either: whoever can write
``kv_transfer_params`` can already send the right digests for D's tokens, so
verification guards against misalignment, not against forgery.

Size
----
The digests take ``4 * ceil(8 * num_blocks / 3)`` characters. For a 65,536-token
prompt: 4,096 blocks at block size 16 give 43,692 characters; 512 blocks at
block size 128 give 5,464. The rest of ``{"kvpilot": {...}}`` is about 240
bytes of JSON plus the model name (``json.dumps`` with its default separators):
43,950 and 5,722 bytes in all with an 18-character model name
(``tests/unit/kvconnectors/test_transfer_params.py`` computes these); a
partial tail block adds its token ids, at most ``block_size - 1`` of them.

Decoding is strict: anything malformed (not an object, a missing, unknown or
mistyped field, an unknown version, a digest string that is truncated,
oversized or not base64) raises :class:`TransferParamsError`, whose ``field``
names the dotted path of the bad field, so that the request can be refused
with a 400 naming it or served by local prefill.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal, NamedTuple, NewType

import msgspec

from kvpilot.kvconnectors.hash_contract import (
    NO_SALT_ID,
    HashAlgo,
    SaltId,
    SeedId,
)

SCHEMA_VERSION: Final = 2
"""2 added ``kv_digest_algo`` and ``kv_digests``; a version-1 offer is refused (local prefill)."""
PARAMS_KEY: Final = "kvpilot"
DIGEST_BYTES: Final = 8
"""Bytes of each block hash carried in an offer (fixed by the schema version)."""

MAX_OFFER_BLOCKS: Final = 1 << 20
"""Default bound on ``num_blocks`` (16M tokens at block size 16): a decoder
never allocates more than 8 MiB for an offer."""

KV_DIGEST_ALGOS: Final = ("xxh3_64", "mix64_sum")
"""The KV digests an offer may name (:mod:`kvpilot.kvconnectors.kv_digest` computes them)."""

PackedDigests = NewType("PackedDigests", bytes)
"""For blocks 0, 1, ... in order, the first :data:`DIGEST_BYTES` bytes of each
block's :class:`BlockHash`, concatenated (see :func:`pack_digests`)."""

_SeedIdField = Annotated[SeedId, msgspec.Meta(pattern="^[0-9a-f]{8}$")]
_SaltIdField = Annotated[SaltId, msgspec.Meta(pattern="^([0-9a-f]{8})?$")]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


def pack_digests(hashes: Sequence[bytes]) -> PackedDigests:
    """Truncate each hash to :data:`DIGEST_BYTES` bytes and concatenate them.

    A hash shorter than a digest is packed as it is (so the result is then
    shorter than ``len(hashes) * DIGEST_BYTES``); vLLM's hashes are 16 or 32
    bytes.
    """
    return PackedDigests(b"".join([h[:DIGEST_BYTES] for h in hashes]))


class FieldDiff(NamedTuple):
    """One field on which two contracts disagree: ``this`` side vs ``other``."""

    field: str
    this: object
    other: object


class ContractId(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything two engines must share before one may use the other's KV.

    ``block_size`` is the size the offered hashes were computed at (vLLM's hash
    block size); ``seed_id`` and ``salt_id`` come from
    :func:`~kvpilot.kvconnectors.hash_contract.seed_identity` and
    :func:`~kvpilot.kvconnectors.hash_contract.salt_identity` (``salt_id`` is ``""``
    without a ``cache_salt``). ``kv_dtype`` and ``kv_layout`` are compared as
    opaque strings (e.g. ``"bfloat16"``, ``"NHD"``). Constructing one does not
    validate it; :func:`encode_offer` and :func:`decode_offer` do.
    """

    model: _Name
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    hash_algo: HashAlgo
    seed_id: _SeedIdField
    kv_dtype: _Name
    kv_layout: _Name
    salt_id: _SaltIdField = NO_SALT_ID

    def diff(self, other: ContractId) -> tuple[FieldDiff, ...]:
        """Return the fields that differ, in declaration order; ``()`` if equal."""
        return tuple(
            FieldDiff(name, getattr(self, name), getattr(other, name))
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        )


class BlockOffer(msgspec.Struct, frozen=True):
    """A decoded offer: P's digests of blocks ``0 .. num_blocks - 1``, packed.

    Packed rather than a tuple of digests so that decoding costs no Python
    object per block and verification compares whole runs of blocks with
    ``memcmp`` (see :mod:`kvpilot.kvconnectors.verify`).
    """

    version: int
    contract: ContractId
    packed_digests: PackedDigests
    tail_token_ids: tuple[int, ...] = ()
    kv_digest_algo: str = ""
    """The KV digest's name, one of :data:`KV_DIGEST_ALGOS`; ``""`` when the offer has none."""
    kv_digests: tuple[bytes, ...] = ()
    """Per KV-cache group, :data:`DIGEST_BYTES` bytes per offered block, in ``remote_block_ids`` order."""

    @property
    def num_blocks(self) -> int:
        """How many full blocks P offers."""
        return len(self.packed_digests) // DIGEST_BYTES

    @property
    def num_tokens(self) -> int:
        """How many tokens' KV P offers: its full blocks and the partial tail."""
        return self.num_blocks * self.contract.block_size + len(self.tail_token_ids)


_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class _WireOffer(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    contract: ContractId
    num_blocks: Annotated[int, msgspec.Meta(ge=0)]
    block_digests: str
    tail_token_ids: list[_TokenId] = []
    kv_digest_algo: Literal["", "xxh3_64", "mix64_sum"] = ""
    kv_digests: list[str] = []


class TransferParamsError(ValueError):
    """kvpilot's part of ``kv_transfer_params`` is malformed.

    ``field`` is the dotted path of the offending field from the top of
    ``kv_transfer_params`` (``"kvpilot.contract.block_size"``), or
    ``"kvpilot"`` when the sub-dict itself is wrong.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"invalid kv_transfer_params field {self.field!r}: {self.reason}"


def _digests_chars(num_blocks: int) -> int:
    return 4 * math.ceil(num_blocks * DIGEST_BYTES / 3)


def encode_offer(contract: ContractId, hashes: Sequence[bytes], tail_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Return the JSON-serialisable sub-dict to store under :data:`PARAMS_KEY`.

    ``hashes`` are P's block hashes from block 0 on (``request.block_hashes``);
    ``tail_token_ids`` the tokens after them whose KV P also offers (fewer than
    ``contract.block_size``).
    Raises :class:`TransferParamsError` if ``contract`` is invalid or a hash is
    shorter than :data:`DIGEST_BYTES`, so that a bad offer fails on P, where
    the bug is, rather than on D.
    """
    contract_dict = msgspec.to_builtins(contract)
    _convert(contract_dict, ContractId, f"{PARAMS_KEY}.contract")
    packed = pack_digests(hashes)
    if len(packed) != len(hashes) * DIGEST_BYTES:
        index, short = next((i, h) for i, h in enumerate(hashes) if len(h) < DIGEST_BYTES)
        raise TransferParamsError(
            f"{PARAMS_KEY}.block_digests",
            f"block {index}'s hash has {len(short)} bytes, need {DIGEST_BYTES}",
        )
    offer = {
        "version": SCHEMA_VERSION,
        "contract": contract_dict,
        "num_blocks": len(hashes),
        "block_digests": base64.b64encode(packed).decode("ascii"),
        "tail_token_ids": [int(t) for t in tail_token_ids],
    }
    _check_tail(_convert(offer, _WireOffer, PARAMS_KEY))
    return offer


def _check_tail(wire: _WireOffer) -> None:
    if len(wire.tail_token_ids) >= wire.contract.block_size:
        raise TransferParamsError(
            f"{PARAMS_KEY}.tail_token_ids",
            f"{len(wire.tail_token_ids)} tokens, must be fewer than block_size {wire.contract.block_size}",
        )


def decode_offer(raw: object, max_blocks: int = MAX_OFFER_BLOCKS) -> BlockOffer:
    """Parse and validate the sub-dict found under :data:`PARAMS_KEY`.

    Pure; mutates nothing. Raises :class:`TransferParamsError` (never another
    exception type) for: a non-dict; a missing, unknown or mistyped field; an
    unknown ``version`` (checked first, so a newer schema is reported as
    such); ``num_blocks`` above ``max_blocks``; a digest string that is not
    exactly the base64 of ``num_blocks * DIGEST_BYTES`` bytes.
    """
    if not isinstance(raw, dict):
        raise TransferParamsError(PARAMS_KEY, f"expected an object, got {type(raw).__name__}")
    version = raw.get("version")
    if type(version) is not int:
        raise TransferParamsError(
            f"{PARAMS_KEY}.version",
            "missing" if version is None else f"expected int, got {type(version).__name__}",
        )
    if version != SCHEMA_VERSION:
        raise TransferParamsError(
            f"{PARAMS_KEY}.version",
            f"unknown schema version {version}; this kvpilot reads {SCHEMA_VERSION}",
        )
    wire = _convert(raw, _WireOffer, PARAMS_KEY)
    _check_tail(wire)
    field = f"{PARAMS_KEY}.block_digests"
    if wire.num_blocks > max_blocks:
        raise TransferParamsError(
            f"{PARAMS_KEY}.num_blocks",
            f"{wire.num_blocks} blocks exceeds the limit of {max_blocks}",
        )
    expected_chars = _digests_chars(wire.num_blocks)
    if len(wire.block_digests) != expected_chars:
        kind = "truncated" if len(wire.block_digests) < expected_chars else "oversized"
        raise TransferParamsError(
            field,
            f"{kind}: {len(wire.block_digests)} characters, expected {expected_chars} for {wire.num_blocks} blocks",
        )
    try:
        packed = base64.b64decode(wire.block_digests, validate=True)
    except ValueError as exc:  # binascii.Error, or a non-ASCII string
        raise TransferParamsError(field, f"not base64: {exc}") from None
    if len(packed) != wire.num_blocks * DIGEST_BYTES:
        raise TransferParamsError(field, f"decodes to {len(packed)} bytes, expected {wire.num_blocks * DIGEST_BYTES}")
    return BlockOffer(
        version=wire.version,
        contract=wire.contract,
        packed_digests=PackedDigests(packed),
        tail_token_ids=tuple(wire.tail_token_ids),
        kv_digest_algo=wire.kv_digest_algo,
        kv_digests=_decode_kv_digests(wire, max_blocks),
    )


def _decode_kv_digests(wire: _WireOffer, max_blocks: int) -> tuple[bytes, ...]:
    if bool(wire.kv_digests) != bool(wire.kv_digest_algo):
        raise TransferParamsError(f"{PARAMS_KEY}.kv_digest_algo", "given without kv_digests, or kv_digests without it")
    groups = []
    for index, text in enumerate(wire.kv_digests):
        field = f"{PARAMS_KEY}.kv_digests[{index}]"
        if len(text) > _digests_chars(max_blocks + 1):
            raise TransferParamsError(field, f"oversized: {len(text)} characters")
        try:
            packed = base64.b64decode(text, validate=True)
        except ValueError as exc:
            raise TransferParamsError(field, f"not base64: {exc}") from None
        if len(packed) % DIGEST_BYTES:
            raise TransferParamsError(field, f"decodes to {len(packed)} bytes, not a multiple of {DIGEST_BYTES}")
        groups.append(packed)
    return tuple(groups)


def set_kv_digests(offer: dict[str, Any], algo: str, per_group: Sequence[bytes]) -> None:
    """Put the KV digests of the offered blocks (per KV-cache group, packed) into ``offer``,
    the sub-dict :func:`encode_offer` returned (mutated). Raises :class:`TransferParamsError`
    for an unknown ``algo`` or a group whose bytes are not whole digests."""
    if algo not in KV_DIGEST_ALGOS:
        raise TransferParamsError(f"{PARAMS_KEY}.kv_digest_algo", f"unknown digest {algo!r}")
    for index, packed in enumerate(per_group):
        if len(packed) % DIGEST_BYTES:
            raise TransferParamsError(f"{PARAMS_KEY}.kv_digests[{index}]", f"{len(packed)} bytes")
    offer["kv_digest_algo"] = algo
    offer["kv_digests"] = [base64.b64encode(packed).decode("ascii") for packed in per_group]


_MSGSPEC_PATH = re.compile(r"^(?P<reason>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.S)
_MSGSPEC_FIELD_NAME = re.compile(r"(?:missing required|unknown) field `(?P<name>.*)`$", re.S)


def _convert(raw: object, target: type, root: str) -> Any:
    """``msgspec.convert`` with its errors turned into :class:`TransferParamsError`."""
    try:
        return msgspec.convert(raw, target)
    except msgspec.ValidationError as exc:
        match = _MSGSPEC_PATH.match(str(exc))
        assert match is not None  # the pattern matches every string
        reason, path = match["reason"], match["path"] or ""
        field = root + path
        named = _MSGSPEC_FIELD_NAME.search(reason)
        if named is not None:  # the name may be anything a client sent: keep it out of the reason
            field = f"{field}.{named['name']}"
            reason = "missing" if reason.startswith("Object missing") else "unknown field"
        if match["key"]:
            reason = f"an object key: {reason}"
        raise TransferParamsError(field, reason) from None
