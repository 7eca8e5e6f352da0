"""The contract the offer and verification tests share."""

from __future__ import annotations

from kvpilot.kvconnectors.hash_contract import none_hash, seed_identity
from kvpilot.kvconnectors.transfer_params import ContractId

CONTRACT = ContractId(
    model="kvpilot/tiny-llama",
    block_size=16,
    hash_algo="sha256",
    seed_id=seed_identity(none_hash("sha256", "0")),
    kv_dtype="bfloat16",
    kv_layout="NHD",
)
