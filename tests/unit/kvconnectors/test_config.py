from __future__ import annotations

import pytest

from kvconnectors.config import KVPilotConfig, KVPilotConfigError


def test_defaults_wrap_nixl() -> None:
    config = KVPilotConfig.parse(None)
    assert config.inner_connector == "NixlConnector"
    assert dict(config.inner_extra_config) == {}
    assert KVPilotConfig.parse({}) == config


def test_inner_extra_config_is_passed_through_read_only() -> None:
    config = KVPilotConfig.parse({"inner_connector": "NixlPushConnector", "inner_extra_config": {"a": 1}})
    assert config.inner_connector == "NixlPushConnector"
    assert config.inner_extra_config["a"] == 1
    with pytest.raises(TypeError):
        config.inner_extra_config["a"] = 2  # type: ignore[index]


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"inner_connector": 3}, "inner_connector"),
        ({"inner_connector": ""}, "inner_connector"),
        ({"inner_connector": "KVPilotConnector"}, "inner_connector"),
        ({"inner_connector": "MultiConnector"}, "inner_connector"),
        ({"inner_extra_config": [1]}, "inner_extra_config"),
        ([1, 2], "<root>"),
    ],
)
def test_bad_config_names_the_key(raw: object, key: str) -> None:
    with pytest.raises(KVPilotConfigError) as err:
        KVPilotConfig.parse(raw)
    assert err.value.key == key
    assert f"kv_connector_extra_config.{key}" in str(err.value)


def test_unknown_inner_connector_is_refused_against_vllms_registry() -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvconnectors.connector import parse_config

    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"inner_connector": "NoSuch"}))
    with pytest.raises(KVPilotConfigError, match="inner_connector.*not a connector registered"):
        parse_config(vllm_config)  # type: ignore[arg-type]
