from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvpilot.deploy.dynamo_fleet import native_picker_lines
from kvpilot.deploy.dynamo_spec import DynamoFleetSpec, FrontendRouting, mocker_group_plan, plan_dynamo_fleet
from kvpilot.deploy.env import DYNAMO_LOOPBACK_ENV
from kvpilot.deploy.fleet import FleetStartError
from kvpilot.deploy.fleet_spec import FLEET_TTFT_SLO_S
from kvpilot.routing.config import CostConfig, CostObjective, DisaggregationConfig, Role, RouterConfig
from kvpilot.routing.config_load import load_config
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ingest.dynamo_discovery import kv_events_endpoint


def _spec(**kw) -> DynamoFleetSpec:
    return DynamoFleetSpec(model_dir=Path("/m"), run_dir=Path("/r"), **kw)


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_worker_gets_its_own_process_ports_and_mode():
    workers, frontend, router, _ = plan_dynamo_fleet(_spec(prefill=1, decode=2))
    assert [(w.name, w.role) for w in workers] == [
        ("prefill-0", Role.PREFILL),
        ("decode-0", Role.DECODE),
        ("decode-1", Role.DECODE),
    ]
    assert [w.env["DYN_TCP_RPC_PORT"] for w in workers] == ["20000", "20001", "20002"]
    assert [_flag(w.argv, "--zmq-kv-events-ports") for w in workers] == ["21000", "21001", "21002"]
    assert [w.port for w in workers] == [22000, 22001, 22002]  # the system server: /health, /metrics
    assert [_flag(w.argv, "--disaggregation-mode") for w in workers] == ["prefill", "decode", "decode"]
    assert _flag(workers[0].argv, "--bootstrap-ports") == "23000"
    assert "--bootstrap-ports" not in workers[1].argv
    assert all(_flag(w.argv, "--num-workers") == "1" for w in workers)  # one process each: each can leave alone
    assert _flag(frontend.argv, "--router-mode") == "direct" and _flag(frontend.argv, "--http-host") == "127.0.0.1"
    assert router.argv[-2:] == ("--config", "/r/router.yaml")


def test_every_dynamo_process_and_the_router_stay_on_loopback_with_file_discovery():
    workers, frontend, router, _ = plan_dynamo_fleet(_spec(workers=2))
    for plan in (*workers, frontend, router):
        assert {k: plan.env[k] for k in DYNAMO_LOOPBACK_ENV} == dict(DYNAMO_LOOPBACK_ENV)
        assert plan.env["DYN_FILE_KV"] == "/r/discovery"
    for plan in (*workers, frontend):
        argv = plan.argv
        assert (_flag(argv, "--discovery-backend"), _flag(argv, "--request-plane")) == ("file", "tcp")
        assert _flag(argv, "--event-plane") == "zmq"
    assert [_flag(w.argv, "--disaggregation-mode") for w in workers] == ["agg", "agg"]


def test_the_router_config_parses_and_maps_each_worker_to_its_events_port(tmp_path):
    workers, _, _, config = plan_dynamo_fleet(_spec(prefill=1, decode=1, port_stride=100, worker_port=19000))
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    parsed = load_config(tmp_path / "router.yaml")
    assert parsed.dynamo.frontend_url == "http://127.0.0.1:8090" and parsed.workers == ()
    assert fleet_from_config(parsed).workers == ()  # discovery fills it
    assert parsed.disaggregation.max_local_tokens == 0  # direct mode needs a prefill instance per request
    assert parsed.index.block_size == 32
    assert parsed.server.ttft_slo_s == FLEET_TTFT_SLO_S  # admission by predicted TTFT, as in a vLLM fleet
    for plan in workers:  # the instance at 127.0.0.1:<rpc port> publishes where the worker was told to
        address = f"127.0.0.1:{plan.env['DYN_TCP_RPC_PORT']}/abc/dynamo/backend/generate"
        expected = f"tcp://127.0.0.1:{_flag(plan.argv, '--zmq-kv-events-ports')}"
        assert kv_events_endpoint(parsed.dynamo, address) == expected
    _, _, _, aggregated = plan_dynamo_fleet(_spec(workers=1))
    assert aggregated["disaggregation"] == {} and "cost" not in aggregated  # the router's defaults


def test_the_router_cost_given_reaches_the_router_s_config(tmp_path):
    cost = (("objective", "predicted_ttft"), ("decode_active_request_weight", 200.0))
    _, _, _, config = plan_dynamo_fleet(_spec(workers=2, router_cost=cost))
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    parsed = load_config(tmp_path / "router.yaml").cost
    assert (parsed.objective, parsed.decode_active_request_weight) == (CostObjective.PREDICTED_TTFT, 200.0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({}, "needs workers, or both"),
        ({"prefill": 1}, "needs workers, or both"),
        ({"workers": 1, "decode": 1}, "not both"),
        ({"workers": 11, "port_stride": 10}, "at most port_stride"),
        ({"workers": -1}, ">= 0"),
    ],
)
def test_bad_specs_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _spec(**kw)


def test_the_frontend_routes_as_the_spec_says_and_takes_extra_flags():
    _, frontend, _, _ = plan_dynamo_fleet(_spec(workers=2))
    assert _flag(frontend.argv, "--router-mode") == "direct" and _spec(workers=2).kvpilot_routes
    assert "--router-min-initial-workers" not in frontend.argv  # kvpilot's router waits for them instead
    spec = _spec(workers=2, frontend_routing=FrontendRouting.KV, frontend_flags=("--router-temperature", "0.5"))
    _, frontend, _, _ = plan_dynamo_fleet(spec)
    assert _flag(frontend.argv, "--router-mode") == "kv" and not spec.kvpilot_routes
    assert _flag(frontend.argv, "--router-min-initial-workers") == "2"  # it routes once it has seen them all
    assert frontend.argv[-2:] == ("--router-temperature", "0.5")
    _, frontend, _, _ = plan_dynamo_fleet(_spec(prefill=2, decode=6, frontend_routing=FrontendRouting.ROUND_ROBIN))
    assert _flag(frontend.argv, "--router-mode") == "round-robin"
    assert _flag(frontend.argv, "--router-min-initial-workers") == "2"  # each pool is held to it: never 8


def test_every_mocker_gets_the_extra_mocker_flags():
    workers, _, _, _ = plan_dynamo_fleet(_spec(prefill=1, decode=1, mocker_flags=("--num-gpu-blocks-override", "512")))
    assert all(_flag(w.argv, "--num-gpu-blocks-override") == "512" for w in workers)
    assert all("--num-gpu-blocks-override" not in w.argv for w in plan_dynamo_fleet(_spec(workers=1))[0])


def test_one_mocker_process_holds_every_aggregated_worker_each_with_its_own_events_port():
    plan = mocker_group_plan(_spec(workers=3, worker_port=28000, port_stride=500, mocker_flags=("--x", "1")))
    assert _flag(plan.argv, "--num-workers") == "3" and _flag(plan.argv, "--disaggregation-mode") == "agg"
    assert _flag(plan.argv, "--zmq-kv-events-ports") == "28500,28501,28502"
    assert plan.env["DYN_TCP_RPC_PORT"] == "28000" and plan.port == 29000  # shared: one request plane
    assert plan.side_ports == (28000, 28500, 28501, 28502) and plan.argv[-2:] == ("--x", "1")
    with pytest.raises(ValueError, match="aggregated workers only"):
        mocker_group_plan(_spec(prefill=1, decode=1))


def test_envoy_in_front_of_dynamo_s_router_is_a_fixed_route_the_clients_reach() -> None:
    """A baseline's gateway hop: Dynamo routes, Envoy forwards every request to its frontend."""
    spec = _spec(workers=2, frontend_routing=FrontendRouting.KV, envoy_in_front=True, gateway_port=18080)
    assert spec.gateway is not None and spec.gateway.fixed_upstream == f"127.0.0.1:{spec.frontend_port}"
    assert spec.client_url == "http://127.0.0.1:18080"
    assert _spec(workers=2, frontend_routing=FrontendRouting.KV).gateway is None  # Dynamo alone: no Envoy


@pytest.mark.parametrize(
    "cost", [CostConfig(objective=CostObjective.PREDICTED_TTFT), CostConfig(router_temperature=0.5)]
)
def test_the_compiled_picker_is_refused_a_cost_it_does_not_price(cost: CostConfig) -> None:
    fleet = {"block_size": 32, "workers": []}
    config = RouterConfig(cost=cost, disaggregation=DisaggregationConfig(measured_rates=True))
    with pytest.raises(FleetStartError, match=r"prices cost\.objective 'blocks' at cost\.router_temperature 0 only"):
        native_picker_lines(fleet, "127.0.0.1:8000", config, Path("libzmq.so"))


def test_the_compiled_picker_is_refused_a_disaggregated_fleet() -> None:
    worker = {"name": "prefill-1", "role": "prefill", "instance_id": 1, "kv_events_endpoint": "tcp://127.0.0.1:1"}
    with pytest.raises(FleetStartError, match="co-located workers only"):
        native_picker_lines({"block_size": 32, "workers": [worker]}, "127.0.0.1:8000", RouterConfig(), Path("z.so"))
