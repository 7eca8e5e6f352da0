"""Disaggregated P->D through KVPilotConnector over real NIXL, on real vLLM engines."""

from __future__ import annotations

import json
import uuid

import psutil
import pytest

from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled, total, wait_for_metric
from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.parity import LOGPROB_TOLERANCE
from tests.e2e.scenarios import BLOCK_SIZE, KV_BYTES_PER_TOKEN, NIXL_BYTES, PROMPT_TOKENS

pytestmark = pytest.mark.e2e


def _words(n: int, seed: int) -> str:
    vocab = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "cache",
        "block",
        "token",
        "prefix",
        "decode",
        "prefill",
        "router",
        "session",
    ]
    return " ".join(vocab[(seed * 7 + i * 13 + i // 5) % len(vocab)] for i in range(n))


def test_disaggregated_output_equals_colocated(pd_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    prefill, decode = pd_fleet.by_role("prefill")[0], pd_fleet.by_role("decode")[0]
    token_ids = tokenizer.text_token_ids(_words(400, seed=1))
    d0 = scrape(decode.url)
    disagg = complete(pd_fleet.router.url, token_ids, max_tokens=12)
    d1 = settled(decode.url, d0)
    reference = complete(decode.url, token_ids, max_tokens=12, cache_salt=f"ref-{uuid.uuid4().hex}")

    assert disagg.tokens == reference.tokens
    assert disagg.logprobs == reference.logprobs, f"max diff {disagg.max_logprob_diff(reference)}"
    assert delta(d1, d0, NIXL_BYTES) > 0
    assert delta(d1, d0, PROMPT_TOKENS, source="external_kv_transfer") == len(token_ids)
    assert delta(d1, d0, PROMPT_TOKENS, source="local_compute") == 0
    # P computed the prompt and stamped kvpilot's offer into its kv_transfer_params.
    assert total(scrape(prefill.url), vm.KVPILOT_OFFERS.total) >= 1


def test_through_envoy_p_then_d_and_the_output_equals_colocated(pd_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """As a client of `kvpilot fleet up` sends it: to Envoy, which asks the router's picker.
    The picker runs P's one-token prefill and names D with P's params; Envoy streams D's
    answer. D received the prompt's KV over NIXL (its own counters), and the output equals
    the co-located run's, logprobs identical."""
    assert pd_fleet.gateway is not None
    decode = pd_fleet.by_role("decode")[0]
    token_ids = tokenizer.text_token_ids(_words(400, seed=21))
    d0, r0 = scrape(decode.url), scrape(pd_fleet.router.url)
    disagg = complete(pd_fleet.client_url, token_ids, max_tokens=12, stream=True)
    d1 = settled(decode.url, d0)
    reference = complete(decode.url, token_ids, max_tokens=12, cache_salt=f"ref-{uuid.uuid4().hex}")
    assert disagg.headers["x-kvpilot-route"] == "remote_prefill", dict(disagg.headers)
    assert disagg.headers["server"] == "envoy"
    assert disagg.tokens == reference.tokens
    assert disagg.logprobs == reference.logprobs, f"max diff {disagg.max_logprob_diff(reference)}"
    assert delta(d1, d0, PROMPT_TOKENS, source="external_kv_transfer") == len(token_ids)
    assert delta(d1, d0, PROMPT_TOKENS, source="local_compute") == 0
    first_tokens = total(r0, "kvpilot_router_ttft_seconds_count")
    r1 = wait_for_metric(pd_fleet.router.url, "kvpilot_router_ttft_seconds_count", lambda n: n > first_tokens)
    assert delta(r1, r0, "kvpilot_router_decisions_total") == 1  # the picker decided it ...
    assert delta(r1, r0, "kvpilot_router_ttft_seconds_count") == 1  # ... and timed its first token from Envoy's log


def test_a_chat_request_through_envoy_is_answered_in_chat_format(pd_fleet: Fleet) -> None:
    """What most clients send: ``/v1/chat/completions`` to the fleet's client URL, the tiny
    model's own chat template rendered by the router (a fresh fleet answered 400, "this model
    has no chat template", while the router missed transformers' ``chat_template.jinja``)."""
    import urllib.request

    body = {"model": "tiny", "messages": [{"role": "user", "content": "fix the bug"}], "max_tokens": 4}
    request = urllib.request.Request(
        f"{pd_fleet.client_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer = json.loads(resp.read())
        assert resp.headers["server"] == "envoy"
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == 4


def test_decode_moves_only_blocks_beyond_its_local_hit(pd_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    decode = pd_fleet.by_role("decode")[0]
    first = tokenizer.text_token_ids(_words(640, seed=2))
    complete(pd_fleet.router.url, first, max_tokens=2)
    cached_blocks = len(first) // BLOCK_SIZE

    extended = first + tokenizer.text_token_ids(" " + _words(200, seed=3))
    d0 = scrape(decode.url)
    out = complete(pd_fleet.router.url, extended, max_tokens=8)
    d1 = settled(decode.url, d0)

    new_tokens = len(extended) - cached_blocks * BLOCK_SIZE
    moved = delta(d1, d0, NIXL_BYTES)
    assert delta(d1, d0, PROMPT_TOKENS, source="local_cache_hit") == cached_blocks * BLOCK_SIZE
    assert delta(d1, d0, PROMPT_TOKENS, source="external_kv_transfer") == new_tokens
    new_blocks = -(-new_tokens // BLOCK_SIZE)
    assert moved == new_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN, (moved, new_blocks)
    assert moved < len(extended) * KV_BYTES_PER_TOKEN / 2

    # The co-located reference replays the same two requests on one engine under a
    # fresh salt, so it splits the prefill at the same block (prefix hit, then the new
    # tokens). A single unsplit prefill of `extended` differs in bf16 by ~1.5e-2 in
    # the first logprob whether or not KV moved; the split is what must match.
    salt = f"ref-{uuid.uuid4().hex}"
    complete(decode.url, first, max_tokens=2, cache_salt=salt)
    reference = complete(decode.url, extended, max_tokens=8, cache_salt=salt)
    assert out.same_output(reference), f"max diff {out.max_logprob_diff(reference)}"


def _cores(cpu_list: str) -> set[int]:
    """``"0"``, ``"0-3"``, ``"0,2"`` as a set of core ids."""
    cores: set[int] = set()
    for part in cpu_list.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def test_each_engine_computes_on_the_cores_it_was_bound_to(pd_fleet: Fleet) -> None:
    """vLLM's NIXL worker on CPU pins the thread that builds it, the engine's model
    thread, to the box's last core; KVPilotConnector gives that thread its binding back."""
    for engine in pd_fleet.engines:
        api_server = psutil.Process(engine.pid)
        bound = _cores(api_server.environ()["VLLM_CPU_OMP_THREADS_BIND"])
        workers = [p for p in api_server.children(recursive=True) if p.name() == "VLLM::Worker"]
        assert workers, f"{engine.name}: no VLLM::Worker process"
        for worker in workers:
            assert set(worker.cpu_affinity()) == bound, f"{engine.name}: model thread on {worker.cpu_affinity()}"


BENCH_SERVE = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({"completed": result["completed"], "failed": result["failed"]}))
"""


def test_vllm_bench_serve_drives_the_router(pd_fleet: Fleet, model_dir, tmp_path) -> None:
    """The client vLLM ships (``vllm bench serve``, streaming completions with
    ``stream_options``) through the router's P->D path: every request completes."""
    import subprocess
    import sys

    from kvpilot.deploy.env import child_env

    router = pd_fleet.router.url
    before = scrape(router)
    args = [
        "--backend",
        "openai",
        "--base-url",
        router,
        "--model",
        "tiny",
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        "200",
        "--random-output-len",
        "4",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "2",
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "0",
        "--seed",
        "3",
    ]
    done = subprocess.run(
        [sys.executable, "-c", BENCH_SERVE, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=child_env(),
        cwd=tmp_path,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads(lines[-1][7:]) == {"completed": 6, "failed": 0}
    # each prompt went P->D (and vllm bench serve's own single-prompt test run, when it sends one)
    assert delta(scrape(router), before, "kvpilot_router_decisions_total", kind="remote_prefill") >= 6


def test_an_impossible_ttft_slo_is_refused_and_the_fleet_serves_the_next_request(
    pd_spec: FleetSpec, pd_fleet: Fleet, tokenizer: PromptTokenizer
) -> None:
    """With an SLO no prediction meets, the router refuses at once (503, Retry-After, a
    message naming the predicted TTFT and the SLO) and sends the engines nothing; with the
    fleet's own SLO back, the next request is served P -> D."""
    from kvpilot.deploy.client import HTTPStatusError
    from kvpilot.deploy.fleet import restart_router

    token_ids = tokenizer.text_token_ids(_words(200, seed=12))
    strict = restart_router(pd_spec, ["--server-ttft-slo-s", "1e-9"])
    finished = {e.url: total(scrape(e.url), vm.REQUEST_SUCCESS.total) for e in pd_fleet.engines}
    with pytest.raises(HTTPStatusError) as refused:
        complete(strict.router.url, token_ids, max_tokens=4)
    assert refused.value.status == 503, refused.value
    message = json.loads(refused.value.body)["error"]["message"]
    assert "predicted TTFT" in message and "server.ttft_slo_s (1e-09 s)" in message, message
    assert int(refused.value.headers["Retry-After"]) >= 1
    assert total(scrape(strict.router.url), "kvpilot_router_rejected_total", reason="ttft_slo") == 1
    for url, count in finished.items():  # no engine saw it (vLLM counts a finished request late: wait a little)
        later = wait_for_metric(url, vm.REQUEST_SUCCESS.total, lambda n, count=count: n > count, timeout=3.0)
        assert total(later, vm.REQUEST_SUCCESS.total) == count, url
    served = restart_router(pd_spec)
    out = complete(served.router.url, token_ids, max_tokens=4)
    assert out.headers.get("X-KVPilot-Route") == "remote_prefill" and out.tokens


def test_prefill_failure_falls_back_to_local_prefill_on_decode(pd_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """Last in this module, and in the group that shares its fleet (``tests/e2e/conftest.py``):
    it stops the prefill engine. The fallback prefills on D with D's prefix cache: this
    prompt's 569 tokens begin ``test_through_envoy_...``'s (``_words`` gives the same words
    for seeds 12 apart: 9 and 21), whose KV D pulled from P (P prefilled all 759 in one
    pass), so after that test D computes only the 25 tokens beyond its 17 cached blocks,
    where the reference (a fresh salt) prefills all 569 in one pass. Other pieces, other
    bf16 rounding on some CPUs (bit-identical on AVX-512, not on a 2-core AVX2 EPYC): the
    tokens must be equal, the logprobs within bf16 noise
    (:data:`~tests.e2e.parity.LOGPROB_TOLERANCE`)."""
    from kvpilot.deploy.fleet import stop_group

    decode = pd_fleet.by_role("decode")[0]
    stop_group(pd_fleet.by_role("prefill")[0].pid)
    token_ids = tokenizer.text_token_ids(_words(300, seed=9))
    before = scrape(pd_fleet.router.url)
    out = complete(pd_fleet.router.url, token_ids, max_tokens=8)
    assert out.headers.get("X-KVPilot-Route") == "fallback"
    assert delta(scrape(pd_fleet.router.url), before, "kvpilot_router_prefill_fallbacks_total") == 1
    reference = complete(decode.url, token_ids, max_tokens=8, cache_salt=f"ref-{uuid.uuid4().hex}")
    assert out.tokens == reference.tokens and len(out.tokens) == 8
    diff = out.max_logprob_diff(reference)
    assert diff <= LOGPROB_TOLERANCE, f"logprobs differ by {diff:.2e}: {out.logprobs} against {reference.logprobs}"
