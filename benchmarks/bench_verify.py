"""Pure-level cost of verified KV attach for one long prompt.

For a prompt of ``--tokens`` random token ids (default 65,536) at block sizes
16 and 128, this measures, in one process:

- **baseline**: vLLM's own block hashing of the prompt, a chain of
  ``vllm.v1.core.kv_cache_utils.hash_block_tokens`` calls with vLLM's hash
  function (what every engine already pays per prompt, a small part of TTFT);
- **D side**: ``decode_offer`` of P's params (as parsed from JSON) plus
  ``verify_offer`` against D's own hashes, in the worst case where every block
  matches, so every digest is compared;
- **P side**: ``encode_offer`` of P's hashes;
- the bytes kvpilot adds to ``kv_transfer_params`` (its JSON sub-dict).

It prints medians in milliseconds and the D-side cost as a fraction of the
baseline measured in the same run. Run it pinned to one core::

    taskset -c 1 python -m benchmarks.bench_verify
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import BlockHash as VllmBlockHash
from vllm.v1.core.kv_cache_utils import hash_block_tokens

from kvpilot.kvconnectors.hash_contract import (
    HASH_ALGOS,
    BlockHash,
    block_hash_chain,
    none_hash,
    seed_identity,
)
from kvpilot.kvconnectors.reasons import Reason
from kvpilot.kvconnectors.transfer_params import PARAMS_KEY, ContractId, decode_offer, encode_offer
from kvpilot.kvconnectors.verify import verify_offer

BLOCK_SIZES = (16, 128)


def _decode_and_verify(received: object, contract: ContractId, hashes: Sequence[bytes]) -> None:
    """What D does with an offer on the wire: decode it, then verify every block."""
    verdict = verify_offer(decode_offer(received), contract, hashes, 0)
    assert verdict.reason is Reason.VERIFIED_ALL
    assert verdict.num_verified_blocks == len(hashes)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _vllm_hash_chain(tokens: list[int], block_size: int, algo: str, seed: BlockHash) -> None:
    hash_fn = get_hash_fn_by_name(algo)
    parent = VllmBlockHash(seed)  # the same bytes: kvpilot's chain is vLLM's
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + block_size])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65_536)
    parser.add_argument("--algo", choices=HASH_ALGOS, default="sha256")
    parser.add_argument("--repeats", type=int, default=21, help="runs per timed step")
    args = parser.parse_args()

    tokens = [random.Random(0).randrange(0, 128_000) for _ in range(args.tokens)]
    seed = none_hash(args.algo, "0")
    print(f"prompt {args.tokens} tokens, {args.algo}, medians of {args.repeats} runs")
    header = (
        f"{'block':>5} {'blocks':>6} {'params B':>9} {'vLLM hash ms':>12} "
        f"{'encode ms':>9} {'decode+verify ms':>16} {'verify/hash':>11}"
    )
    print(header)
    for block_size in BLOCK_SIZES:
        hashes = block_hash_chain(tokens, block_size, args.algo, seed)
        contract = ContractId(
            model="kvpilot/tiny-llama",
            block_size=block_size,
            hash_algo=args.algo,
            seed_id=seed_identity(seed),
            kv_dtype="bfloat16",
            kv_layout="NHD",
        )
        wire = json.dumps({PARAMS_KEY: encode_offer(contract, hashes)})
        received = json.loads(wire)[PARAMS_KEY]

        baseline = _median_ms(partial(_vllm_hash_chain, tokens, block_size, args.algo, seed), args.repeats)
        encode = _median_ms(partial(encode_offer, contract, hashes), args.repeats)
        verify = _median_ms(partial(_decode_and_verify, received, contract, hashes), args.repeats)
        print(
            f"{block_size:>5} {len(hashes):>6} {len(wire):>9} {baseline:>12.3f} "
            f"{encode:>9.3f} {verify:>16.3f} {verify / baseline:>10.1%}"
        )


if __name__ == "__main__":
    main()
