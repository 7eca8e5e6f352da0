"""Pull or recompute a session's span: what the live pull policy chooses on real
engines, against vLLM's fixed 64-token rule, with the measured TTFT of both choices.

Two cases of a two-turn agent session (the span is D's KV beyond P's own hit: the
blocks D's generated tokens completed):

* ``long context, 1 block``: ~3,500 tokens of history, a 32-token span. The 64-token
  rule recomputes it; recomputing 32 tokens attends to the whole context.
* ``short context, 3 blocks``: ~150 tokens of history, a 96-token span. The rule pulls it.

One run, two fleets of 1 P + 1 D (bidirectional), one after the other:

1. **forced**: P with ``kv_recompute_threshold`` 0 pulls every verified span. Each
   case runs ``--reps`` times with D's params on turn 2 (**pull**) and ``--reps`` times
   without them (**recompute**: P prefills beyond its own hit), interleaved. P's TTFT
   is the latency of its turn-2 prefill (``max_tokens=1``), measured at P.
2. **live**: P with no threshold: the policy decides each turn-2 span from P's own
   load, NIXL transfers and measured prefill rate (the roofline prior until P has
   timed enough steps); its choices are read from P's
   ``vllm:kvpilot_pull_decisions_total``.

It prints per case the median TTFT of each choice, their ratio, the rule's choice,
the policy's choices, and whether the policy picked the faster one.

    python -m benchmarks.bench_pull_policy
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.agent_session import decoded_turn, prefill_next_turn
from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape
from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import ensure_tiny_model
from kvpilot.kvconnectors.vllm_metrics import KVPILOT_PULL_DECISIONS
from kvpilot.policies.recompute_vs_transfer import VLLM_RECOMPUTE_BELOW_TOKENS
from kvpilot.routing.serve.tokenizer import PromptTokenizer

BLOCK = 32


@dataclass(frozen=True)
class Case:
    name: str
    history_words: int
    span_blocks: int

    @property
    def span_tokens(self) -> int:
        return self.span_blocks * BLOCK

    @property
    def rule(self) -> str:
        return "recompute" if self.span_tokens < VLLM_RECOMPUTE_BELOW_TOKENS else "pull"


CASES = (Case("long context, 1 block", 3500, 1), Case("short context, 3 blocks", 150, 3))


def history(tokenizer: PromptTokenizer, case: Case, seed: int) -> list[int]:
    """A history of whole blocks, so that D's ``span_blocks * 32 + 1`` generated
    tokens complete exactly ``span_blocks`` more blocks (the last token has no KV yet)."""
    ids = tokenizer.text_token_ids(f"session {seed}: " + filler_text(case.history_words, seed))
    return ids[: len(ids) // BLOCK * BLOCK]


def turn_two_ttft(p_url: str, d_url: str, tokenizer: PromptTokenizer, case: Case, seed: int, pull: bool) -> float:
    """One session; P's turn-2 TTFT, with D's params (P may pull) or without."""
    x = history(tokenizer, case, seed)
    turn = decoded_turn(p_url, d_url, x, case.span_tokens + 1, timeout=900)
    x2 = x + turn.generated + tokenizer.text_token_ids(" tool: " + filler_text(40, seed + 1))
    p2 = prefill_next_turn(p_url, x2, turn.d_params if pull else None, timeout=900)
    complete(d_url, x2, max_tokens=1, kv_transfer_params=p2.kv_transfer_params, timeout=900)  # frees P's blocks
    return p2.total_seconds


@contextmanager
def fleet(extra: dict[str, object], tokenizer: PromptTokenizer) -> Iterator[tuple[str, str]]:
    spec = FleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=Path(tempfile.mkdtemp(prefix="kvpilot-bench-")),
        disaggregation="always",
        connector_extra_config={"bidirectional_kv_xfer": True, **extra},
        engine_port=8710,
        side_channel_port=6110,
        events_port=6710,
        router_port=8700,
    )
    started = fleet_io.up(spec, progress=lambda _: None)
    try:
        p_url, d_url = started.by_role("prefill")[0].url, started.by_role("decode")[0].url
        for seed in (1, 2, 3):  # the one-time handshakes both ways, and P's first link samples
            turn_two_ttft(p_url, d_url, tokenizer, CASES[1], seed, pull=True)
        yield p_url, d_url
    finally:
        fleet_io.down(spec.run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4, help="sessions per case and choice")
    args = parser.parse_args()
    tokenizer = PromptTokenizer(ensure_tiny_model())
    ttft: dict[tuple[str, str], list[float]] = {}
    with fleet({"kv_recompute_threshold": 0}, tokenizer) as (p_url, d_url):
        for case in CASES:
            for rep in range(args.reps):
                for pull in (True, False):
                    seed = 100 * (CASES.index(case) + 1) + 2 * rep + int(pull)
                    choice = "pull" if pull else "recompute"
                    ttft.setdefault((case.name, choice), []).append(
                        turn_two_ttft(p_url, d_url, tokenizer, case, seed, pull)
                    )
    chosen: dict[str, dict[str, int]] = {}
    with fleet({}, tokenizer) as (p_url, d_url):
        for case in CASES:
            for rep in range(args.reps):
                before = scrape(p_url)
                turn_two_ttft(p_url, d_url, tokenizer, case, 1000 * (CASES.index(case) + 1) + rep, pull=True)
                after = scrape(p_url)
                for choice in ("pull", "recompute"):
                    n = int(delta(after, before, KVPILOT_PULL_DECISIONS.total, decision=choice))  # measured or prior
                    chosen.setdefault(case.name, {"pull": 0, "recompute": 0})[choice] += n

    print(f"{args.reps} sessions per case and choice; P's turn-2 TTFT (median s), measured at P")
    print(
        f"{'case':26} {'span':>5} {'pull s':>8} {'recompute s':>11} {'pull/rec':>8} {'64-token rule':>13} "
        f"{'policy chose':>18} {'faster':>9}"
    )
    for case in CASES:
        pull_s = statistics.median(ttft[(case.name, "pull")])
        recompute_s = statistics.median(ttft[(case.name, "recompute")])
        faster = "pull" if pull_s < recompute_s else "recompute"
        counts = chosen[case.name]
        chose = f"pull {counts['pull']}, rec {counts['recompute']}"
        print(
            f"{case.name:26} {case.span_tokens:5d} {pull_s:8.3f} {recompute_s:11.3f} {pull_s / recompute_s:8.2f} "
            f"{case.rule:>13} {chose:>18} {faster:>9}"
        )


if __name__ == "__main__":
    main()
