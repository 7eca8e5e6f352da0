from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpilot.deploy.envoy_spec import PickerFailure
from kvpilot.deploy.fleet_spec import DECODE_HOLD_TTL_S, FleetSpec, Role, plan_fleet
from kvpilot.routing.config import IndexBackend


def _spec(**kw) -> FleetSpec:
    return FleetSpec(model_dir=Path("/m"), run_dir=Path("/r"), cores=2, **kw)


def test_plan_gives_each_engine_its_ports_core_and_connector() -> None:
    engines, router, config = plan_fleet(_spec(prefill=1, decode=2))
    assert [e.name for e in engines] == ["prefill-0", "decode-0", "decode-1"]
    assert [e.port for e in engines] == [8100, 8101, 8102]
    assert [e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in engines] == ["5600", "5601", "5602"]
    assert [e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in engines] == ["0", "1", "0"]
    assert [e.cores for e in engines] == [(0,), (1,), (0,)]  # every process of the engine, not only its compute
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
        "max_model_len": 8192,
        "ttft_slo_s": 60.0,  # admission by predicted TTFT is on in a fleet
        "calibration_workers": 1,  # and its predictions are measured before the first request
    }
    assert router.side_ports == (5700, 5701, 5702)  # the router binds the event endpoints
    workers = config["workers"]  # type: ignore[index]  # plan_fleet types the config dict[str, object]
    assert [w["url"] for w in workers] == [e.url for e in engines]
    assert [w["replay_endpoint"] for w in workers] == [f"tcp://127.0.0.1:{p}" for p in (5800, 5801, 5802)]


def test_router_config_parses_and_always_disaggregates_on_request(tmp_path: Path) -> None:
    import yaml

    from kvpilot.routing.config_load import load_config

    _, _, config = plan_fleet(_spec(disaggregation="always", index_backend=IndexBackend.DYNAMO))
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    parsed = load_config(tmp_path / "router.yaml")
    assert parsed.disaggregation.max_local_tokens == 0
    assert parsed.index.backend is IndexBackend.DYNAMO
    assert [w.name for w in parsed.workers] == ["prefill-0", "decode-0"]


def test_the_router_refuses_what_the_fleet_s_engines_would_by_their_max_model_len(tmp_path: Path) -> None:
    import yaml

    from kvpilot.routing.config_load import load_config
    from kvpilot.routing.refusals import BadRequest
    from kvpilot.routing.serve.engine_checks import check_fields
    from kvpilot.routing.serve.intake import engine_limits
    from kvpilot.routing.serve.upstream import Api

    engines, _, config = plan_fleet(_spec(max_model_len=4096))
    assert {e.argv[list(e.argv).index("--max-model-len") + 1] for e in engines} == {"4096"}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    limits = engine_limits(load_config(tmp_path / "router.yaml").server)
    assert limits.max_model_len == 4096
    check_fields({"model": "tiny", "prompt": "hi", "max_tokens": 4096}, Api.COMPLETIONS, limits)
    with pytest.raises(BadRequest, match="cannot be greater than max_model_len=4096"):  # vLLM's message
        check_fields({"model": "tiny", "prompt": "hi", "max_tokens": 4097}, Api.COMPLETIONS, limits)


@pytest.mark.parametrize(
    ("engine_args", "expected"),
    [
        ((), 20),
        (("--max-logprobs", "40"), 40),
        (("--max-logprobs=-1",), -1),
        (("--max-logprobs", "5", "--max-logprobs=9"), 9),
    ],
)
def test_the_router_allows_the_logprobs_the_fleet_s_engines_allow(
    tmp_path: Path, engine_args: tuple, expected: int
) -> None:
    """vLLM states its --max-logprobs nowhere: the fleet hands the engines' to the router."""
    import yaml

    from kvpilot.routing.config_load import load_config

    _, _, config = plan_fleet(_spec(engine_args=engine_args))
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    assert load_config(tmp_path / "router.yaml").server.max_logprobs == expected


def test_a_fleet_with_a_session_store_starts_its_router_with_it(tmp_path: Path) -> None:
    import yaml

    from kvpilot.routing.config import SessionStoreKind
    from kvpilot.routing.config_load import load_config

    _, _, config = plan_fleet(_spec(session_store_url="redis://127.0.0.1:6390/0"))
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    sessions = load_config(tmp_path / "router.yaml").sessions
    assert (sessions.store, sessions.redis_url) == (SessionStoreKind.REDIS, "redis://127.0.0.1:6390/0")
    _, _, plain = plan_fleet(_spec())
    assert "sessions" not in plain


def test_ipc_kv_events_are_bound_by_the_engines_so_replicas_can_subscribe(tmp_path: Path) -> None:
    from kvpilot.routing.ingest.subscriber import subscriber_binds

    engines, router, config = plan_fleet(_spec(kv_events_ipc=True))
    endpoints = [w["kv_events_endpoint"] for w in config["workers"]]  # type: ignore[index]
    assert all(e.startswith("ipc://") and not subscriber_binds(e) for e in endpoints)
    assert len(set(endpoints)) == len(engines) and router.side_ports == ()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prefill": 1, "decode": 0}, "needs at least one decode"),
        ({"prefill": 0, "decode": 0}, "at least one decode or co-located"),
        ({"block_size": 16}, "multiple of 32"),
        ({"prefill": -1}, ">= 0"),
        ({"disaggregation": "sometimes"}, "conditional"),
        ({"index_backend": "redis"}, "index_backend"),
        ({"ttft_slo_s": -1.0}, "ttft_slo_s"),
        ({"engine_args": ("--max-logprobs", "many")}, "--max-logprobs must be an integer, got 'many'"),
        (
            {"gateway_port": 8080, "on_picker_failure": PickerFailure.ROUND_ROBIN, "engine_api_key": "k"},
            "cannot work with an engine API key",
        ),
    ],
)
def test_invalid_fleets_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**kw)


def test_roles_are_named() -> None:
    engines, _, _ = plan_fleet(_spec(prefill=0, decode=0, colocated=1))
    assert engines[0].role is Role.COLOCATED


def test_an_engine_api_key_reaches_engines_and_router_by_environment_only() -> None:
    from kvpilot.deploy.fleet_spec import ENGINE_API_KEY_ENV

    engines, router, config = plan_fleet(_spec(prefill=1, decode=1, engine_api_key="s3cret"))
    assert all(e.env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in " ".join(e.argv) for e in engines)
    assert router.env == {ENGINE_API_KEY_ENV: "s3cret"} and "s3cret" not in " ".join(router.argv)
    assert config["server"]["engine_api_key_env"] == ENGINE_API_KEY_ENV  # type: ignore[index]  # dict[str, object]
    assert "s3cret" not in repr(_spec(engine_api_key="s3cret"))
    engines, router, config = plan_fleet(_spec())
    assert all("VLLM_API_KEY" not in e.env for e in engines) and router.env == {}
    assert "engine_api_key_env" not in config["server"]  # type: ignore[operator]  # dict[str, object]


def test_the_measured_collision_is_refused_before_anything_starts_naming_both_users() -> None:
    """`kvpilot fleet up --observe --prometheus-port 18820 --events-port 18720` put NIXL's
    exporter of the first engine on the second engine's replay port (18721 + 100), and
    the first engine's replay port on Prometheus' own."""
    from kvpilot.deploy.fleet_spec import PortCollision
    from kvpilot.deploy.observe import ObserveSpec, plan_observe

    spec = _spec(events_port=18720)
    engines, router, _ = plan_fleet(spec)  # the fleet alone does not collide
    with pytest.raises(PortCollision) as refused:
        plan_observe(ObserveSpec(port=18820), spec.run_dir, engines, router)
    message = str(refused.value)
    assert (
        "port 18821 is planned for prefill-0's NIXL Prometheus exporter (Prometheus port + 1 + 0) and "
        "decode-0's KV-event replay (events port + 100 + 1)" in message
    )
    assert (
        "port 18820 is planned for prefill-0's KV-event replay (events port + 100 + 0) and prometheus's HTTP" in message
    )
    engines, router, _ = plan_fleet(_spec(events_port=18720))
    plan_observe(ObserveSpec(port=18900), spec.run_dir, engines, router)  # moved: no collision


@pytest.mark.parametrize(
    ("kw", "port", "users"),
    [
        # engine 1's HTTP port is the router's
        (
            {"prefill": 1, "decode": 1, "engine_port": 7999, "router_port": 8000},
            8000,
            ("decode-0's HTTP", "router's HTTP"),
        ),
        # the side channels run into the first KV-event port the router binds
        (
            {"prefill": 1, "decode": 2, "side_channel_port": 5698},
            5700,
            ("decode-1's NIXL", "router's KV events of prefill-0"),
        ),
        # one process twice: engine 0's replay port (events port + 100) is its side channel
        ({"events_port": 5500, "side_channel_port": 5600}, 5600, ("prefill-0's NIXL", "prefill-0's KV-event replay")),
    ],
)
def test_colliding_fleet_ports_are_refused(kw: dict, port: int, users: tuple[str, str]) -> None:
    from kvpilot.deploy.fleet_spec import PortCollision

    with pytest.raises(PortCollision, match=f"port {port} is planned for ") as refused:
        plan_fleet(_spec(**kw))
    line = next(line for line in str(refused.value).splitlines() if f"port {port} " in line)
    assert all(user in line for user in users), line


def test_a_port_beyond_tcp_is_refused() -> None:
    from kvpilot.deploy.fleet_spec import PortCollision

    with pytest.raises(PortCollision, match=r"port 65536 \(prefill-0's KV-event replay .*\) is not in 1..65535"):
        plan_fleet(_spec(events_port=65436))


@pytest.mark.parametrize(
    ("extra", "held"),
    [
        ({"bidirectional_kv_xfer": True}, DECODE_HOLD_TTL_S),  # the fleet's hold, not vLLM's 480 s
        ({"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 300}, 300),  # the user's
        ({}, None),  # D holds nothing without bidirectional transfer
    ],
)
def test_a_bidirectional_decode_engine_holds_its_offers_for_the_fleet_s_ttl(extra: dict, held: int | None) -> None:
    engines, _, _ = plan_fleet(_spec(connector_extra_config=extra))
    for e in engines:
        argv = list(e.argv)
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector_extra_config"].get("decoder_kv_blocks_ttl") == held


def test_envoy_in_front_gets_the_picker_s_port_on_the_router_and_falls_open_to_the_engines_that_serve_alone() -> None:
    spec = _spec(gateway_port=18080, picker_port=18070, envoy_admin_port=18071)
    _, router, config = plan_fleet(spec)
    assert config["gateway"] == {"picker_port": 18070}
    assert dict(zip(router.side_ports, router.side_port_uses, strict=True))[18070] == "endpoint picker (gRPC)"
    assert spec.client_url.endswith(":18080") and spec.gateway is not None
    open_ = dataclasses.replace(spec, on_picker_failure=PickerFailure.ROUND_ROBIN)
    assert open_.gateway is not None
    assert open_.gateway.fallback_endpoints == tuple(f"127.0.0.1:{spec.engine_port + i}" for i in range(1, 2))
    assert _spec().gateway is None and _spec().client_url.endswith(f":{_spec().router_port}")
