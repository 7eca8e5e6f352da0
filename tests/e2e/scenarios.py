"""Scenarios for the verified-attach tests: D receives P's kv_transfer_params for
prompt X while its own prompt is X' (history edits of section 5.2 of the article)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import Completion, complete
from kvpilot.deploy.fleet_spec import FleetSpec, plan_fleet
from kvpilot.deploy.metrics import delta, scrape, settled
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.kvconnectors.pull_params import handoff_request
from tests.fakes.ports import block_of

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


@contextmanager
def p_and_d_engines(
    model_dir: Path, run_dir: Path, module: str, kv_transfer: Callable[[str], dict[str, object]]
) -> Iterator[list[fleet_io.RunningProcess]]:
    """1 P + 1 D engine, as ``kvpilot fleet up`` plans them on e2e module ``module``'s ports,
    each started with ``kv_transfer(its name)`` as its ``--kv-transfer-config`` in place of
    the fleet's; no router (the test is the proxy). Stopped on exit."""
    spec = FleetSpec(model_dir=model_dir, run_dir=run_dir, disaggregation="always", **block_of(module).fleet())
    plans, _router, _config = plan_fleet(spec)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started: list[fleet_io.RunningProcess] = []
    try:
        for plan in plans:
            argv = list(plan.argv)
            argv[argv.index("--kv-transfer-config") + 1] = json.dumps(kv_transfer(plan.name))
            started.append(fleet_io.start(dataclasses.replace(plan, argv=tuple(argv)), logs, timeout=600))
        for engine in started:
            fleet_io.warm_up(f"http://127.0.0.1:{engine.port}", spec.served_model_name)
        yield started
    finally:
        for engine in reversed(started):
            fleet_io.stop_group(engine.pid)


def decode_verified(
    decode_url: str, x: list[int], x_prime: list[int], params: dict, salt: str, logprob_tolerance: float = 0.0
) -> None:
    """D answers X' with P's ``params`` (P prefilled X): it verified exactly the blocks X and
    X' share, loaded them, rejected at the first that differs, and answered as a co-located
    run of X' does (tokens equal; logprobs within ``logprob_tolerance``)."""
    before = scrape(decode_url)
    out = complete(decode_url, x_prime, max_tokens=10, kv_transfer_params=params, cache_salt=salt)
    after = settled(decode_url, before)
    expected = common_full_blocks(x, x_prime)
    edited = expected < len(x) // BLOCK_SIZE
    assert expected >= 5
    assert delta(after, before, VERIFIED) == expected
    assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") >= expected * BLOCK_SIZE
    assert (delta(after, before, REJECTED) >= 1) == edited
    reference = colocated_reference(decode_url, x, x_prime, expected)
    assert out.tokens == reference.tokens
    assert out.max_logprob_diff(reference) <= logprob_tolerance, f"max logprob diff {out.max_logprob_diff(reference)}"
