"""A router that knows how long things take (issue 20, item 4), on the CPU fleet as
``kvpilot fleet up`` starts it (1 P + 1 D, conditional disaggregation, the router's
defaults: measured rates, the stall and cost checks), after a warm-up that fits P's
prefill, D's decode step and KV reads, and the overhead around them:

* on an agent session, the chosen option's predicted TTFT (the answer's
  ``X-KVPilot-Predicted-TTFT-Ms``) is within 2x of the TTFT the client measures on at
  least 80% of the steps;
* a session step with a large increment, on an idle D, takes the cheaper of the router's
  own predictions for D prefilling it and for P prefilling it for D, and both predictions
  are within 2x of those two ways measured on twin sessions, straight to the engines.
  Which way is faster is not asserted: on an idle D the two differ by a loopback
  transfer and a hop, a near-tie any other process on the box decides;
* the same step moves off a D running long streams, because prefilling it on D would
  stall them past the budget, and that stall is real: D prefilling a twin paused its
  streams at least half the priced stall. What the remote way cost instead (its TTFT,
  D's worst token gap meanwhile) is measured and printed (``pytest -s``), not
  asserted: on this 2-core box a busy D's front end spills onto P's core and the
  remote way was often the slower one (docs/concepts/policies.md).
"""

from __future__ import annotations

import itertools
import re
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpilot.deploy.client import Completion, complete, debug_route, wait_for_overlap
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape
from kvpilot.deploy.prompts import filler_text
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.policies.session_options import TIE_ORDER, Option
from kvpilot.routing.serve.driver import PREDICTED_TTFT_HEADER
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.scenarios import BLOCK_SIZE
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()
WARM_UP_WORDS = (150, 450, 900, 1400, 2000)
"""Fresh prompts (every one prefilled on P: no D holds any of it) that give P's prefill
model samples at five lengths before anything is asserted ..."""
WARM_UP_EXTENSION_WORDS = 40
"""... each followed by itself and this many words more: a prefill as short as a session
step's increment after a cached context (from fresh prompts alone the fit cannot tell a
fixed cost from attention over the context, and extrapolates both to a step: CI's box
priced a 71-token step at 2x its TTFT)."""
GENERATED = 24
STEPS = 10
FIRST_STEPS = 5
"""Steps of the first session on a fresh fleet (the issue: the first agent steps)."""
WITHIN_2X_SHARE = 0.8
LARGE_INCREMENT_WORDS = 1100
"""About 1,500 tokens of tool output: the issue's large increment."""
LONG_STREAMS = 4
LONG_STREAM_TOKENS = 3000
"""Long enough that D's streams run through both measured choices of the busy step."""
LEARN_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(model_dir=model_dir, run_dir=tmp_path_factory.mktemp("predicted-ttft-fleet"), **PORTS)
    with running_fleet(spec) as started:
        yield started


def _urls(fleet: Fleet) -> tuple[str, str, str]:
    return fleet.router.url, fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url


def _unlearned(router: str, tokenizer: PromptTokenizer) -> list[str]:
    """The models the warm-up must fit before anything is asserted, that are still on the prior."""
    route = debug_route(router, tokenizer.text_token_ids("rates?"))
    learned: dict[str, Any] = route["learned_rates"]
    wanted = (("prefill-0", "prefill"), ("decode-0", "decode_step"), ("decode-0", "kv_read"))
    missing = [f"{engine} {model}" for engine, model in wanted if (learned.get(engine) or {}).get(model) is None]
    return missing + (["overhead"] if route["predicted"]["overhead"]["measured_s"] is None else [])


@pytest.fixture(scope="module")
def warmed(fleet: Fleet, tokenizer: PromptTokenizer) -> Fleet:
    """The fleet once P's prefill, D's decode step and D's KV reads are fitted from the
    engines' own answers and metrics (polled every 5 s), and the overhead around them
    from streamed answers, not the prior: fresh prompts of growing length, each
    prefilled on P and streamed from D, and each extended once, until they are."""
    router = fleet.router.url
    deadline = time.monotonic() + LEARN_TIMEOUT_S
    n = 0
    while n < len(WARM_UP_WORDS) or _unlearned(router, tokenizer):
        assert time.monotonic() < deadline, f"still on the prior: {_unlearned(router, tokenizer)}"
        words = WARM_UP_WORDS[n % len(WARM_UP_WORDS)]
        prompt = tokenizer.text_token_ids(f"warm {n}: " + filler_text(words, 90 + n))
        complete(router, prompt, max_tokens=GENERATED, stream=True)
        time.sleep(0.5)
        extension = tokenizer.text_token_ids(" more: " + filler_text(WARM_UP_EXTENSION_WORDS, 190 + n))
        complete(router, prompt + extension, max_tokens=GENERATED, stream=True)
        n += 1
        time.sleep(0.5)
    return fleet


def _step(router: str, prompt: list[int], session: str, max_tokens: int = GENERATED) -> Completion:
    return complete(
        router,
        prompt,
        max_tokens=max_tokens,
        stream=True,
        ignore_eos=True,
        return_token_ids=True,
        conversation_id=session,
    )


def _tool_output(tokenizer: PromptTokenizer, n: int, words: int, seed: int) -> list[int]:
    return tokenizer.text_token_ids(f" tool: step {n} ok; " + filler_text(words, seed))


def _terms(predicted: dict[str, Any]) -> str:
    """A ``/debug/route`` prediction's terms: each one's seconds and whose measurement it is."""
    parts = []
    for name in ("queue", "prefill", "transfer", "first_step", "overhead"):
        term = predicted[name]
        seconds = term["measured_s"] if term["measured_s"] is not None else term["prior_s"]
        parts.append(f"{name} {seconds * 1e3:.1f} ms ({term['measured_by'] or 'prior'}, {term['samples']})")
    return ", ".join(parts)


def _predicted_s(out: Completion) -> float:
    return float(out.headers[PREDICTED_TTFT_HEADER]) / 1e3


def test_on_a_fresh_fleet_the_first_agent_steps_are_priced_within_2x(fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """No warm-up (this test runs before :func:`warmed`): the router timed D and P itself
    before it served (``server.calibration_workers``, set by ``kvpilot fleet up``; P on
    real handoffs that D reads), so the first steps of the first session are priced by
    measurement, not the H100 prior."""
    router, _, _ = _urls(fleet)
    route = debug_route(router, tokenizer.text_token_ids("rates?"))
    learned = route["learned_rates"]
    for engine, model in (("decode-0", "prefill"), ("decode-0", "decode_step"), ("prefill-0", "prefill")):
        assert (learned.get(engine) or {}).get(model) is not None, (engine, model, learned)
    assert route["predicted"]["prefill"]["measured_s"] is not None, route["predicted"]
    prompt = tokenizer.text_token_ids("session 4100: " + filler_text(600, 4100))
    rows = []
    for n in range(FIRST_STEPS):
        out = _step(router, prompt, "fresh-4100")
        rows.append((n, out.headers["X-KVPilot-Route"], len(prompt), _predicted_s(out), out.ttft_seconds))
        wait_for_overlap(router, prompt, "decode-0", len(prompt) // BLOCK_SIZE)
        prompt = prompt + list(out.token_ids) + _tool_output(tokenizer, n, 40 + 30 * (n % 4), 4200 + n)
    print("\nfresh fleet: step route prompt_tokens predicted_ms measured_ms ratio")
    for n, kind, tokens, predicted, measured in rows:
        print(f"{n} {kind} {tokens} {predicted * 1e3:.1f} {measured * 1e3:.1f} {measured / predicted:.2f}")
    within = [0.5 < measured / predicted <= 2.0 for *_, predicted, measured in rows]
    assert sum(within) >= WITHIN_2X_SHARE * FIRST_STEPS, rows


def test_predicted_ttft_is_within_2x_of_the_measured_on_most_agent_steps(
    warmed: Fleet, tokenizer: PromptTokenizer
) -> None:
    router, _, _ = _urls(warmed)
    prompt = tokenizer.text_token_ids("session 5100: " + filler_text(600, 5100))
    rows, terms = [], []
    for n in range(STEPS):
        terms.append(_terms(debug_route(router, prompt, conversation_id="predicted-5100")["predicted"]))
        out = _step(router, prompt, "predicted-5100")
        assert len(out.token_ids) == GENERATED
        rows.append((n, out.headers["X-KVPilot-Route"], len(prompt), _predicted_s(out), out.ttft_seconds))
        wait_for_overlap(router, prompt, "decode-0", len(prompt) // BLOCK_SIZE)
        prompt = prompt + list(out.token_ids) + _tool_output(tokenizer, n, 40 + 30 * (n % 4), 5200 + n)
    print("\nstep route prompt_tokens predicted_ms measured_ms ratio | the dry run's terms")
    for (n, kind, tokens, predicted, measured), term in zip(rows, terms, strict=True):
        print(f"{n} {kind} {tokens} {predicted * 1e3:.1f} {measured * 1e3:.1f} {measured / predicted:.2f} | {term}")
    within = [0.5 < measured / predicted <= 2.0 for *_, predicted, measured in rows]
    assert sum(within) >= WITHIN_2X_SHARE * STEPS, rows


@dataclass
class Streams:
    """``LONG_STREAMS`` long generations decoding on D, each its token arrival times (read
    once they have ended)."""

    started: list[float]
    futures: list[Future[Completion]]

    def last_token_at(self) -> float:
        """When the first of the streams to end sent its last token."""
        return min(t0 + f.result().token_seconds[-1] for t0, f in zip(self.started, self.futures, strict=True))

    def worst_gap_s(self, start: float, end: float) -> float:
        """The longest wait between two tokens of any stream that ended inside ``[start, end]``."""
        gaps = []
        for t0, future in zip(self.started, self.futures, strict=True):
            arrivals = [t0 + t for t in future.result().token_seconds]
            gaps += [b - a for a, b in itertools.pairwise(arrivals) if start <= b <= end]
        return max(gaps, default=0.0)

    def tpot_s(self) -> float:
        """The streams' median time per output token over their whole run."""
        per_stream = []
        for future in self.futures:
            times = future.result().token_seconds
            per_stream.append((times[-1] - times[0]) / (len(times) - 1))
        return statistics.median(per_stream)


def _long_streams(d: str, tokenizer: PromptTokenizer, pool: ThreadPoolExecutor) -> Streams:
    """Long generations sent straight to D: the router learns of them from D's own
    gauges, as of any traffic that bypasses it, and their token gaps are D's, not the
    router's relay's (on this 2-core box the router shares P's core)."""
    started: list[float] = []
    futures = []
    for n in range(LONG_STREAMS):
        prompt = tokenizer.text_token_ids(f"stream {n}: " + filler_text(60, 7000 + n))
        started.append(time.perf_counter())
        futures.append(pool.submit(complete, d, prompt, max_tokens=LONG_STREAM_TOKENS, stream=True, ignore_eos=True))
    return Streams(started, futures)


def _priced_with_streams(router: str, prompt: list[int], session: str, streams: int) -> None:
    """Wait until the router prices ``prompt``'s local option with ``streams`` running on
    D (it polls D's gauges every 5 s, and adds what they count beyond its own requests
    to its ledger)."""
    deadline = time.monotonic() + 30
    while True:
        local = {o["option"]: o for o in debug_route(router, prompt, conversation_id=session)["options"]}["local"]
        if f"stall on {streams} streams" in local["why"]:
            return
        assert time.monotonic() < deadline, f"the router never saw {streams} streams on D: {local['why']}"
        time.sleep(0.5)


@dataclass(frozen=True)
class Measured:
    """One way of serving a large step: its route, when it was sent and its TTFT."""

    route: str
    sent_at: float
    ttft_s: float
    prefill_s: float = 0.0
    """Of the TTFT, P's prefill (0: none, or not known)."""

    def worst_gap_s(self, streams: Streams) -> float:
        """The worst gap between tokens on D's streams while this step waited for its first token."""
        return streams.worst_gap_s(self.sent_at, self.sent_at + self.ttft_s)


def _first_step(router: str, tokenizer: PromptTokenizer, seed: int) -> list[int]:
    """A session's first step through the router; the next step's prompt, with a large
    tool output, once the router's index shows D holding the first."""
    x = tokenizer.text_token_ids(f"session {seed}: " + filler_text(700, seed))
    out = _step(router, x, f"large-{seed}")
    wait_for_overlap(router, x, "decode-0", len(x) // BLOCK_SIZE)
    return x + list(out.token_ids) + _tool_output(tokenizer, 1, LARGE_INCREMENT_WORDS, seed + 1)


def _straight(way: str, p: str, d: str, prompt: list[int]) -> tuple[float, float]:
    """A twin's large step served ``way`` straight to the engines, no router: D prefilling
    it (``local_prefill``), or P prefilling it for D (``remote_prefill``, the router's
    re-prefill and affinity); its TTFT, and of that P's answer (0 for local)."""
    if way == "local_prefill":
        return complete(d, prompt, max_tokens=GENERATED, stream=True, ignore_eos=True).ttft_seconds, 0.0
    handoff = complete(p, prompt, max_tokens=1, kv_transfer_params=handoff_request())
    assert handoff.kv_transfer_params, "P returned no kv_transfer_params"
    decoded = complete(
        d, prompt, max_tokens=GENERATED, stream=True, ignore_eos=True, kv_transfer_params=handoff.kv_transfer_params
    )
    return handoff.total_seconds + decoded.ttft_seconds, handoff.total_seconds


WAYS = ("local_prefill", "remote_prefill")
TWINS_PER_WAY = 3
"""Each way is measured on this many twins, the ways interleaved, and judged by the
median: one try slowed by something else on the box does not decide."""


def _sessions_at_their_large_step(router: str, tokenizer: PromptTokenizer, seed: int) -> list[list[int]]:
    """Session ``seed`` and its twins (same lengths, other tokens), each one step in: the
    prompts of their large steps."""
    return [_first_step(router, tokenizer, seed + 50 * n) for n in range(1 + len(WAYS) * TWINS_PER_WAY)]


@dataclass(frozen=True)
class Served:
    """The large step through the router, and its twins straight to the engines by way."""

    chosen: Measured
    straight: dict[str, list[Measured]]

    def median_ttft_s(self, way: str) -> float:
        return statistics.median(m.ttft_s for m in self.straight[way])

    def median_gap_s(self, way: str, streams: Streams) -> float:
        return statistics.median(m.worst_gap_s(streams) for m in self.straight[way])


def _serve_every_way(fleet: Fleet, seed: int, prompts: list[list[int]]) -> tuple[Served, dict]:
    """Session ``seed``'s large step through the router (its choice), then the twins'
    straight to the engines, the ways taken in turn; the router's ``/debug/route`` view
    of the first, priced on the state the step then meets (nothing is sent between the
    two), with the router's stage times of it (``stages_ms``)."""
    router, p, d = _urls(fleet)
    before = scrape(router)
    priced = debug_route(router, prompts[0], conversation_id=f"large-{seed}")
    t0 = time.perf_counter()
    out = _step(router, prompts[0], f"large-{seed}")
    after = scrape(router)
    chosen = Measured(f"router: {out.headers['X-KVPilot-Route']}", t0, out.ttft_seconds)
    priced["stages_ms"] = {
        stage: round(delta(after, before, "kvpilot_router_ttft_stage_seconds_sum", stage=stage) * 1e3, 1)
        for stage in ("route", "prefill", "decode_first_token")
    }
    straight: dict[str, list[Measured]] = {way: [] for way in WAYS}
    for n, twin in enumerate(prompts[1:]):
        way = WAYS[n % len(WAYS)]
        sent = time.perf_counter()
        straight[way].append(Measured(f"straight: {way}", sent, *_straight(way, p, d, twin)))
    return Served(chosen, straight), priced


def _report(title: str, served: Served, priced: dict, streams: Streams | None) -> None:
    print(f"\n{title}: option {priced['session_option']}, the router's stages {priced['stages_ms']}")
    for o in priced["options"]:
        print("  ", o["why"])
        if o["predicted"] is not None:
            print("      terms:", _terms(o["predicted"]))
    for m in (served.chosen, *(m for way in WAYS for m in served.straight[way])):
        gap = f", worst gap on D's streams {m.worst_gap_s(streams) * 1e3:.1f} ms" if streams is not None else ""
        on_p = f" (P's prefill {m.prefill_s * 1e3:.1f} ms)" if m.prefill_s else ""
        print(f"  {m.route}: TTFT {m.ttft_s * 1e3:.1f} ms{on_p}{gap}")
    for way in WAYS:
        gap = f", worst gap {served.median_gap_s(way, streams) * 1e3:.1f} ms" if streams is not None else ""
        print(f"  median straight {way}: TTFT {served.median_ttft_s(way) * 1e3:.1f} ms{gap}")
    if streams is not None:
        print(f"  D's streams: TPOT {streams.tpot_s() * 1e3:.1f} ms")


IDLE_SEED, BUSY_SEED = 6100, 8100
"""Each test's session and twins (seed + 50 n): no prompt of one is another's."""
WITHIN = 2.0
"""A prediction holds where the TTFT measured is within this factor of it, either way."""
STALL_SEEN = 0.5
"""The share of the stall priced for a local prefill that D's streams must be seen to pause."""


LOCAL_VS_REMOTE = re.compile(
    r"(?:local|remote) cheaper: local (?P<local>[\d.]+) ms \+ its stall on 0 streams = (?P<priced>[\d.]+) ms "
    r"vs (?P<remote>[\d.]+) ms"
)
"""The router's two predictions in its local option's terms (``/debug/route``), D idle: D
prefilling the step, with the stall it costs D's running streams (none), and P prefilling
it for D."""


def test_a_large_step_on_an_idle_d_takes_the_cheaper_of_its_predictions(
    warmed: Fleet, tokenizer: PromptTokenizer
) -> None:
    prompts = _sessions_at_their_large_step(warmed.router.url, tokenizer, IDLE_SEED)
    _priced_with_streams(warmed.router.url, prompts[0], f"large-{IDLE_SEED}", 0)
    served, priced = _serve_every_way(warmed, IDLE_SEED, prompts)
    _report("idle D", served, priced, None)
    local = {o["option"]: o for o in priced["options"]}["local"]
    terms = LOCAL_VS_REMOTE.search(local["why"])
    assert terms is not None, local["why"]
    predicted_s = {"local_prefill": float(terms["local"]) / 1e3, "remote_prefill": float(terms["remote"]) / 1e3}
    cheaper = "local_prefill" if float(terms["priced"]) <= float(terms["remote"]) else "remote_prefill"
    assert served.chosen.route == f"router: {cheaper}", priced["explain"]
    available = [o for o in priced["options"] if o["available"]]
    cheapest = min(available, key=lambda o: (o["ttft_s"], TIE_ORDER.index(Option(o["option"]))))
    assert priced["session_option"] == cheapest["option"], priced["explain"]
    for way, seconds in predicted_s.items():
        ratio = served.median_ttft_s(way) / seconds
        assert 1 / WITHIN <= ratio <= WITHIN, f"{way}: measured / predicted {ratio:.2f}; {local['why']}"


def test_a_large_step_moves_off_a_d_running_long_streams(warmed: Fleet, tokenizer: PromptTokenizer) -> None:
    router, _, d = _urls(warmed)
    prompts = _sessions_at_their_large_step(router, tokenizer, BUSY_SEED)
    with ThreadPoolExecutor(LONG_STREAMS) as pool:
        streams = _long_streams(d, tokenizer, pool)
        _priced_with_streams(router, prompts[0], f"large-{BUSY_SEED}", LONG_STREAMS)
        served, priced = _serve_every_way(warmed, BUSY_SEED, prompts)
    _report(f"D running {LONG_STREAMS} streams", served, priced, streams)
    last = served.straight[WAYS[-1]][-1]
    assert streams.last_token_at() > last.sent_at + last.ttft_s, "D's streams ended before every way was measured"
    assert served.chosen.route == "router: remote_prefill" and priced["session_option"] != "local", priced["explain"]
    local_option = {o["option"]: o for o in priced["options"]}["local"]
    assert not local_option["available"] and "NO: stall" in local_option["why"], local_option
    # the stall the router priced is real: D prefilling the step paused its streams that long
    stall = re.search(r"stall on \d+ streams ([\d.]+) ms", local_option["why"])
    assert stall is not None, local_option["why"]
    priced_stall_s = float(stall.group(1)) / 1e3
    assert served.median_gap_s("local_prefill", streams) > STALL_SEEN * priced_stall_s, priced_stall_s
