"""P -> D on a hybrid model: 1 prefill + 1 decode engine with KVPilotConnector serving the
tiny Gemma 3 model of :mod:`tests.e2e.hybrid_model` (sliding-window layers, window 64,
beside full-attention ones: two KV cache groups), every request prefilled on P.

Each case sends its requests through the router, checks that each went P -> D
(``remote_prefill``, no fallback, nothing rejected, recomputed or failed on D) and where
D's prompt KV came from (its own counters), and compares D's answer with D's own local
prefill of the same prompt under a fresh ``cache_salt``: the same tokens and the same
logprobs, bit for bit. Random weights make the logprobs move with any wrong KV, and
on this model a prefill split at a prefix hit (P's, or D's) rounds exactly as the
unsplit one does, so no tolerance is needed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kvpilot.deploy.client import Completion, complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.hybrid_model import HYBRID_SPEC, ensure_hybrid_model
from tests.e2e.scenarios import BLOCK_SIZE, PROMPT_TOKENS, RECOMPUTED, REJECTED, VERIFIED
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
WINDOW = HYBRID_SPEC.sliding_window
LOAD_FAILURES = vm.KVPILOT_LOAD_FAILURES.total


@dataclass(frozen=True, slots=True)
class Handoff:
    """One request through the fleet, and where D's prompt KV came from (D's own counters)."""

    out: Completion
    hit: int
    """Prompt tokens D found in its prefix cache."""
    received: int
    """Prompt tokens whose KV D received over NIXL."""
    computed: int
    """Prompt tokens D prefilled itself."""
    verified_blocks: int
    """Offered blocks KVPilotConnector verified and D loaded."""
    prefill_hit: int
    """Prompt tokens P found in its prefix cache (it prefilled the rest)."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(
        model_dir=ensure_hybrid_model(),
        run_dir=tmp_path_factory.mktemp("hybrid-pd"),
        disaggregation="always",
        max_model_len=HYBRID_SPEC.max_position_embeddings,
        **block_of(__name__).fleet(),
    )
    with running_fleet(spec) as started:
        yield started


@pytest.fixture(scope="module")
def words() -> Callable[[int, int], list[int]]:
    """``n`` filler words as token ids (no BOS), the same for the same ``(n, seed)``."""
    tokenizer = PromptTokenizer(ensure_hybrid_model())
    return lambda n, seed: tokenizer.text_token_ids(filler_text(n, seed))


def _through_fleet(fleet: Fleet, token_ids: list[int]) -> Handoff:
    """Send ``token_ids`` to the router; assert it went P -> D and that D loaded the
    offer whole (nothing rejected, recomputed or failed)."""
    prefill, decode = fleet.by_role("prefill")[0], fleet.by_role("decode")[0]
    p0, d0, r0 = scrape(prefill.url), scrape(decode.url), scrape(fleet.router.url)
    out = complete(fleet.router.url, token_ids, max_tokens=MAX_TOKENS)
    p1, d1, r1 = settled(prefill.url, p0), settled(decode.url, d0), scrape(fleet.router.url)
    assert out.headers.get("X-KVPilot-Route") == "remote_prefill", dict(out.headers)
    assert delta(r1, r0, "kvpilot_router_decisions_total", kind="remote_prefill") == 1
    assert delta(r1, r0, "kvpilot_router_prefill_fallbacks_total") == 0
    for family in (REJECTED, RECOMPUTED, LOAD_FAILURES):
        assert delta(d1, d0, family) == 0, family
    return Handoff(
        out,
        hit=int(delta(d1, d0, PROMPT_TOKENS, source=vm.PromptTokenSource.LOCAL_CACHE_HIT.value)),
        received=int(delta(d1, d0, PROMPT_TOKENS, source=vm.PromptTokenSource.EXTERNAL_KV_TRANSFER.value)),
        computed=int(delta(d1, d0, PROMPT_TOKENS, source=vm.PromptTokenSource.LOCAL_COMPUTE.value)),
        verified_blocks=int(delta(d1, d0, VERIFIED)),
        prefill_hit=int(delta(p1, p0, PROMPT_TOKENS, source=vm.PromptTokenSource.LOCAL_CACHE_HIT.value)),
    )


def _assert_equals_local_prefill(fleet: Fleet, handoff: Handoff, prompt: list[int]) -> None:
    decode = fleet.by_role("decode")[0]
    reference = complete(decode.url, prompt, max_tokens=MAX_TOKENS, cache_salt=f"ref-{uuid.uuid4().hex}")
    assert handoff.out.same_output(reference), f"max logprob diff {handoff.out.max_logprob_diff(reference)}"


def test_a_fresh_prompt_longer_than_the_window(fleet: Fleet, words: Callable[[int, int], list[int]]) -> None:
    """D receives the whole prompt over NIXL (of the sliding-window group, only the
    blocks still in the window) and answers as its own prefill does, bit for bit."""
    prompt = words(450, 41)
    assert len(prompt) > 4 * WINDOW
    handoff = _through_fleet(fleet, prompt)
    assert (handoff.hit, handoff.received, handoff.computed) == (0, len(prompt), 0)
    assert handoff.verified_blocks == len(prompt) // BLOCK_SIZE
    assert handoff.prefill_hit == 0
    _assert_equals_local_prefill(fleet, handoff, prompt)


def test_an_extended_prompt_pulls_only_what_follows_decodes_local_hit(
    fleet: Fleet, words: Callable[[int, int], list[int]]
) -> None:
    """An earlier prompt went P -> D, so D holds its full blocks: all of them in the
    full-attention group, the last in-window ones in the sliding-window group, which is
    all a hit needs there. Extended, it hits D's cache up to the earlier prompt's last
    full block, and D pulls only the rest, each group's blocks paired by vLLM's NIXL
    pull (a sliding-window group's from the end of P's list)."""
    first = words(400, 42)
    _through_fleet(fleet, first)
    extended = first + words(200, 43)
    handoff = _through_fleet(fleet, extended)
    hit = len(first) // BLOCK_SIZE * BLOCK_SIZE
    assert hit > WINDOW
    assert (handoff.hit, handoff.received, handoff.computed) == (hit, len(extended) - hit, 0)
    assert handoff.verified_blocks == len(extended) // BLOCK_SIZE - hit // BLOCK_SIZE
    assert handoff.prefill_hit == hit  # P prefilled only the new tokens too
    _assert_equals_local_prefill(fleet, handoff, extended)


def test_a_prompt_sharing_a_short_prefix_with_an_earlier_one(
    fleet: Fleet, words: Callable[[int, int], list[int]]
) -> None:
    """The prompts share 3 full blocks, more than the window, but neither engine hits
    them: a hit needs the sliding-window group's blocks just before its end, and
    neither P (which prefilled the earlier prompt) nor D (which received only its
    in-window blocks) still holds those early blocks there. P prefills the whole
    prompt and D pulls all of it."""
    earlier = words(400, 44)
    _through_fleet(fleet, earlier)
    shared = 3 * BLOCK_SIZE + 4
    assert shared > WINDOW
    prompt = earlier[:shared] + words(400, 45)
    handoff = _through_fleet(fleet, prompt)
    assert (handoff.hit, handoff.received, handoff.computed) == (0, len(prompt), 0)
    assert handoff.verified_blocks == len(prompt) // BLOCK_SIZE
    assert handoff.prefill_hit == 0
    _assert_equals_local_prefill(fleet, handoff, prompt)
