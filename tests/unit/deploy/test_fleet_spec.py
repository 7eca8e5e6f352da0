from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.fleet_spec import FleetSpec, Role, plan_fleet
from routing.config import IndexBackend


def _spec(**kw) -> FleetSpec:
    return FleetSpec(model_dir=Path("/m"), run_dir=Path("/r"), cores=2, **kw)


def test_plan_gives_each_engine_its_ports_core_and_connector() -> None:
    engines, router, config = plan_fleet(_spec(prefill=1, decode=2))
    assert [e.name for e in engines] == ["prefill-0", "decode-0", "decode-1"]
    assert [e.port for e in engines] == [8100, 8101, 8102]
    assert [e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in engines] == ["5600", "5601", "5602"]
    assert [e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in engines] == ["0", "1", "0"]
    for e in engines:
        argv = list(e.argv)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "KVPilotConnector" and "kv_connector_module_path" not in kv
        assert e.env["UCX_NET_DEVICES"] == "lo" and e.env["PYTHONHASHSEED"] == "0"
        events = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["enable_kv_cache_events"]
    assert router.argv[-2:] == ("--config", "/r/router.yaml")
    assert [w["role"] for w in config["workers"]] == ["prefill", "decode", "decode"]  # type: ignore[index]  # dict[str, object]
    assert config["server"] == {
        "host": "127.0.0.1",
        "port": 8000,
        "model_name": "tiny",
        "model_dir": "/m",
        "max_prompt_tokens": 8192,
    }
    assert router.side_ports == (5700, 5701, 5702)  # the router binds the event endpoints
    workers = config["workers"]  # type: ignore[index]  # plan_fleet types the config dict[str, object]
    assert [w["url"] for w in workers] == [e.url for e in engines]
    assert [w["replay_endpoint"] for w in workers] == [f"tcp://127.0.0.1:{p}" for p in (5800, 5801, 5802)]


def test_router_config_parses_and_always_disaggregates_on_request(tmp_path: Path) -> None:
    import yaml

    from routing.config import load_config

    _, _, config = plan_fleet(_spec(disaggregation="always", index_backend=IndexBackend.DYNAMO))
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    parsed = load_config(tmp_path / "router.yaml")
    assert parsed.disaggregation.max_local_tokens == 0
    assert parsed.index.backend is IndexBackend.DYNAMO
    assert [w.name for w in parsed.workers] == ["prefill-0", "decode-0"]


def test_a_fleet_with_a_session_store_starts_its_router_with_it(tmp_path: Path) -> None:
    import yaml

    from routing.config import SessionStoreKind, load_config

    _, _, config = plan_fleet(_spec(session_store_url="redis://127.0.0.1:6390/0"))
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    sessions = load_config(tmp_path / "router.yaml").sessions
    assert (sessions.store, sessions.redis_url) == (SessionStoreKind.REDIS, "redis://127.0.0.1:6390/0")
    _, _, plain = plan_fleet(_spec())
    assert "sessions" not in plain


def test_ipc_kv_events_are_bound_by_the_engines_so_replicas_can_subscribe(tmp_path: Path) -> None:
    from deploy.fleet import FleetStartError, start_router
    from routing.ingest.subscriber import subscriber_binds

    engines, router, config = plan_fleet(_spec(kv_events_ipc=True))
    endpoints = [w["kv_events_endpoint"] for w in config["workers"]]  # type: ignore[index]
    assert all(e.startswith("ipc://") and not subscriber_binds(e) for e in endpoints)
    assert len(set(endpoints)) == len(engines) and router.side_ports == ()
    with pytest.raises(FleetStartError, match="kv_events_ipc"):
        start_router(_spec(), "router-b", 1)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prefill": 1, "decode": 0}, "needs at least one decode"),
        ({"prefill": 0, "decode": 0}, "at least one decode or co-located"),
        ({"block_size": 16}, "multiple of 32"),
        ({"prefill": -1}, ">= 0"),
        ({"disaggregation": "sometimes"}, "conditional"),
        ({"index_backend": "redis"}, "index_backend"),
    ],
)
def test_invalid_fleets_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**kw)


def test_roles_are_named() -> None:
    engines, _, _ = plan_fleet(_spec(prefill=0, decode=0, colocated=1))
    assert engines[0].role is Role.COLOCATED


def test_an_engine_api_key_reaches_engines_and_router_by_environment_only() -> None:
    from deploy.fleet_spec import ENGINE_API_KEY_ENV

    engines, router, config = plan_fleet(_spec(prefill=1, decode=1, engine_api_key="s3cret"))
    assert all(e.env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in " ".join(e.argv) for e in engines)
    assert router.env == {ENGINE_API_KEY_ENV: "s3cret"} and "s3cret" not in " ".join(router.argv)
    assert config["server"]["engine_api_key_env"] == ENGINE_API_KEY_ENV  # type: ignore[index]  # dict[str, object]
    assert "s3cret" not in repr(_spec(engine_api_key="s3cret"))
    engines, router, config = plan_fleet(_spec())
    assert all("VLLM_API_KEY" not in e.env for e in engines) and router.env == {}
    assert "engine_api_key_env" not in config["server"]  # type: ignore[operator]  # dict[str, object]
