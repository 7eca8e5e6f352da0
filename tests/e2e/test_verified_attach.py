"""Verified KV attach on real engines: D loads only the blocks whose token hashes
verify against its own prompt, recomputes the rest, and answers exactly like a
co-located run; malformed kv_transfer_params are served by local prefill."""

from __future__ import annotations

import uuid

import pytest

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.metrics import delta, scrape, settled
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.scenarios import (
    BLOCK_SIZE,
    PROMPT_TOKENS,
    RECOMPUTED,
    REJECTED,
    VERIFIED,
    Case,
    cases,
    colocated_reference,
    common_full_blocks,
    prefill_on,
    run_case,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_misaligned_kv_is_never_attached(pd_fleet: Fleet, tokenizer: PromptTokenizer, case: Case) -> None:
    prefill, decode = pd_fleet.by_role("prefill")[0].url, pd_fleet.by_role("decode")[0].url
    unique = uuid.uuid4().hex[:8]  # no accidental local prefix hit from earlier tests
    p_salt, d_salt = f"{case.p_salt or 'case'}-{unique}", f"{case.d_salt or 'case'}-{unique}"
    x, x_prime = tokenizer.text_token_ids(case.x), tokenizer.text_token_ids(case.x_prime)
    expected_verified = common_full_blocks(x, x_prime) if p_salt == d_salt else 0

    out, before, after = run_case(prefill, decode, x, x_prime, p_salt, d_salt)
    reference = colocated_reference(decode, x, x_prime, expected_verified)

    assert out.tokens == reference.tokens
    assert out.logprobs == reference.logprobs, f"max logprob diff {out.max_logprob_diff(reference)}"
    transferred = delta(after, before, PROMPT_TOKENS, source="external_kv_transfer")
    computed = delta(after, before, PROMPT_TOKENS, source="local_compute")
    # The verified prefix before the edit is still transferred, not recomputed.
    assert delta(after, before, VERIFIED) == expected_verified
    assert transferred == expected_verified * BLOCK_SIZE
    assert computed == len(x_prime) - transferred
    # The metrics name the reason and count the recomputed tokens.
    rejected = delta(after, before, REJECTED, reason=case.reason)
    recomputed = delta(after, before, RECOMPUTED, reason=case.reason)
    assert rejected >= 1
    assert recomputed == min(len(x), len(x_prime)) - transferred


MALFORMED = {
    "no kvpilot offer": lambda p: {k: v for k, v in p.items() if k != "kvpilot"},
    "unknown version": lambda p: {**p, "kvpilot": {**p["kvpilot"], "version": 99}},
    "truncated digests": lambda p: {
        **p,
        "kvpilot": {**p["kvpilot"], "block_digests": p["kvpilot"]["block_digests"][:-8]},
    },
    "garbage digests": lambda p: {**p, "kvpilot": {**p["kvpilot"], "block_digests": "!!not base64!!"}},
    "block size a string": lambda p: {
        **p,
        "kvpilot": {**p["kvpilot"], "contract": {**p["kvpilot"]["contract"], "block_size": "32"}},
    },
    "kvpilot not an object": lambda p: {**p, "kvpilot": "garbage"},
    "remote_port a string": lambda p: {**p, "remote_port": "http"},
    "remote_block_ids garbage": lambda p: {**p, "remote_block_ids": "abc"},
    "do_remote_prefill alone": lambda p: {"do_remote_prefill": True},
}


@pytest.mark.parametrize("mutation", list(MALFORMED), ids=str)
def test_malformed_params_are_served_by_local_prefill(
    pd_fleet: Fleet, tokenizer: PromptTokenizer, mutation: str
) -> None:
    prefill, decode = pd_fleet.by_role("prefill")[0].url, pd_fleet.by_role("decode")[0].url
    x = tokenizer.text_token_ids(filler_text(300, 9))
    params = MALFORMED[mutation](prefill_on(prefill, x, salt=None))
    salt = f"fuzz-{uuid.uuid4().hex}"  # no local hit: D must prefill everything itself
    before = scrape(decode)
    out = complete(decode, x, max_tokens=6, kv_transfer_params=params, cache_salt=salt)
    after = settled(decode, before)
    reference = complete(decode, x, max_tokens=6, cache_salt=f"ref-{uuid.uuid4().hex}")
    assert out.same_output(reference)
    assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == 0
    assert delta(after, before, RECOMPUTED, reason="malformed_params") == len(x)
    assert fleet_io.is_healthy(decode)
    assert complete(decode, x, max_tokens=2, cache_salt=salt).tokens  # and keeps serving
