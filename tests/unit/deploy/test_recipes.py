"""The recipes the guides show are files, loaded here as a user's run would load them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.kvconnectors.config import KVPilotConfig
from kvpilot.routing.config import prior_model
from kvpilot.routing.config_load import load_config
from kvpilot.routing.decide.rates import RolePriors
from kvpilot.routing.fleet import fleet_from_config

RECIPES = Path(__file__).resolve().parents[3] / "deploy" / "recipes"


@pytest.mark.parametrize("name", ["router-vllm.yaml", "router-beside-dynamo.yaml"])
def test_a_router_recipe_loads_and_names_a_real_model(name: str) -> None:
    config = load_config(RECIPES / name)
    assert config.server.model_dir  # `kvpilot router` refuses to start without one
    assert config.server.model_name != "tiny" and "/" in config.server.model_name  # a hub model's name
    RolePriors.from_config(config.disaggregation, prior_model(config))  # its presets exist
    if name == "router-beside-dynamo.yaml":
        assert config.dynamo.enabled and config.gateway.picker_port
    else:
        fleet = fleet_from_config(config)
        assert [w.name for w in fleet.prefill] == ["prefill-0"] and [w.name for w in fleet.decode] == ["decode-0"]


def test_the_kv_transfer_recipe_is_a_valid_kvpilot_connector_config() -> None:
    kv = json.loads((RECIPES / "kv-transfer-config.json").read_text())
    assert kv["kv_connector"] == "KVPilotConnector" and kv["kv_role"] == "kv_both"
    assert KVPilotConfig.parse(kv["kv_connector_extra_config"]).inner_extra_config == {"bidirectional_kv_xfer": True}
