"""The forwards ``KVPilotConnector`` gained for vLLM 0.33 (sleep mode: ``supports_sleep_mode``,
``unregister_kv_caches``, ``restore_kv_caches``) and 0.34 (``kv_cache_access``), on vLLM 0.32,
whose base class has none of them: the facade is called as the newer vLLM calls it (the class
methods with the engine's ``KVTransferConfig``, the others on the worker's connector), and the
shared fake inner connector (:mod:`tests.fakes.inner_connector`) shows what reached it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvpilot.kvconnectors.connector import KVPilotConnector
from kvpilot.kvconnectors.plugin import register
from tests.fakes.inner_connector import INNER_NAME, FakeInnerConnector
from tests.fakes.inner_connector import register as register_fake_inner

BS = 16


def transfer_config(inner_extra: dict[str, Any]) -> KVTransferConfig:
    """An engine's config naming KVPilotConnector around the fake, with the fake's own keys."""
    register()
    register_fake_inner()
    return KVTransferConfig(
        kv_connector="KVPilotConnector",
        kv_role="kv_both",
        engine_id="engine-a",
        kv_connector_extra_config={"inner_connector": INNER_NAME, "inner_extra_config": inner_extra},
    )


@pytest.mark.parametrize("sleeps", [True, False])
def test_sleep_mode_support_is_the_inner_connector_s_answer(sleeps: bool) -> None:
    assert KVPilotConnector.supports_sleep_mode(transfer_config({"sleeps": sleeps})) is sleeps


def test_kv_cache_access_is_asked_of_the_inner_connector_with_its_own_config() -> None:
    asked = KVPilotConnector.kv_cache_access(transfer_config({"sleeps": True}))
    assert isinstance(asked, KVTransferConfig)
    assert (asked.kv_connector, asked.kv_connector_module_path) == (INNER_NAME, None)
    assert asked.kv_connector_extra_config == {"sleeps": True}  # the inner's keys, without kvpilot's
    assert (asked.engine_id, asked.kv_role) == ("engine-a", "kv_both")


def test_sleep_and_wake_reach_the_inner_connector_on_the_worker(tiny_model_dir: Any) -> None:
    config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model_dir), dtype="bfloat16", seed=0, skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BS),
        kv_transfer_config=transfer_config({}),
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    connector = KVPilotConnector(config, KVConnectorRole.WORKER, kv_cache)
    inner = connector.inner
    assert isinstance(inner, FakeInnerConnector) and inner.role == KVConnectorRole.WORKER
    connector.unregister_kv_caches()  # before sleep
    connector.restore_kv_caches()  # after wake-up
    connector.unregister_kv_caches()
    assert inner.cache_calls == ["unregister_kv_caches", "restore_kv_caches", "unregister_kv_caches"]
