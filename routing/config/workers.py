"""The ``workers`` section's entries: one engine each (:class:`Worker`), with its :class:`Role`."""

from __future__ import annotations

import enum
from urllib.parse import urlsplit

import msgspec

from kvpilot.policies.typed_config import TypedConfig, check_range
from kvpilot.routing.config.errors import ConfigError
from kvpilot.routing.ids import WorkerId


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class Worker(TypedConfig, frozen=True):
    """One engine: an OpenAI-compatible server at ``url`` with optional KV events, as
    written in YAML and as the router uses it (:mod:`kvpilot.routing.fleet` checks the fleet)."""

    error_type = ConfigError

    name: WorkerId
    """The worker's name in routes, metrics and logs (unique in the fleet)."""
    role: Role
    """``prefill``, ``decode`` or ``colocated`` (prefills and decodes its own requests)."""
    url: str
    """The engine's OpenAI-compatible server, ``http(s)://host:port``."""
    kv_events_endpoint: str | None = None
    """Where the engine publishes its KV events (vLLM's ``--kv-events-config`` endpoint, as
    seen from the router: ``tcp://host:port``); null: routed on load alone."""
    replay_endpoint: str | None = None
    """The engine's KV-event replay endpoint (vLLM's ``replay_endpoint``): the router asks it
    for the events it missed; null: a gap clears the worker's entries instead."""
    topic: str = "kv"
    """The ZMQ topic of the engine's KV events (vLLM's ``topic``)."""
    kv_blocks: int = 0
    """KV capacity in blocks (0 = unknown: the decode-busy guard reads usage 0)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name", "must be a non-empty string")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError("url", f"must be http(s)://host:port, got {self.url!r}")
        msgspec.structs.force_setattr(self, "url", self.url.rstrip("/"))
        for name in ("kv_events_endpoint", "replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(_EVENT_SCHEMES):
                raise ConfigError(name, f"must be a tcp://, ipc:// or inproc:// endpoint, got {endpoint!r}")
        if self.replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("replay_endpoint", "needs kv_events_endpoint")
        check_range(self, "kv_blocks", at_least=0)
