"""A digest of each KV-cache block's bytes, computed where the KV lives.

The holder digests the blocks it offers, the reader digests the blocks a read filled,
and a block is attached only where the two agree (:mod:`kvpilot.kvconnectors.worker`).
The token-hash check (:mod:`kvpilot.kvconnectors.verify`) says a block holds the right
*tokens*; this says it holds exactly the *bytes* the holder computed for them.

The digest of block ``b`` of a KV-cache group is one 64-bit word over every layer of the
group, in the group's layer order, computed where the cache lives:

* **a CPU cache** (DRAM): XXH3-64 (``xxhash``, already a dependency) streamed over the
  block's bytes in each layer in turn, one call per block and layer over memory it does not
  copy when the block is contiguous, as vLLM's CPU layout ``[num_blocks, heads, block, 2 * head]`` is;
* **a device cache** (GPU): a reduction written as a few elementwise tensor passes over
  all the read's blocks at once, run on the device (no Python loop per block)::

    s_l = sum_i m(w_i ^ key(l, i))  (mod 2**64)     over the 64-bit words w_i of layer l's block b
    d   = mix(... mix(mix(s_0) ^ s_1) ... ^ s_{L-1})

  where ``m(z) = y ^ (y >> 32)`` with ``y = z * C`` (``C`` odd; both steps are bijections of
  64-bit words, so ``m`` is one, in four elementwise passes), ``mix`` is the splitmix64
  finaliser (a bijection, applied once per block and layer) and ``key(l, i)`` a distinct
  constant per layer and word position.

Both sides of a transfer have their caches on the same kind of device (the offer's
contract holds the layout and dtype), so both compute the same kind of digest; the offer
names it (``kv_digest_algo``) and a reader refuses to compare digests of another kind.

Collision bound
---------------
* Device reduction: a corruption confined to one 64-bit word of one layer of a block (a
  flipped bit, a torn 8-byte store) **always** changes the digest: it changes one summand of
  ``s_l`` through the bijection ``m``, and every later step is a bijection of ``s_l``.
* Either digest: any difference is missed with probability 2**-64 per block compared, taking the
  mixed words as independent uniform values (the usual model for non-cryptographic hashes;
  it is not a proof). Blocks are compared pairwise (block ``i`` with the holder's block
  ``i``), never looked up in a set, so there is no birthday bound: a read of ``n`` corrupted
  blocks passes unnoticed with probability at most ``n * 2**-64``.
* It is not a MAC: whoever can write the holder's memory or ``kv_transfer_params`` can make
  both sides agree. It guards against stale, reused, torn and misdirected bytes, not forgery.

Both sides must lay the KV out alike (same dtype, layout and block size: the offer's
contract already refuses a peer that differs) and digest the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xxhash

from kvpilot.kvconnectors.transfer_params import DIGEST_BYTES

_MASK64 = (1 << 64) - 1
_CHUNK_BLOCKS = 256
"""Blocks digested per tensor pass, bounding the temporaries to a few copies of 256 blocks."""


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words, elementwise (a bijection; wraps mod 2**64)."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


class DigestLayoutError(ValueError):
    """A KV-cache tensor the digest cannot read: no dimension of ``num_blocks`` entries,
    or a block whose bytes are not a whole number of 64-bit words."""


@dataclass(frozen=True, slots=True)
class GroupKV:
    """One KV-cache group's layers, each a view of its cache with the block dimension first."""

    layers: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int) -> GroupKV:
        """The group's layers from ``kv_caches`` (layer name -> cache tensor), in
        ``layer_names`` order; each cache's block dimension is its first of ``num_blocks``
        entries. Raises :class:`DigestLayoutError` naming the layer it cannot read, and
        ``KeyError`` for a layer missing from ``kv_caches``."""
        views = []
        for name in layer_names:
            cache = kv_caches[name]
            dims = [d for d, size in enumerate(cache.shape) if size == num_blocks]
            if not dims:
                raise DigestLayoutError(
                    f"layer {name}: no dimension of {num_blocks} blocks in shape {tuple(cache.shape)}"
                )
            view = cache.movedim(dims[0], 0)
            block_bytes = view[0].numel() * view.element_size()
            if block_bytes % 8:
                raise DigestLayoutError(f"layer {name}: a block has {block_bytes} bytes, not a multiple of 8")
            views.append(view)
        return cls(tuple(views))


def _layer_sums(layer: torch.Tensor, index: torch.Tensor, layer_no: int) -> torch.Tensor:
    blocks = layer.index_select(0, index).reshape(len(index), -1)
    words = blocks.view(torch.uint8).view(torch.int64)
    positions = torch.arange(words.shape[1], dtype=torch.int64, device=words.device)
    keys = positions * _GOLDEN + _signed((layer_no + 1) * _M2)
    mixed = (words ^ keys) * _M1
    return (mixed ^ _shr(mixed, 32)).sum(dim=1, dtype=torch.int64)


DigestAlgo = Literal["xxh3_64", "mix64_sum"]
"""One of :data:`~kvpilot.kvconnectors.transfer_params.KV_DIGEST_ALGOS`: XXH3-64 over a CPU
cache, the tensor reduction over a device cache. A value never changes once shipped."""


def algo_for(group: GroupKV) -> DigestAlgo:
    """The digest this group's cache gets: ``xxh3_64`` on the CPU, ``mix64_sum`` elsewhere."""
    on_cpu = not group.layers or group.layers[0].device.type == "cpu"
    return "xxh3_64" if on_cpu else "mix64_sum"


def digest_blocks(group: GroupKV, block_ids: Sequence[int], algo: DigestAlgo | None = None) -> bytes:
    """The digests of ``block_ids`` (in order) over every layer of ``group``, packed:
    :data:`~kvpilot.kvconnectors.transfer_params.DIGEST_BYTES` little-endian bytes per
    block. ``algo`` defaults to :func:`algo_for`. Reads the cache, writes nothing; ``b""``
    for no blocks. A block id out of the cache's range raises ``IndexError``."""
    if not block_ids:
        return b""
    algo = algo or algo_for(group)
    packed = _xxh3_digests(group, block_ids) if algo == "xxh3_64" else _mix_digests(group, block_ids)
    assert len(packed) == len(block_ids) * DIGEST_BYTES
    return packed


def _xxh3_digests(group: GroupKV, block_ids: Sequence[int]) -> bytes:
    num_blocks = group.layers[0].shape[0] if group.layers else 0
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            raise IndexError(f"block id {block_id} out of range for a cache of {num_blocks} blocks")
    layers = [_cpu_rows(layer, block_ids) for layer in group.layers]
    hasher = xxhash.xxh3_64()
    out = bytearray()
    for i, block_id in enumerate(block_ids):
        hasher.reset()
        for array, by_id in layers:
            hasher.update(memoryview(array[block_id if by_id else i]))
        out += hasher.intdigest().to_bytes(DIGEST_BYTES, "little")
    return bytes(out)


def _cpu_rows(layer: torch.Tensor, block_ids: Sequence[int]) -> tuple[np.ndarray, bool]:
    """The layer's blocks as rows of a uint8 array, and whether a row is found by block id
    (a view of the whole cache, whose blocks are contiguous: vLLM's CPU layout) or by the
    block's place in ``block_ids`` (a copy of those blocks only, for any other layout)."""
    if layer.is_contiguous():
        return layer.reshape(layer.shape[0], -1).view(torch.uint8).numpy(), True
    index = torch.tensor(list(block_ids), dtype=torch.int64)
    picked = layer.index_select(0, index).reshape(len(block_ids), -1)
    return picked.view(torch.uint8).numpy(), False


def _mix_digests(group: GroupKV, block_ids: Sequence[int]) -> bytes:
    out = []
    device = group.layers[0].device if group.layers else torch.device("cpu")
    for start in range(0, len(block_ids), _CHUNK_BLOCKS):
        index = torch.tensor(list(block_ids[start : start + _CHUNK_BLOCKS]), dtype=torch.int64, device=device)
        acc = torch.zeros(len(index), dtype=torch.int64, device=device)
        for layer_no, layer in enumerate(group.layers):
            acc = mix64(acc ^ _layer_sums(layer, index, layer_no))
        out.append(acc.to("cpu").numpy().astype("<i8").tobytes())
    return b"".join(out)


def mismatched(expected: bytes, actual: bytes) -> list[int]:
    """Every block index whose packed digests differ (``ValueError`` on unequal lengths)."""
    if len(expected) != len(actual):
        raise ValueError(f"digests of {len(expected)} and {len(actual)} bytes cannot be compared")
    return [
        i // DIGEST_BYTES
        for i in range(0, len(expected), DIGEST_BYTES)
        if expected[i : i + DIGEST_BYTES] != actual[i : i + DIGEST_BYTES]
    ]


def _main() -> None:
    """``python -m kvpilot.kvconnectors.kv_digest``: time the digest of a read's blocks
    against copying the same blocks (what a read on one host costs at least), on CPU
    tensors in vLLM's CPU layout, and print one line per digest."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=256, help="blocks in one read")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    total = 2 * args.blocks
    shape = (total, args.kv_heads, args.block_size, 2 * args.head_size)
    caches = {f"l{i}": torch.randn(shape).to(torch.bfloat16) for i in range(args.layers)}
    group = GroupKV.of(caches, list(caches), total)
    ids = list(range(args.blocks))
    src_index, dest_index = torch.arange(args.blocks), torch.arange(args.blocks, total)
    block_bytes = args.layers * caches["l0"][0].numel() * 2

    def best(run: Callable[[], object]) -> float:
        run()
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    def copy() -> None:
        for cache in caches.values():
            cache.index_copy_(0, dest_index, cache.index_select(0, src_index))

    copied = best(copy)
    print(f"{args.blocks} blocks of {block_bytes} bytes ({args.layers} layers): copy {copied * 1e3:.2f} ms")
    for algo in ("xxh3_64", "mix64_sum"):
        spent = best(lambda algo=algo: digest_blocks(group, ids, algo))  # type: ignore[misc]
        print(
            f"  {algo}: {spent * 1e3:.2f} ms, {spent / args.blocks * 1e6:.1f} us per block, "
            f"{args.blocks * block_bytes / spent / 1e9:.2f} GB/s, {spent / copied:.2f} x the copy"
        )


if __name__ == "__main__":
    _main()
