"""The ``dynamo`` section: routing a Dynamo deployment through its frontend in direct mode."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from urllib.parse import urlsplit

import msgspec

from kvpilot.policies.typed_config import TypedConfig, check_range
from kvpilot.routing.config.errors import ConfigError


class DiscoveryBackend(str, enum.Enum):
    """Where Dynamo's own discovery client finds the workers (its ``--discovery-backend``)."""

    FILE = "file"  # the directory in $DYN_FILE_KV
    ETCD = "etcd"  # ETCD_ENDPOINTS
    KUBERNETES = "kubernetes"


class DynamoConfig(TypedConfig, frozen=True):
    """Routing a Dynamo deployment through its frontend in direct mode
    (:mod:`kvpilot.routing.ingest.dynamo_discovery`, :mod:`kvpilot.routing.serve.dynamo_upstream`).

    The workers are the instances of ``decode_endpoint`` (decode, or aggregated when
    no prefill instance exists) and ``prefill_endpoint``, read through Dynamo's own
    discovery client every ``discovery_interval_s``. Each worker's vLLM-format KV events
    are read at ``tcp://<its request-plane host>:<port>``, the port being its
    request-plane port plus ``kv_events_port_offset`` (many workers on one host, each
    started with its own ``DYN_TCP_RPC_PORT``) or ``kv_events_port`` (the same port on
    every host); both 0: no KV events (routed on load alone). ``kv_events_endpoints``
    names the endpoint of an instance by its id in hex (``40c4d0cf81efebb0``) and comes
    before both rules: workers that share one process (``dynamo.mocker --num-workers``)
    share its request-plane port, so no port rule tells them apart."""

    error_type = ConfigError

    frontend_url: str = ""
    """Dynamo's frontend in direct mode (``http://host:port``): every request goes there with
    the chosen instances named; ``""``: not beside Dynamo (the ``workers`` are vLLM engines)."""
    discovery_backend: DiscoveryBackend = DiscoveryBackend.FILE
    """Where Dynamo's own discovery client finds the workers: ``file`` (``$DYN_FILE_KV``),
    ``etcd`` (``$ETCD_ENDPOINTS``) or ``kubernetes``."""
    decode_endpoint: str = "dynamo.backend.generate"
    """The decode (or aggregated) workers' endpoint, ``namespace.component.endpoint``."""
    prefill_endpoint: str = "dynamo.prefill.generate"
    """The prefill workers' endpoint, ``namespace.component.endpoint``."""
    discovery_interval_s: float = 1.0
    """How often discovery is read: workers that joined are routed to, those that left dropped."""
    kv_events_port_offset: int = 0
    """A worker's KV events are at its request-plane port plus this (many workers on one
    host); 0: this rule is off."""
    kv_events_port: int = 0
    """A worker's KV events are at this port on its host (one worker per host); 0: off."""
    kv_events_endpoints: Mapping[str, str] = msgspec.field(default_factory=dict)
    """Instance id in hex -> ``tcp://host:port`` of its KV events, before both port rules
    (workers that share one process share its request-plane port)."""
    kv_replay_port_offset: int = 0
    """With ``kv_events_port_offset``: each worker serves its KV-event replay at its
    request-plane port plus this (``dynamo.mocker --zmq-replay-ports``), so a restarted
    router reads back the blocks the workers hold; 0: no replay."""

    @property
    def enabled(self) -> bool:
        return bool(self.frontend_url)

    def __post_init__(self) -> None:
        if self.frontend_url:
            parts = urlsplit(self.frontend_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError("frontend_url", f"must be http(s)://host:port, got {self.frontend_url!r}")
            msgspec.structs.force_setattr(self, "frontend_url", self.frontend_url.rstrip("/"))
        for name in ("decode_endpoint", "prefill_endpoint"):
            if len(getattr(self, name).split(".")) != 3:
                raise ConfigError(name, f"must be namespace.component.endpoint, got {getattr(self, name)!r}")
        check_range(self, "discovery_interval_s", above=0)
        if self.kv_events_port and self.kv_events_port_offset:
            raise ConfigError("kv_events_port", "set kv_events_port or kv_events_port_offset, not both")
        check_range(self, "kv_events_port", at_least=0, below=65536)
        check_range(self, "kv_events_port_offset", above=-65536, below=65536)
        check_range(self, "kv_replay_port_offset", above=-65536, below=65536)
        if self.kv_replay_port_offset and not self.kv_events_port_offset:
            raise ConfigError("kv_replay_port_offset", "needs kv_events_port_offset (the same port rule)")
        for instance, endpoint in self.kv_events_endpoints.items():
            try:
                int(instance, 16)
            except ValueError:
                raise ConfigError("kv_events_endpoints", f"keys are instance ids in hex, got {instance!r}") from None
            if not endpoint.startswith("tcp://"):
                raise ConfigError("kv_events_endpoints", f"{instance}: must be tcp://host:port, got {endpoint!r}")
        endpoints = {instance.lower(): endpoint for instance, endpoint in self.kv_events_endpoints.items()}
        msgspec.structs.force_setattr(self, "kv_events_endpoints", MappingProxyType(endpoints))
