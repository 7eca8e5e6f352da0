"""Envoy in front of a fleet, with kvpilot's picker deciding: pure planning, no processes.

:func:`envoy_bootstrap` writes Envoy's static bootstrap for a :class:`GatewaySpec`:

- one listener (``gateway_port``) whose HTTP connection manager runs the ``ext_proc``
  filter, then the router filter. ``ext_proc`` sends each request's headers and whole
  body (``BUFFERED``) and each response's headers to the picker, never a response body:
  the picker answers with the destination (:data:`DESTINATION_HEADER`, GAIE's endpoint
  picker protocol), the body it wants sent (token ids) and, beside Dynamo, Dynamo's
  direct-mode instance headers. Envoy then carries the stream from the destination to
  the client on its own;
- a route per destination kind: a request the picker named a destination for goes to an
  ``ORIGINAL_DST`` cluster that connects to that ``host:port``; any other request gets
  what :class:`PickerFailure` says (a 503 naming the picker, or round robin over
  ``fallback_endpoints``);
- an OpenTelemetry access log to the picker's OTLP logs service, one entry per request,
  sent as the request ends: the request id, the status, and when the destination's first
  body byte arrived (``US_RX_BODY_BEG``: the first token of a stream), which is how the
  picker learns each request's end and first-token time without reading its body;
- the admin interface, like every listener, on 127.0.0.1 only.

Everything Envoy connects to or listens on is the loopback address given (``host``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""GAIE's endpoint-picker protocol: the ``host:port`` the picker chose."""
PICKED_CLUSTER = "picked"
PICKER_CLUSTER = "kvpilot_picker"
FALLBACK_CLUSTER = "fallback"
ACCESS_LOG_NAME = "kvpilot"
"""The OTLP log name Envoy's access log sends under (the picker checks it)."""


class PickerFailure(str, enum.Enum):
    """What Envoy does with a request when the picker cannot be reached or fails."""

    REFUSE = "refuse"
    """503 at once, naming the picker (the default: no request lands on a worker the
    picker did not choose, and beside Dynamo's direct-mode frontend nothing else can
    route)."""
    ROUND_ROBIN = "round_robin"
    """Fail open: round robin over the fleet's engines (co-located vLLM engines only)."""


class LogAttribute(str, enum.Enum):
    """The attributes of each access-log entry, and Envoy's format for each."""

    REQUEST_ID = "request_id"
    STATUS = "status"
    FIRST_BODY_BYTE_US = "first_body_byte_us"
    """Microseconds from the request's first byte to the destination's first body byte
    (``-`` when none came)."""
    DURATION_US = "duration_us"
    DESTINATION = "destination"

    @property
    def envoy_format(self) -> str:
        return {
            LogAttribute.REQUEST_ID: "%REQ(X-REQUEST-ID)%",
            LogAttribute.STATUS: "%RESPONSE_CODE%",
            LogAttribute.FIRST_BODY_BYTE_US: "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
            LogAttribute.DURATION_US: "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
            LogAttribute.DESTINATION: "%UPSTREAM_HOST%",
        }[self]


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    """Envoy's ports and the picker it asks."""

    gateway_port: int
    """Where clients send requests."""
    admin_port: int
    picker_port: int
    """The picker's gRPC server: ext_proc and the OTLP logs service."""
    on_picker_failure: PickerFailure = PickerFailure.REFUSE
    fallback_endpoints: tuple[str, ...] = ()
    """``host:port`` of each engine, for :attr:`PickerFailure.ROUND_ROBIN`."""
    host: str = "127.0.0.1"
    picker_timeout_s: float = 5.0
    """How long Envoy waits for one picker answer before failing the request as
    :attr:`on_picker_failure` says."""
    access_log_flush_s: float = 0.01
    """How long Envoy batches access-log entries before sending them."""

    def __post_init__(self) -> None:
        if self.on_picker_failure is PickerFailure.ROUND_ROBIN and not self.fallback_endpoints:
            raise ValueError("on_picker_failure round_robin needs fallback_endpoints (the engines)")
        if self.on_picker_failure is PickerFailure.REFUSE and self.fallback_endpoints:
            raise ValueError("fallback_endpoints are used only with on_picker_failure round_robin")
        ports = (self.gateway_port, self.admin_port, self.picker_port)
        if len(set(ports)) != len(ports):
            raise ValueError(f"gateway, admin and picker ports must differ, got {ports}")


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(host_ports: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for host_port in host_ports:
        host, _, port = host_port.rpartition(":")
        out.append({"endpoint": {"address": _address(host, int(port))}})
    return out


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def _ext_proc(spec: GatewaySpec) -> dict[str, Any]:
    fail_open = spec.on_picker_failure is PickerFailure.ROUND_ROBIN
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}, "timeout": _seconds(spec.picker_timeout_s)},
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": "ServiceUnavailable"},
            "message_timeout": _seconds(spec.picker_timeout_s),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
            # the picker's own headers (the destination, Dynamo's instance ids) may be set
            "mutation_rules": {"allow_all_routing": True},
        },
    }


def _access_log(spec: GatewaySpec) -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.open_telemetry",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.open_telemetry.v3.OpenTelemetryAccessLogConfig",
            # Envoy 1.40's own fields (its common_config is deprecated; xds-protos 1.85 predates them)
            "log_name": ACCESS_LOG_NAME,
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
            "buffer_flush_interval": _seconds(spec.access_log_flush_s),
            "buffer_size_bytes": 0,
            "body": {"string_value": LogAttribute.REQUEST_ID.envoy_format},
            "attributes": {
                "values": [{"key": a.value, "value": {"string_value": a.envoy_format}} for a in LogAttribute]
            },
        },
    }


def _routes(spec: GatewaySpec) -> list[dict[str, Any]]:
    picked = {
        "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
        "route": {"cluster": PICKED_CLUSTER, "timeout": "0s"},
    }
    if spec.on_picker_failure is PickerFailure.ROUND_ROBIN:
        unpicked: dict[str, Any] = {"match": {"prefix": "/"}, "route": {"cluster": FALLBACK_CLUSTER, "timeout": "0s"}}
    else:  # reached only when the picker let a request through without a destination
        body = '{"error": {"message": "kvpilot\'s picker named no destination", "type": "unavailable", "code": 503}}'
        unpicked = {"match": {"prefix": "/"}, "direct_response": {"status": 503, "body": {"inline_string": body}}}
    return [picked, unpicked]


def _clusters(spec: GatewaySpec) -> list[dict[str, Any]]:
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    clusters: list[dict[str, Any]] = [
        {
            "name": PICKED_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        },
        {
            "name": PICKER_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "0.25s",
            "typed_extension_protocol_options": http2,
            "load_assignment": {
                "cluster_name": PICKER_CLUSTER,
                "endpoints": [{"lb_endpoints": _endpoints([f"{spec.host}:{spec.picker_port}"])}],
            },
        },
    ]
    if spec.fallback_endpoints:
        clusters.append(
            {
                "name": FALLBACK_CLUSTER,
                "type": "STATIC",
                "lb_policy": "ROUND_ROBIN",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": FALLBACK_CLUSTER,
                    "endpoints": [{"lb_endpoints": _endpoints(spec.fallback_endpoints)}],
                },
            }
        )
    return clusters


def envoy_bootstrap(spec: GatewaySpec) -> dict[str, Any]:
    """Envoy's bootstrap for ``spec`` (see the module doc), as a mapping to write as YAML."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "generate_request_id": True,
        # streams may run long: no idle or whole-request limit of Envoy's own
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        "route_config": {"name": "picked", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": _routes(spec)}]},
        "http_filters": [
            _ext_proc(spec),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            },
        ],
        "access_log": [_access_log(spec)],
    }
    listener = {
        "name": "gateway",
        "address": _address(spec.host, spec.gateway_port),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}],
    }
    return {
        "admin": {"address": _address(spec.host, spec.admin_port)},
        "static_resources": {"listeners": [listener], "clusters": _clusters(spec)},
    }
