"""The parity table of tests/e2e/parity.py on the project's other tiny model (the older shape:
no BOS added to text, a chat template without tools) and on the router's own HTTP front,
which relays the engine's answer (no Envoy): one co-located engine behind the router.

For each case the router's token ids are the engine's own ``POST /tokenize``'s, and the
answer through the router equals the engine's answer to the same request sent directly;
then the OpenAI SDK agent loop of tests/e2e/test_parity.py, here relayed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.tiny_model import PLAIN_MODEL_SPEC, TOOL_CALLING_ENGINE_ARGS, ensure_tiny_model
from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from kvpilot.routing.serve.upstream import Api
from tests.e2e.fleets import running_fleet
from tests.e2e.parity import CASES, Case, agent_loop, answers_are_the_engine_s, router_ids_are_the_engine_s
from tests.fakes.ports import block_of


@pytest.fixture(scope="module")
def plain_model() -> Path:
    return ensure_tiny_model(spec=PLAIN_MODEL_SPEC)


@pytest.fixture(scope="module")
def fleet(plain_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(
        model_dir=plain_model,
        run_dir=tmp_path_factory.mktemp("parity-relay"),
        prefill=0,
        decode=0,
        colocated=1,
        engine_args=TOOL_CALLING_ENGINE_ARGS,  # no reasoning parser: this template has no thinking
        **block_of(__name__).fleet(),
    )
    with running_fleet(spec) as started:
        yield started


@pytest.fixture(scope="module")
def prompts(plain_model: Path) -> EnginePrompt:
    return EnginePrompt(PromptTokenizer(plain_model), ChatTemplate.from_model_dir(plain_model))


def _engine(fleet: Fleet) -> str:
    return fleet.by_role("colocated")[0].url


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_router_s_token_ids_are_the_engine_s(fleet: Fleet, prompts: EnginePrompt, case: Case) -> None:
    ids = router_ids_are_the_engine_s(_engine(fleet), prompts, case)
    if case.api is Api.COMPLETIONS and isinstance(case.body["prompt"], str):
        assert ids[0] != 0  # this tokenizer adds no BOS


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_an_answer_relayed_by_the_router_equals_the_engine_s_own(
    fleet: Fleet, plain_model: Path, prompts: EnginePrompt, case: Case
) -> None:
    headers, _ = answers_are_the_engine_s(fleet.client_url, _engine(fleet), plain_model, prompts, case)
    assert headers["x-kvpilot-route"] == "colocated"


def test_an_agent_loop_with_the_openai_sdk_equals_the_engine_step_by_step(fleet: Fleet, plain_model: Path) -> None:
    """Three steps of an agent relayed by the router (:func:`tests.e2e.parity.agent_loop`) on the
    model whose template renders no tools, each equal to the engine's own answer."""
    agent_loop(fleet.client_url, _engine(fleet), plain_model)
