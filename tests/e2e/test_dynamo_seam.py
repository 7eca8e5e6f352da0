"""The verified handoff through Dynamo 1.6.1's own NIXL protocol, on two vLLM 0.32 engines
started with the ``--kv-transfer-config`` Dynamo's vLLM workers are given
(``deploy/recipes/dynamo-kv-transfer-config.json``: ``NixlConnector`` from
``kvpilot.kvconnectors.dynamo_nixl``).

What runs: vLLM builds KVPilotConnector from that config in both engines; P's request
carries what Dynamo's prefill handler puts there (``make_kv_connector_protocol(...)
.prefill_request_kv_transfer_params()``, as ``PrefillWorkerHandler._prefill_kv_protocol``
does); D gets what the protocol derives from P's answer
(``decode_request_kv_transfer_params``), after a JSON round trip as on Dynamo's request
plane; D verifies P's blocks against its own prompt and answers like a co-located run.

What does not run here: ``python -m dynamo.vllm`` itself (its handler, request plane and
frontend). Dynamo 1.6.1 pins vLLM 0.31.0 and does not import beside vLLM 0.32
(``get_engine_zmq_addresses``), and it needs torchvision, whose PyPI build is CUDA-only
(docs/guides/dynamo.md, "Dynamo's vLLM workers").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from dynamo.vllm.kv_connector_protocols import NixlConnectorProtocol, make_kv_connector_protocol
from vllm.config import KVTransferConfig

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import complete
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from tests.e2e.scenarios import (
    BLOCK_SIZE,
    common_full_blocks,
    decode_verified,
    p_and_d_engines,
)

pytestmark = pytest.mark.e2e

RECIPE = Path(__file__).resolve().parents[2] / "deploy" / "recipes" / "dynamo-kv-transfer-config.json"
KV_TRANSFER = {**json.loads(RECIPE.read_text()), "kv_buffer_device": "cpu"}  # the recipe, on a CPU box


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[fleet_io.RunningProcess]]:
    """1 P + 1 D engine with the Dynamo recipe's kv_transfer_config instead of the fleet's; no
    router (Dynamo's protocol is the proxy)."""
    with p_and_d_engines(model_dir, tmp_path_factory.mktemp("dynamo-seam"), __name__, lambda _: KV_TRANSFER) as started:
        yield started


def _url(engine: fleet_io.RunningProcess) -> str:
    return f"http://127.0.0.1:{engine.port}"


def test_vllm_builds_kvpilots_connector_from_the_dynamo_recipe(engines: list[fleet_io.RunningProcess]) -> None:
    for engine in engines:
        log = Path(engine.log).read_text(errors="replace")
        assert "Creating v1 connector with name: KVPilotConnector" in log, engine.name


@pytest.mark.parametrize("edit", [False, True], ids=["same prompt", "history edited"])
def test_a_handoff_through_dynamos_nixl_protocol_is_verified(
    engines: list[fleet_io.RunningProcess], tokenizer: PromptTokenizer, edit: bool
) -> None:
    prefill, decode = (_url(e) for e in engines)
    protocol = make_kv_connector_protocol(SimpleNamespace(kv_transfer_config=KVTransferConfig(**KV_TRANSFER)))
    assert type(protocol) is NixlConnectorProtocol

    history, tail = filler_text(300, 21), filler_text(90, 22)
    x = tokenizer.text_token_ids(history + tail)
    x_prime = tokenizer.text_token_ids(history + " edited " + tail) if edit else x
    salt = f"dynamo-seam-{uuid.uuid4().hex[:8]}"
    p_out = complete(
        prefill, x, max_tokens=1, kv_transfer_params=protocol.prefill_request_kv_transfer_params(), cache_salt=salt
    )
    assert p_out.kv_transfer_params is not None and "kvpilot" in p_out.kv_transfer_params
    to_d = json.loads(json.dumps(protocol.decode_request_kv_transfer_params(p_out)))
    assert to_d == p_out.kv_transfer_params  # Dynamo's NIXL protocol passes P's params on unchanged

    assert (common_full_blocks(x, x_prime) < len(x) // BLOCK_SIZE) == edit
    decode_verified(decode, x, x_prime, to_d, salt)
