"""The block-hash contract: how kvpilot and vLLM name a KV block.

The connector's verification builds on it, and it must never import vLLM (it is
tested, and benchmarked, without an engine). The router does not use it: it names
blocks by their tokens (:mod:`kvpilot.routing.index.chain`). It restates, and its
tests check against, vLLM 0.32's own code in ``vllm/v1/core/kv_cache_utils.py``
(``init_none_hash``, ``hash_block_tokens``, ``generate_block_hash_extra_keys``,
``get_request_block_hasher``) and ``vllm/utils/hashing.py``.

The rule
--------
A prompt is cut into blocks of ``block_size`` tokens. **Only full blocks are
hashed**; a trailing partial block has no hash. Block ``i`` covers token
positions ``[i * block_size, (i + 1) * block_size)`` and is named::

    hash_i = H((parent_i, tuple(token_ids of block i), extra_keys_i))

- ``parent_0 = NONE_HASH`` and ``parent_i = hash_{i-1}``: each hash names the
  whole prefix that ends at its block, not just the block's own tokens.
- ``NONE_HASH = H(seed)`` where ``seed`` is a *string*: the engine process's
  ``PYTHONHASHSEED`` if it is set (any value, even ``""`` or ``"random"``, is
  used verbatim). If it is unset, vLLM uses the fixed seed ``"vllm-none-hash"``
  for the cryptographic algorithms (``sha256``, ``sha256_cbor``) and **fresh
  random bytes per process** for ``xxhash`` and ``xxhash_cbor``. In that last
  case no two engines share a chain, so there is no cross-engine contract:
  :func:`none_hash` raises :class:`NoSharedSeedError`.
- ``extra_keys_i`` is ``None`` or a tuple. vLLM concatenates, in this order:
  LoRA ``("lora", name, path)`` on every block, multimodal
  ``("mm", identifier, offset_in_block)``, ``("cache_salt", salt)`` **on block 0
  only and only when the salt is non-empty**, and
  ``("prompt_embeds", sha256_of_block_embeds)``. An empty list becomes ``None``.
  :func:`block_hash_chain` reproduces text-only, non-LoRA requests (salt or no
  salt); it does not name the blocks of other requests.
- ``H`` is vLLM's ``prefix_caching_hash_algo`` (default ``sha256``):

  ===============  ==============================================  ==============
  algorithm        serialisation of the tuple                      digest
  ===============  ==============================================  ==============
  ``sha256``       ``pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)``  SHA-256, 32 B
  ``sha256_cbor``  ``cbor2.dumps(obj, canonical=True)``            SHA-256, 32 B
  ``xxhash``       pickle, as above                                XXH3-128, 16 B
  ``xxhash_cbor``  canonical CBOR, as above                        XXH3-128, 16 B
  ===============  ==============================================  ==============

  Token ids are Python ``int`` (vLLM's ``request.all_token_ids``); this module
  converts whatever it is given with ``int()`` so that, e.g., numpy ids give the
  engine's hashes. The pickle variants depend on CPython's pickle (protocol 5
  on every Python vLLM supports); use ``sha256_cbor`` for a language-neutral
  contract.
- ``block_size`` is vLLM's *hash* block size: ``request.block_hashes`` is at
  this granularity. It equals ``--block-size`` except in hybrid-model configs
  where vLLM hashes at a finer ``prefix_match_unit``.

Two engines name a block the same way iff they
agree on the algorithm, the seed (hence ``NONE_HASH``), the block size, and the
tokens and extra keys of every block up to it. :func:`seed_identity` and
:func:`salt_identity` give short, non-reversible ids of the seed and the salt so
that a contract can be compared without revealing either.

Third-party imports: ``cbor2`` (for the ``*_cbor`` algorithms) and ``xxhash``
(for the ``xxhash*`` ones) are optional; using an algorithm whose library is
missing raises ``ModuleNotFoundError`` naming the package.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, NewType, get_args

_cbor_dumps: Callable[..., bytes] | None
try:
    from cbor2 import dumps as _cbor_dumps
except ImportError:  # pragma: no cover - depends on the environment
    _cbor_dumps = None

_xxh3_128_digest: Callable[[bytes], bytes] | None
try:
    from xxhash import xxh3_128_digest as _xxh3_128_digest
except ImportError:  # pragma: no cover - depends on the environment (xxhash < 3 has no xxh3)
    _xxh3_128_digest = None

BlockHash = NewType("BlockHash", bytes)
"""The name of one full block and of the whole prefix ending at it."""

SeedId = NewType("SeedId", str)
"""A short, non-reversible id of a ``NONE_HASH`` (see :func:`seed_identity`)."""

SaltId = NewType("SaltId", str)
"""A short, non-reversible id of a ``cache_salt`` (see :func:`salt_identity`)."""

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
"""Exactly vLLM's ``CacheConfig.prefix_caching_hash_algo`` choices."""

HASH_ALGOS: Final[tuple[HashAlgo, ...]] = get_args(HashAlgo)

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
"""vLLM's seed when ``PYTHONHASHSEED`` is unset and the algorithm is a SHA."""

CRYPTOGRAPHIC_ALGOS: Final[frozenset[HashAlgo]] = frozenset({"sha256", "sha256_cbor"})

NO_SALT_ID: Final = SaltId("")
"""The salt id of a request without ``cache_salt`` (or with an empty one)."""

_ID_HEX_CHARS: Final = 8


class NoSharedSeedError(ValueError):
    """The engine's ``NONE_HASH`` is random per process: no chain is shared."""


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    if _cbor_dumps is None:
        raise ModuleNotFoundError("the *_cbor block-hash algorithms need the 'cbor2' package")
    return _cbor_dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    if _xxh3_128_digest is None:
        raise ModuleNotFoundError("the xxhash* block-hash algorithms need the 'xxhash' package (>= 3)")
    return _xxh3_128_digest(data)


def _compose(name: str, serialise: Callable[[Any], bytes], digest: Callable[[bytes], bytes]) -> Callable[[Any], bytes]:
    def block_hash_fn(obj: Any) -> bytes:
        return digest(serialise(obj))

    block_hash_fn.__name__ = name
    return block_hash_fn


_HASH_FNS: Final[dict[str, Callable[[Any], bytes]]] = {
    "sha256": _compose("sha256", _pickle, _sha256),
    "sha256_cbor": _compose("sha256_cbor", _cbor, _sha256),
    "xxhash": _compose("xxhash", _pickle, _xxh3_128),
    "xxhash_cbor": _compose("xxhash_cbor", _cbor, _xxh3_128),
}


def hash_function(algo: HashAlgo) -> Callable[[Any], bytes]:
    """Return ``H`` for ``algo``: the same bytes as vLLM's ``get_hash_fn_by_name``.

    Raises ``ValueError`` naming the algorithm if it is not one of
    :data:`HASH_ALGOS`.
    """
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(f"unsupported block-hash algorithm {algo!r}; expected one of {HASH_ALGOS}") from None


def none_hash(algo: HashAlgo, python_hash_seed: str | None) -> BlockHash:
    """Return vLLM's ``NONE_HASH`` for an engine whose ``PYTHONHASHSEED`` is given.

    ``python_hash_seed`` is the engine's environment value verbatim, ``None``
    when unset. Raises :class:`NoSharedSeedError` when it is unset and ``algo``
    is ``xxhash`` or ``xxhash_cbor``: vLLM then draws a random seed per process
    and no other process can reproduce its chain. Raises ``ValueError`` for an
    unknown algorithm.
    """
    fn = hash_function(algo)
    if python_hash_seed is None:
        if algo not in CRYPTOGRAPHIC_ALGOS:
            raise NoSharedSeedError(
                f"PYTHONHASHSEED is unset and {algo!r} is not cryptographic: vLLM "
                "seeds NONE_HASH with random bytes per process, so block hashes "
                "are not shared across engines; set PYTHONHASHSEED on every engine"
            )
        python_hash_seed = DEFAULT_NONE_HASH_SEED
    return BlockHash(fn(python_hash_seed))


def block_hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    algo: HashAlgo,
    seed_hash: BlockHash,
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hash the full blocks of ``token_ids``, as vLLM's request block hasher does.

    ``token_ids`` are the tokens from position ``start_block * block_size`` on;
    the returned list holds the hashes of blocks ``start_block``,
    ``start_block + 1``, ... for every *full* block among them (a trailing
    partial block is ignored, so an empty or shorter-than-a-block input gives
    ``[]``). ``seed_hash`` is the engine's ``NONE_HASH`` (see :func:`none_hash`).

    Incremental use (a session's next prompt extends its last one): pass
    ``parent`` = the hash of block ``start_block - 1`` from the earlier call and
    only the tokens from block ``start_block`` on (including any tokens of the
    earlier prompt's partial last block). ``cache_salt`` only affects block 0,
    so it is ignored when ``start_block > 0``; an empty salt is no salt.

    Pure: mutates nothing. Raises ``ValueError`` if ``block_size < 1``,
    ``start_block < 0``, or ``parent`` is given for block 0 / missing for a
    later block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    if (parent is None) != (start_block == 0):
        raise ValueError(
            "parent must be given exactly when start_block > 0 "
            f"(start_block={start_block}, parent given={parent is not None})"
        )
    fn = hash_function(algo)
    tokens = [int(t) for t in token_ids]
    prev = seed_hash if parent is None else parent
    salt_keys = (("cache_salt", cache_salt),) if cache_salt else None
    hashes: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra_keys = salt_keys if start_block == 0 and start == 0 else None
        prev = BlockHash(fn((prev, tuple(tokens[start : start + block_size]), extra_keys)))
        hashes.append(prev)
    return hashes


def _short_id(domain: bytes, value: bytes) -> str:
    return hashlib.sha256(domain + b"\0" + value).hexdigest()[:_ID_HEX_CHARS]


def seed_identity(seed_hash: bytes) -> SeedId:
    """Return a short id of ``NONE_HASH``: 8 hex chars of a domain-separated SHA-256.

    Equal seeds give equal ids; different seeds give different ids except with
    probability 2**-32, in which case the block hashes themselves still differ
    (a mismatch at block 0). The id reveals neither the seed nor ``NONE_HASH``.
    """
    return SeedId(_short_id(b"kvpilot-seed-id", seed_hash))


def salt_identity(cache_salt: str | None) -> SaltId:
    """Return a short id of a ``cache_salt``; :data:`NO_SALT_ID` for none or ``""``.

    As with :func:`seed_identity`, a 2**-32 id collision between two salts is
    still caught by the block-0 hash, which includes the salt itself.
    """
    if not cache_salt:
        return NO_SALT_ID
    return SaltId(_short_id(b"kvpilot-salt-id", cache_salt.encode("utf-8")))
