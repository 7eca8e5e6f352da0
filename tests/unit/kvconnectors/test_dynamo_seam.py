"""The seam for Dynamo's vLLM workers, checked with Dynamo 1.6.1's and vLLM 0.32's own code.

``dynamo.vllm`` picks the P->D handoff protocol by the engine's ``kv_connector`` name
(``dynamo/vllm/kv_connector_protocols.py``, ``make_kv_connector_protocol``) and refuses
``KVPilotConnector``. The recipe names ``NixlConnector`` loaded from
``kvpilot.kvconnectors.dynamo_nixl`` (``deploy/recipes/dynamo-kv-transfer-config.json``, the
same in ``deploy/k8s/dynamo.py``): Dynamo resolves that to its NIXL protocol, vLLM to
KVPilotConnector. No ``dynamo.vllm`` worker runs here (docs/guides/dynamo.md says why);
``tests/e2e/test_dynamo_seam.py`` runs the handoff through Dynamo's protocol object on two
vLLM engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from dynamo.vllm.kv_connector_protocols import NixlConnectorProtocol, make_kv_connector_protocol
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvpilot.deploy.k8s.dynamo import (
    DYNAMO_CONNECTOR_MODULE,
    DYNAMO_CONNECTOR_NAME,
    dynamo_kv_transfer_config,
    worker_args,
)
from kvpilot.deploy.k8s.plan import plan_cluster
from kvpilot.deploy.k8s.render import DEFAULT
from kvpilot.kvconnectors import dynamo_nixl
from kvpilot.kvconnectors.connector import KVPilotConnector
from kvpilot.kvconnectors.transfer_params import PARAMS_KEY, decode_offer, encode_offer
from tests.unit.kvconnectors.offer_contract import CONTRACT

RECIPE = Path(__file__).resolve().parents[3] / "deploy" / "recipes" / "dynamo-kv-transfer-config.json"


def _recipe() -> dict[str, object]:
    return json.loads(RECIPE.read_text())


def _vllm_config(kv: dict[str, object]) -> SimpleNamespace:
    """What ``make_kv_connector_protocol`` reads of the engine's ``VllmConfig``: its
    ``kv_transfer_config``, here vLLM's own type built from the JSON the worker is given."""
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(**kv))


def test_dynamo_refuses_kvpilots_own_name() -> None:
    kv = {**_recipe(), "kv_connector": "KVPilotConnector"}
    kv.pop("kv_connector_module_path")
    with pytest.raises(ValueError, match="Unsupported kv_connector='KVPilotConnector' for PD"):
        make_kv_connector_protocol(_vllm_config(kv))


def test_the_recipe_resolves_to_dynamos_nixl_protocol_and_vllm_loads_kvpilot() -> None:
    kv = _recipe()
    assert kv["kv_connector"] == DYNAMO_CONNECTOR_NAME
    assert kv["kv_connector_module_path"] == DYNAMO_CONNECTOR_MODULE == dynamo_nixl.MODULE_PATH
    config = _vllm_config(kv)
    assert type(make_kv_connector_protocol(config)) is NixlConnectorProtocol
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is KVPilotConnector
    # vLLM applies its NIXL-specific config checks, as the data plane is NixlConnector's
    assert config.kv_transfer_config.has_connector("NixlConnector")


def test_dynamo_treats_the_recipe_as_nixl_when_it_sets_up_the_worker() -> None:
    from dynamo.vllm.args import _uses_nixl_connector  # sets VLLM_NIXL_SIDE_CHANNEL_HOST when true

    assert _uses_nixl_connector(_vllm_config(_recipe()))


def test_dynamos_nixl_protocol_carries_kvpilots_offer_to_d_unchanged() -> None:
    protocol = make_kv_connector_protocol(_vllm_config(_recipe()))
    asked = protocol.prefill_request_kv_transfer_params()
    assert asked["do_remote_decode"] is True and asked["do_remote_prefill"] is False
    offer = encode_offer(CONTRACT, [bytes(range(i, i + 32)) for i in range(3)], [5, 6])
    p_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "p-engine",
        "remote_request_id": "r-1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        PARAMS_KEY: offer,
    }
    # Dynamo's request plane carries the prefill result as JSON
    to_d = json.loads(
        json.dumps(protocol.decode_request_kv_transfer_params(SimpleNamespace(kv_transfer_params=p_params)))
    )
    assert to_d == p_params
    assert decode_offer(to_d[PARAMS_KEY]).num_blocks == 3


def test_the_kubernetes_workers_get_the_recipes_connector() -> None:
    plan = plan_cluster(DEFAULT)
    args = worker_args(plan, "prefill")
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    recipe = _recipe()
    assert {k: kv[k] for k in recipe} == recipe
    assert type(make_kv_connector_protocol(_vllm_config(kv))) is NixlConnectorProtocol
    engine = json.loads(
        dynamo_kv_transfer_config(json.dumps({"kv_connector": "KVPilotConnector", "kv_role": "kv_both"}))
    )
    assert engine == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": DYNAMO_CONNECTOR_MODULE,
    }
