"""Positive control: the same scenarios through vLLM's plain NixlConnector, which
attaches a peer's blocks by position, give wrong output with HTTP 200, on a P->D
handoff and on a bidirectional D->P session pull (vllm#43094). If these tests fail,
the verified-attach and session tests prove nothing.

The same for the bytes: a read that brings a reused block's bytes (the holder freed the block
and filled it with other tokens' KV before the read) gives wrong output with HTTP 200 when no
one checks what landed, as NixlConnector checks nothing: here KVPilotConnector with its KV
digest off (``kv_digest: false``), its fault injector damaging the chosen read as in
``tests/e2e/test_fault_matrix.py``, where the digest catches the same faults. A flipped byte
is attached unchecked too (its effect on the answer is one value of one layer's KV)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.deploy.client import Completion, complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import Samples, delta, scrape, total, wait_for_metric
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.parity import LOGPROB_TOLERANCE
from tests.e2e.scenarios import cases, colocated_reference, common_full_blocks
from tests.e2e.sessions import EDITS, GENERATED, block_count, colocated, common_prefix, handshake_both_ways, run_session
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e


PLAIN_HOLD_TTL_S = 300
"""D's hold on its offers in this fleet: long enough for P's first D->P pull. Plain
NixlConnector's engines carry vLLM's thread binding (the model thread on the last core,
beside the NIXL progress threads), and on an AMX Xeon (2026-12-02) P's worker took 68 s
for its first D->P handshake while D held offers; with the CPU fleets' 60 s hold
(``kvpilot.deploy.fleet_spec.DECODE_HOLD_TTL_S``) D had released the session by then, declined
the read as expired, and vLLM left P's request unanswered (the test's 900 s timeout)."""


@pytest.fixture(scope="module")
def nixl_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("nixl-fleet"),
        connector="NixlConnector",
        connector_extra_config={
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": 0,
            "decoder_kv_blocks_ttl": PLAIN_HOLD_TTL_S,
        },
        **block_of(__name__).fleet(),
    )
    with running_fleet(spec) as started:
        yield started


def test_plain_nixl_attaches_by_position_and_answers_wrong(nixl_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    case = cases()[0]  # a reasoning trace stripped from the middle of history
    prefill, decode = nixl_fleet.by_role("prefill")[0].url, nixl_fleet.by_role("decode")[0].url
    x, x_prime = tokenizer.text_token_ids(case.x), tokenizer.text_token_ids(case.x_prime)
    params = complete(prefill, x, max_tokens=1, kv_transfer_params=handoff_request()).kv_transfer_params
    out = complete(decode, x_prime, max_tokens=10, kv_transfer_params=params)
    reference = colocated_reference(decode, x, x_prime, common_full_blocks(x, x_prime))
    assert out.logprobs != reference.logprobs


def test_plain_nixl_pulls_an_edited_session_by_position_and_answers_wrong(
    nixl_fleet: Fleet, tokenizer: PromptTokenizer
) -> None:
    """D's reasoning trace stripped before the next turn: vLLM's P pulls D's blocks
    for the positions they had, attends to KV of other tokens, and answers with HTTP 200."""
    prefill, decode = nixl_fleet.by_role("prefill")[0].url, nixl_fleet.by_role("decode")[0].url
    handshake_both_ways(prefill, decode, tokenizer)
    turn = run_session(prefill, decode, tokenizer, seed=500, edit=EDITS["reasoning trace stripped"])
    offered = turn.x + turn.gen[: GENERATED - 1]
    verified = block_count(common_prefix(offered, turn.x2))
    reference = colocated(decode, turn.x, turn.x2, verified)
    assert turn.p_out.logprobs[0] != reference.logprobs[0] or turn.d_out.logprobs != reference.logprobs


UNCHECKED_FAULTS = {"pc-reused": "reused_block", "pc-corrupt": "corrupt_block"}
"""A request id part -> the fault the unchecked fleet's reader injects into that request's read."""


@pytest.fixture(scope="module")
def unchecked_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("unchecked-fleet"),
        connector_extra_config={
            "kv_digest": False,
            "fault_injection": {"request_ids": UNCHECKED_FAULTS},
            "allow_fault_injection": True,
        },
        **block_of(__name__).fleet(slot=1),
    )
    with running_fleet(spec) as started:
        yield started


def _unchecked_handoff(fleet: Fleet, x: list[int], fault: str) -> tuple[Completion, Completion, Samples, Samples]:
    """P prefills ``x`` for D, D reads it under a request id naming ``fault``: D's answer, its
    co-located answer (a fresh cache salt), and D's metrics before and after."""
    prefill, decode = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url
    params = complete(prefill, x, max_tokens=1, kv_transfer_params=handoff_request()).kv_transfer_params
    assert params is not None and not params["kvpilot"].get("kv_digests"), "digests off: the offer carries none"
    before = scrape(decode)
    out = complete(decode, x, max_tokens=6, kv_transfer_params=params, request_id=f"{fault}-{uuid.uuid4().hex}")
    counter = "vllm:kvpilot_unchecked_reads_total"
    after = wait_for_metric(decode, counter, lambda n: n > total(before, counter))
    reference = complete(decode, x, max_tokens=6, cache_salt=uuid.uuid4().hex)
    return out, reference, before, after


def test_a_reused_block_read_unchecked_answers_wrong(unchecked_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    x = tokenizer.text_token_ids(filler_text(600, 301))
    out, reference, before, after = _unchecked_handoff(unchecked_fleet, x, "pc-reused")
    assert delta(after, before, "vllm:kvpilot_faults_injected_total", kind="reused_block") == 1
    assert delta(after, before, "vllm:kvpilot_integrity_failed_blocks_total") == 0  # attached: nothing checked
    assert out.tokens != reference.tokens or out.max_logprob_diff(reference) > LOGPROB_TOLERANCE


def test_a_flipped_byte_read_unchecked_is_attached(unchecked_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    x = tokenizer.text_token_ids(filler_text(600, 302))
    _, _, before, after = _unchecked_handoff(unchecked_fleet, x, "pc-corrupt")
    assert delta(after, before, "vllm:kvpilot_faults_injected_total", kind="corrupt_block") == 1
    assert delta(after, before, "vllm:kvpilot_integrity_failed_blocks_total") == 0
    assert delta(after, before, "vllm:kvpilot_digest_mismatch_blocks_total") == 0
