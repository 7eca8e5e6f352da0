"""The ``gateway`` section: kvpilot as Envoy's endpoint picker."""

from __future__ import annotations

from kvpilot.policies.typed_config import TypedConfig, check_range
from kvpilot.routing.config.errors import ConfigError


class GatewayConfig(TypedConfig, frozen=True):
    """kvpilot as Envoy's endpoint picker (:mod:`kvpilot.routing.gateway`): with ``picker_port``
    set the router also serves, on ``server.host:picker_port``, the gRPC services Envoy
    calls: ``ext_proc`` (each request's headers and body; the answer names the
    destination) and the OpenTelemetry logs service (Envoy's access log: each request's
    end and first-token time). Streams then go from the engines to the clients through
    Envoy, not through the router (``deploy/envoy_spec.py`` writes Envoy's config).
    ``picker_port`` 0: no picker (the HTTP front alone)."""

    error_type = ConfigError

    picker_port: int = 0
    """The picker's gRPC port on ``server.host`` (Envoy's ``ext_proc`` and access log);
    0: no picker."""
    token_env: str = ""
    """The environment variable (or ``<it>_FILE``, :func:`read_secret`) holding the token
    every gRPC call to the picker must carry as ``authorization: Bearer <token>`` metadata
    (Envoy's ``grpc_service.initial_metadata``); a call without it is refused
    (``UNAUTHENTICATED``) before it reaches the picker or the access log. Set it wherever
    the picker is reachable from other hosts (``server.host`` not loopback; warned at start
    without it: a GAIE gateway that cannot send metadata leaves the NetworkPolicy as the
    only fence); ``""``: no token."""

    def __post_init__(self) -> None:
        check_range(self, "picker_port", at_least=0, below=65536)
