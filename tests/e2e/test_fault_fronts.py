"""The data plane's faults through the router's fronts: on a 1 P + 1 D fleet whose engines'
fault injector corrupts half the reads at random (``fault_injection.rate`` 0.5, seeded), a
client's requests sent through the relay (``fleet.router``) and through Envoy with the
endpoint picker (``fleet.gateway``) are each answered as D answers co-located, whether D's
digest check caught a corrupted block (and D recomputed from it) or the read was clean.
(``tests/e2e/test_fault_matrix.py`` drives each kind of fault on a chosen read; the fronts
carry no client's request id to the engines, so here the faults fall at random. Not every
read: the fleet's pair warm-up needs one clean handoff before the fleet is up.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.parity import LOGPROB_TOLERANCE
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

BLOCK = block_of(__name__)
ANSWER_BOUND_S = 120.0
"""How long a request may take: P's prefill, D's read and recomputation, six tokens, on a
loaded 2-core box."""
MISMATCHES = "vllm:kvpilot_digest_mismatch_blocks_total"
MAX_REQUESTS = 8
"""Requests a front is sent, at most, until one of its reads was corrupted."""
PEER_RETRY_AFTER_S = 1.0
"""A failed read marks its peer failed for this long: short, so that the next request reads again."""


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=tmp_path_factory.mktemp("fault-fronts-fleet"),
        disaggregation="always",
        gateway_port=BLOCK.spare(0),
        picker_port=BLOCK.spare(1),
        envoy_admin_port=BLOCK.spare(2),
        connector_extra_config={
            "fault_injection": {"kinds": ["corrupt_block"], "rate": 0.5, "seed": 7},
            "allow_fault_injection": True,
            "peer_retry_after_s": PEER_RETRY_AFTER_S,
        },
        **BLOCK.fleet(),
    )
    with running_fleet(spec) as started:
        yield started


@pytest.mark.parametrize("front", ["relay", "envoy"])
def test_reads_corrupted_at_random_still_answer_as_d_does_colocated(
    fleet: Fleet, tokenizer: PromptTokenizer, front: str
) -> None:
    assert fleet.gateway is not None, "the fleet runs no Envoy"
    url = fleet.router.url if front == "relay" else fleet.gateway.url
    decode = fleet.by_role("decode")[0].url
    first = scrape(decode)
    for k in range(MAX_REQUESTS):
        time.sleep(PEER_RETRY_AFTER_S)  # a corrupted read's peer is read from again
        x = tokenizer.text_token_ids(filler_text(600, 131 + k + (0 if front == "relay" else 50)))
        before = scrape(decode)
        out = complete(url, x, max_tokens=6, timeout=ANSWER_BOUND_S)
        reference = complete(decode, x, max_tokens=6, cache_salt=uuid.uuid4().hex)
        assert out.tokens == reference.tokens and out.max_logprob_diff(reference) <= LOGPROB_TOLERANCE, k
        after = settled(decode, before, finished=2)
        if delta(after, first, MISMATCHES) >= 1:
            break
    assert delta(after, first, MISMATCHES) >= 1, f"no read of {MAX_REQUESTS} requests was corrupted"
    assert delta(after, first, "vllm:kvpilot_faults_injected_total", kind="corrupt_block") >= 1
