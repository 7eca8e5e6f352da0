"""A prefill engine serving another model (same shapes, other weights) is refused by
the contract check: D prefills locally and still answers correctly."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta
from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import TINY_MODEL_SPEC, ensure_tiny_model
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.fleets import running_fleet
from tests.e2e.scenarios import BLOCK_SIZE, PROMPT_TOKENS, RECOMPUTED, REJECTED, colocated_reference, run_case
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e


def _single_engine(model_dir: Path, run_dir: Path, offset: int) -> FleetSpec:
    return FleetSpec(
        model_dir=model_dir,
        run_dir=run_dir,
        prefill=0,
        decode=0,
        colocated=1,
        first_core=offset,
        **block_of(__name__).fleet(slot=offset),
    )


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Fleet]]:
    """(P serving another model, D serving the tiny model), both with KVPilotConnector."""
    other = ensure_tiny_model(spec=replace(TINY_MODEL_SPEC, seed=TINY_MODEL_SPEC.seed + 1))
    with (
        running_fleet(_single_engine(other, tmp_path_factory.mktemp("other-p"), 0)) as p,
        running_fleet(_single_engine(model_dir, tmp_path_factory.mktemp("tiny-d"), 1)) as d,
    ):
        yield p, d


def test_prefill_from_another_model_is_refused(engines: tuple[Fleet, Fleet], tokenizer: PromptTokenizer) -> None:
    p_engine, d_engine = engines[0].engines[0], engines[1].engines[0]
    x = tokenizer.text_token_ids(filler_text(500, 7))
    salt = f"model-{uuid.uuid4().hex}"
    out, before, after = run_case(p_engine.url, d_engine.url, x, x, salt, salt)
    reference = colocated_reference(d_engine.url, x, x, verified_blocks=0)
    assert out.same_output(reference), f"max logprob diff {out.max_logprob_diff(reference)}"
    assert delta(after, before, PROMPT_TOKENS, source="external_kv_transfer") == 0
    assert delta(after, before, REJECTED, reason="contract_mismatch") == len(x) // BLOCK_SIZE
    assert delta(after, before, RECOMPUTED, reason="contract_mismatch") == len(x)
    assert "contract mismatch (model peer=" in Path(d_engine.log).read_text()  # logged with both sides' values
