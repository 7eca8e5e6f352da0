"""An agent session across pools on real engines (article sections 5 and 9.2-9.4).

Turn 1: P prefills the history ``x`` and hands it to D, which generates the tool
call. Turn 2 arrives at P with the whole history edited the way clients edit it
(section 5) plus a new tool output, and D's end-of-turn kv_transfer_params (vLLM's
bidirectional protocol, as its ``disagg_proxy_multiturn.py`` proxy drives it): P
may pull D's KV of the session instead of recomputing it, then hands the step to D.
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.deploy.agent_session import decoded_turn, prefill_next_turn
from kvpilot.deploy.client import Completion, complete
from kvpilot.deploy.metrics import Samples, scrape, settled
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors.vllm_metrics import KVPILOT_PULL_DECISIONS
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.scenarios import BLOCK_SIZE

GENERATED = 80  # D's tool call: spans blocks, so the session's newest KV is D's
NEW_TOOL_OUTPUT = 60
PULL_DECISIONS = KVPILOT_PULL_DECISIONS.total

Edit = Callable[[list[int], list[int]], list[int]]
"""(turn-1 history x, D's generated ids) -> the history as the client resends it."""


def _strip_trace(x: list[int], gen: list[int]) -> list[int]:
    return x + gen[:40] + gen[56:]  # a reasoning span inside D's output dropped


def _re_render(x: list[int], gen: list[int]) -> list[int]:
    return x + gen[:36] + [t + 1 for t in gen[36:44]] + gen[44:]  # the tool call rendered other bytes


def _truncate(x: list[int], gen: list[int]) -> list[int]:
    return x[96:] + gen  # the oldest history dropped to fit the window


def _change_tool_output(x: list[int], gen: list[int]) -> list[int]:
    return x[:150] + [t + 1 for t in x[150:170]] + x[170:] + gen  # an earlier tool output re-run


EDITS: dict[str, Edit] = {
    "unedited": lambda x, gen: x + gen,
    "reasoning trace stripped": _strip_trace,
    "message re-rendered": _re_render,
    "history truncated": _truncate,
    "tool output changed": _change_tool_output,
}


@dataclass(frozen=True)
class Turn2:
    x: list[int]
    gen: list[int]
    d_params: dict
    d_params_at: float
    """Unix time at which D returned ``d_params``."""
    x2: list[int]
    p_out: Completion
    d_out: Completion
    p_before: Samples
    p_after: Samples


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def history(tokenizer: PromptTokenizer, seed: int) -> list[int]:
    return tokenizer.text_token_ids(f"session {seed}: " + filler_text(300, seed))


FIRST_PULL_TIMEOUT_S = 900.0
"""P's first pull from D makes P's worker handshake with D; on a 2-core box whose
cores NIXL's progress threads spin on, that has taken from 9 s to over 5 minutes."""


def run_session(
    p_url: str,
    d_url: str,
    tokenizer: PromptTokenizer,
    seed: int,
    edit: Edit,
    turn2_salt: str | None = None,
    mutate_params: Callable[[dict], dict | None] = lambda p: p,
    timeout: float = 300.0,
    x: list[int] | None = None,
    generated: int = GENERATED,
) -> Turn2:
    """Turn 1 P->D on history ``x`` (default :func:`history`), D generating
    ``generated`` tokens, then turn 2 on P with D's params (``mutate_params`` of them: P
    pulls from D; ``None``: P prefills beyond its own hit), then on D; each request may
    take ``timeout`` seconds."""
    x = history(tokenizer, seed) if x is None else x
    turn = decoded_turn(p_url, d_url, x, generated, timeout=timeout)
    x2 = edit(x, turn.generated) + tokenizer.text_token_ids(" tool: " + filler_text(NEW_TOOL_OUTPUT, seed + 1))
    extra = {"cache_salt": turn2_salt} if turn2_salt else {}
    before = scrape(p_url)
    p2 = prefill_next_turn(p_url, x2, mutate_params(turn.d_params), timeout=timeout, **extra)
    after = settled(p_url, before)
    d2 = complete(d_url, x2, max_tokens=8, kv_transfer_params=p2.kv_transfer_params, timeout=timeout, **extra)
    return Turn2(x, turn.generated, turn.d_params, turn.d_params_at, x2, p2, d2, before, after)


def colocated(engine_url: str, x: list[int], x2: list[int], reused_blocks: int) -> Completion:
    """The session on one engine under a fresh salt, split where the disaggregated
    run's reuse ends: turn 1 first (when anything is reused), then the edited turn.

    Each reused token's KV is made as the disaggregated run made it. Where that run
    reused blocks of D's generated tokens (P pulled them), turn 1 decodes them here too;
    where it reused no more than turn 1's prompt (P recomputed the rest), turn 1 is a
    prefill alone, so that the generated tokens are prefilled in the edited turn, as P
    prefilled them. On an AMX CPU a token's KV made by a decode step and by a prefill
    differ in their last bits (measured here: first-token logprobs 1e-4 apart), so a
    reference that decoded them would differ from a correct recompute."""
    salt = f"ref-{uuid.uuid4().hex}"
    if reused_blocks:
        generated = GENERATED if reused_blocks > block_count(len(x)) else 1
        complete(engine_url, x, max_tokens=generated, ignore_eos=True, cache_salt=salt)
    return complete(engine_url, x2, max_tokens=8, cache_salt=salt)


KV_PROVENANCE_NOISE = 1e-3
"""Most median |logprob diff| over an answer's tokens between two correct answers whose KV
was made differently (a token's KV by a decode step in one, by a prefill in the other):
0 on AVX2-only CPUs, where they are bit-identical. On an AMX Xeon (2026-12-02, the forced
reprefill and affinity sessions of ``test_sessions``, 2 x 88 tokens per option) most
tokens agreed within 5e-4 (medians 1e-4) and 10 to 12% differed by one bf16 step of the
logits (0.0153-0.0158); one greedy choice flipped (affinity, step 2, token 48, its
logprob 0.0158 from the reference's); the local and pull sessions, whose
KV is made as the reference's, were bit-identical. Wrong KV moves every token's logprob
(8e-3 for 60 tokens cut by position: shared/DESIGN.md)."""
ROUNDING_STEP = 0.03
"""Most |logprob diff| at any one token of two such answers: under two bf16 steps (1/64
each) of the logits, which a few tokens' noise crosses (0.0157 measured on the AMX Xeon),
as does a greedy choice between near-tied tokens flipped by it (``bench_agent``'s tolerance)."""


def numerically_same(out: Completion, ref: Completion) -> bool:
    """``out`` equals ``ref`` up to the noise of KV made another way, for answers whose KV
    cannot be made as the reference's is (P re-prefilled tokens that D decoded): over the
    tokens up to and including the first that differs (:meth:`Completion.divergence`), the
    median |logprob diff| within :data:`KV_PROVENANCE_NOISE` and each within :data:`ROUNDING_STEP`."""
    diffs = logprob_diffs(out, ref)
    return bool(diffs) and statistics.median(diffs) <= KV_PROVENANCE_NOISE and max(diffs) <= ROUNDING_STEP


def logprob_diffs(out: Completion, ref: Completion) -> list[float]:
    """|logprob diff| per token up to and including the first differing one (none when the lengths differ)."""
    first, _ = out.divergence(ref)
    if len(out.logprobs) != len(ref.logprobs) or len(out.tokens) != len(ref.tokens):
        return []
    end = len(out.logprobs) if first is None else first + 1
    return [abs(a - b) for a, b in zip(out.logprobs[:end], ref.logprobs[:end], strict=True)]


def colocated_steps(engine_url: str, steps: list[tuple[list[int], Completion]]) -> list[Completion]:
    """A session's steps (each prompt, and the answer the fleet gave) again on one engine
    under a fresh salt (no P/D, no router): the reference each answer must equal. Each
    step reuses the last one's generated tokens as this engine decoded them."""
    salt = f"ref-{uuid.uuid4().hex}"
    return [
        complete(engine_url, prompt, max_tokens=len(out.tokens), ignore_eos=True, cache_salt=salt)
        for prompt, out in steps
    ]


def block_count(tokens: int) -> int:
    return tokens // BLOCK_SIZE


def handshake_both_ways(p_url: str, d_url: str, tokenizer: PromptTokenizer) -> None:
    """One session off the tests' clock: D's first pull from P and P's first pull
    from D pay the one-time NIXL handshakes here."""
    run_session(p_url, d_url, tokenizer, seed=1, edit=EDITS["unedited"], timeout=FIRST_PULL_TIMEOUT_S)
