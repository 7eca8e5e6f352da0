"""Scenarios for the verified-attach tests: D receives P's kv_transfer_params for
prompt X while its own prompt is X' (history edits of section 5.2 of the article)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvpilot.deploy.client import Completion, complete
from kvpilot.deploy.metrics import scrape, settled
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.kvconnectors.pull_params import handoff_request

BLOCK_SIZE = 32
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2
"""The tiny model's KV per token: 4 layers x (K + V) x 2 KV heads x head_dim 64 x 2
bytes (vLLM CPU runs the model in bf16)."""
PROMPT_TOKENS = vm.PROMPT_TOKENS_BY_SOURCE.total
NIXL_BYTES = vm.NIXL_BYTES_TRANSFERRED.sum
REJECTED = vm.KVPILOT_REJECTED_BLOCKS.total
RECOMPUTED = vm.KVPILOT_RECOMPUTED_TOKENS.total
VERIFIED = vm.KVPILOT_VERIFIED_BLOCKS.total


@dataclass(frozen=True)
class Case:
    name: str
    x: str  # what P prefilled
    x_prime: str  # what D is asked
    p_salt: str | None = None
    d_salt: str | None = None
    reason: str = "token_mismatch"


def cases() -> list[Case]:
    system, tail = filler_text(300, 1), filler_text(120, 2)

    def turn(k: int) -> str:
        return f"\nUser: step {k} " + filler_text(40, 10 + k)

    think = "\nAssistant: <think>" + filler_text(200, 3) + "</think> run the test"
    history = system + "".join(turn(k) for k in range(6))
    return [
        Case("reasoning trace stripped", system + think + tail, system + "\nAssistant: run the test" + tail),
        Case(
            "message re-rendered",
            history + '\nassistant: {"tool": "pytest"}' + tail,
            history + "\n<|assistant|>\ntool=pytest" + tail,
        ),
        Case("front truncated", history + tail, history[len(system) :] + tail),
        Case("another cache_salt", history, history, p_salt="tenant-a", d_salt="tenant-b", reason="contract_mismatch"),
    ]


def prefill_on(engine_url: str, token_ids: list[int], salt: str | None) -> dict:
    """P's side of a handoff: prefill with max_tokens=1, return kv_transfer_params."""
    extra = {"cache_salt": salt} if salt else {}
    out = complete(engine_url, token_ids, max_tokens=1, kv_transfer_params=handoff_request(), **extra)
    assert out.kv_transfer_params is not None and "kvpilot" in out.kv_transfer_params
    return out.kv_transfer_params


def common_full_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BLOCK_SIZE


def colocated_reference(engine_url: str, x: list[int], x_prime: list[int], verified_blocks: int) -> Completion:
    """X' on one engine under a fresh salt, split exactly where D's verified prefix ends:
    run X first when a verified prefix exists, so X' hits it in the prefix cache."""
    salt = f"ref-{uuid.uuid4().hex}"
    if verified_blocks:
        complete(engine_url, x, max_tokens=1, cache_salt=salt)
    return complete(engine_url, x_prime, max_tokens=10, cache_salt=salt)


def run_case(p_url: str, d_url: str, x: list[int], x_prime: list[int], p_salt: str | None, d_salt: str | None):
    params = prefill_on(p_url, x, p_salt)
    before = scrape(d_url)
    extra = {"cache_salt": d_salt} if d_salt else {}
    out = complete(d_url, x_prime, max_tokens=10, kv_transfer_params=params, **extra)
    return out, before, settled(d_url, before)
