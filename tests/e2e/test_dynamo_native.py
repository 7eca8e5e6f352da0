"""The compiled picker beside Dynamo, on Dynamo 1.6.1's real frontend (direct mode) and three
aggregated ``dynamo.mocker`` workers on the tiny model, behind the real Envoy
(``DynamoFleetSpec.native_picker``, as the fleet benchmark's ``kvpilot_native`` arm runs it).

What each test shows comes from the workers and Envoy, not from the module's word: the
serving worker's own ``cached_tokens`` say whether a prompt reached the worker that holds it,
Envoy's counters which path decided. All on 127.0.0.1, ports 19500-19999 (no other e2e module
uses them).
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpilot.deploy import dynamo_fleet
from kvpilot.deploy.dynamo_spec import DynamoFleetSpec
from kvpilot.deploy.fleet import Fleet, down

pytest.importorskip("dynamo.mocker", reason="needs ai-dynamo (scripts/bootstrap.sh installs it)")
pytestmark = pytest.mark.e2e

BS = 32
VOCAB = 2048  # the tiny model's: the frontend refuses larger token ids
PORTS = {
    "worker_port": 19500,
    "port_stride": 100,
    "frontend_port": 19990,
    "router_port": 19980,
    "gateway_port": 19970,
    "picker_port": 19971,
    "envoy_admin_port": 19972,
}


@pytest.fixture(scope="module")
def spec(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> DynamoFleetSpec:
    run_dir = tmp_path_factory.mktemp("dynamo-native")
    return DynamoFleetSpec(model_dir, run_dir, workers=3, native_picker=True, **PORTS)


@pytest.fixture(scope="module")
def fleet(spec: DynamoFleetSpec) -> Iterator[Fleet]:
    started = dynamo_fleet.up(spec, timeout=120)
    try:
        yield started
    finally:
        down(spec.run_dir)


def _complete(spec: DynamoFleetSpec, prompt: Any, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {"model": spec.served_model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(
        f"{spec.client_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return dict(json.loads(answer.read()))


def _cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _counters(spec: DynamoFleetSpec) -> dict[str, int]:
    url = f"http://127.0.0.1:{spec.envoy_admin_port}/stats?filter=kvpilot_picker_(decided|passthrough)$"
    with urllib.request.urlopen(url, timeout=5) as answer:
        lines = answer.read().decode().splitlines()
    return {line.split(": ")[0].rsplit(".", 1)[-1]: int(line.split(": ")[1]) for line in lines if ": " in line}


def test_a_token_id_prompt_is_decided_in_envoy_and_reaches_the_worker_holding_it(
    fleet: Fleet, spec: DynamoFleetSpec
) -> None:
    """Five prompts, each sent twice: the second of each must find its whole prompt cached
    on the worker it reaches (a pick blind to the index would hit it one time in three)."""
    rng = random.Random(7)
    before = _counters(spec)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(8 * BS)] for _ in range(5)]
    for prompt in prompts:
        assert _cached(_complete(spec, prompt)) == 0
    for prompt in prompts:
        deadline_tries = 20  # the workers' events reach the module within moments of the answer
        for _ in range(deadline_tries):
            again = _complete(spec, prompt)
            if _cached(again) >= 7 * BS:
                break
        assert _cached(again) >= 7 * BS, again["usage"]
    after = _counters(spec)
    assert after["kvpilot_picker_decided"] - before.get("kvpilot_picker_decided", 0) >= 10


def test_a_session_s_steps_stay_on_one_worker(fleet: Fleet, spec: DynamoFleetSpec) -> None:
    """A session's growing prompt: each step after the first finds the previous step's
    prompt cached, whatever else the fleet holds."""
    rng = random.Random(11)
    prompt = [rng.randrange(1, VOCAB) for _ in range(4 * BS)]
    _complete(spec, prompt, {"x-session-id": "agent-1"})
    for _ in range(4):
        cached_before = len(prompt) // BS * BS
        prompt += [rng.randrange(1, VOCAB) for _ in range(2 * BS)]
        step = _complete(spec, prompt, {"x-session-id": "agent-1"})
        assert _cached(step) >= cached_before - BS, step["usage"]


def test_a_text_prompt_passes_to_the_python_picker(fleet: Fleet, spec: DynamoFleetSpec) -> None:
    before = _counters(spec)
    answer = _complete(spec, "The compiled picker reads token ids only.")
    assert answer["choices"][0]["text"] is not None
    after = _counters(spec)
    assert after["kvpilot_picker_passthrough"] == before.get("kvpilot_picker_passthrough", 0) + 1
