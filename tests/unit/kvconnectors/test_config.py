from __future__ import annotations

import pytest

from kvpilot.kvconnectors.config import KVPilotConfig, KVPilotConfigError
from kvpilot.kvconnectors.pull_policy import RecomputePolicy
from kvpilot.policies.typed_config import convert


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
        config.inner_extra_config["a"] = 2  # type: ignore[index]  # writing the read-only mapping on purpose


def test_nixl_keys_at_the_top_level_are_a_drop_in() -> None:
    raw = {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60, "num_threads": 2}
    config = KVPilotConfig.parse(raw)
    assert dict(config.inner_extra_config) == raw
    assert config.inner_extra_config["bidirectional_kv_xfer"] is True
    assert config.recompute_policy is RecomputePolicy.ROOFLINE
    # kvpilot decides session pulls: the inner connector's fixed threshold is off.
    assert config.inner_config_for_vllm() == {**raw, "kv_recompute_threshold": 0}


def test_a_fixed_threshold_pins_vllms_rule() -> None:
    for raw in ({"kv_recompute_threshold": 16}, {"inner_extra_config": {"kv_recompute_threshold": 16}}):
        config = KVPilotConfig.parse(raw)
        assert config.recompute_policy is RecomputePolicy.THRESHOLD
        assert config.inner_config_for_vllm() == {"kv_recompute_threshold": 16}
    config = KVPilotConfig.parse({"kv_recompute_threshold": 16, "recompute_policy": "roofline"})
    assert config.inner_config_for_vllm() == {"kv_recompute_threshold": 0}


def test_policy_presets_are_checked_when_parsed() -> None:
    config = KVPilotConfig.parse({"policy_hardware": "h100x2", "policy_model": "llama-8b", "policy_link": "rdma"})
    assert (config.policy_hardware, config.policy_model, config.policy_link) == ("h100x2", "llama-8b", "rdma")


def test_another_inner_connector_takes_its_keys_explicitly() -> None:
    with pytest.raises(KVPilotConfigError) as err:
        KVPilotConfig.parse({"inner_connector": "OffloadingConnector", "bidirectional_kv_xfer": True})
    assert err.value.key == "bidirectional_kv_xfer"
    config = KVPilotConfig.parse({"inner_connector": "OffloadingConnector", "inner_extra_config": {"x": 1}})
    assert config.inner_config_for_vllm() == {"x": 1}


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"kv_recompute_threshold": 1, "inner_extra_config": {"kv_recompute_threshold": 2}}, "kv_recompute_threshold"),
        ({"recompute_policy": "always"}, "recompute_policy"),
        ({"policy_hardware": "tpu9"}, "policy_hardware"),
        ({"policy_model": ""}, "policy_model"),
        ({"policy_link": "carrier-pigeon"}, "policy_link"),
        ({"inner_connector": 3}, "inner_connector"),
        ({"inner_connector": ""}, "inner_connector"),
        ({"inner_connector": "KVPilotConnector"}, "inner_connector"),
        ({"inner_connector": "MultiConnector"}, "inner_connector"),
        ({"inner_extra_config": [1]}, "inner_extra_config"),
        ({"peer_retry_after_s": 0}, "peer_retry_after_s"),
        ({"peer_retry_after_s": "30"}, "peer_retry_after_s"),
        ({"peer_retry_after_s": True}, "peer_retry_after_s"),
        ({"peer_retry_after_s": float("inf")}, "peer_retry_after_s"),
        ([1, 2], "<root>"),
    ],
)
def test_bad_config_names_the_key(raw: object, key: str) -> None:
    with pytest.raises(KVPilotConfigError) as err:
        KVPilotConfig.parse(raw)
    assert err.value.key == key
    assert f"kv_connector_extra_config.{key}" in str(err.value)


@pytest.mark.parametrize(
    ("raw", "key", "problem"),
    [
        ({"bogus": 1}, "bogus", "unknown key (known: inner_connector, inner_extra_config, recompute_policy,"),
        ({"peer_retry_after_s": "30"}, "peer_retry_after_s", "Expected `float`, got `str`"),
        ({"policy_link": 3}, "policy_link", "Expected `str | null`, got `int`"),
        ({"recompute_policy": "always"}, "recompute_policy", "must be one of 'roofline', 'threshold', got 'always'"),
        ({"peer_retry_after_s": 0}, "peer_retry_after_s", "must be a finite number > 0, got 0"),
    ],
)
def test_convert_names_the_key_of_the_extra_config(raw: dict[str, object], key: str, problem: str) -> None:
    """kvpilot.policies.typed_config.convert on the connector's own keys (a flat struct: its keys
    are the dotted keys), each error a KVPilotConfigError; ``parse`` adds the inner keys."""
    with pytest.raises(KVPilotConfigError) as err:
        convert(raw, KVPilotConfig)
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(err.value) == f"KVPilotConnector: kv_connector_extra_config.{key}: {err.value.problem}"


def test_parse_lists_the_inner_connectors_keys_beside_its_own() -> None:
    with pytest.raises(
        KVPilotConfigError,
        match=r"bogus: unknown key \(known keys: allow_fault_injection, backends, .*recompute_policy",
    ):
        KVPilotConfig.parse({"bogus": 1})


def test_unknown_inner_connector_is_refused_against_vllms_registry() -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvpilot.kvconnectors.connector import parse_config

    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"inner_connector": "NoSuch"})
    )
    with pytest.raises(KVPilotConfigError, match=r"inner_connector.*not a connector registered"):
        parse_config(vllm_config)  # type: ignore[arg-type]  # a SimpleNamespace standing in for VllmConfig


def test_peer_retry_window_defaults_to_30_s_and_is_configurable() -> None:
    assert KVPilotConfig.parse(None).peer_retry_after_s == 30.0
    assert KVPilotConfig.parse({"peer_retry_after_s": 120}).peer_retry_after_s == 120.0
    assert "peer_retry_after_s" not in KVPilotConfig.parse({"peer_retry_after_s": 120}).inner_config_for_vllm()
