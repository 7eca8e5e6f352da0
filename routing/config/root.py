"""The whole config, :class:`RouterConfig`: every section under its key."""

from __future__ import annotations

import msgspec

from kvpilot.policies.typed_config import TypedConfig
from kvpilot.routing.config.cost import CostConfig, CostObjective
from kvpilot.routing.config.disaggregation import DisaggregationConfig
from kvpilot.routing.config.dynamo import DynamoConfig
from kvpilot.routing.config.errors import ConfigError
from kvpilot.routing.config.gateway import GatewayConfig
from kvpilot.routing.config.index import IndexConfig
from kvpilot.routing.config.server import ServerConfig
from kvpilot.routing.config.sessions import SessionConfig
from kvpilot.routing.config.workers import Worker


class RouterConfig(TypedConfig, frozen=True):
    """The router's whole configuration: the YAML of ``kvpilot router --config``."""

    error_type = ConfigError

    cost: CostConfig = msgspec.field(default_factory=CostConfig)
    """Dynamo's cost function: its parameters under Dynamo's names and defaults, plus kvpilot's own."""
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    """The global block index and the KV events that feed it."""
    sessions: SessionConfig = msgspec.field(default_factory=SessionConfig)
    """Agent sessions: affinity, D's offers, the article's five options, the shared store."""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    """The HTTP front: address, model, limits, admission, timeouts, circuits, API keys."""
    disaggregation: DisaggregationConfig = msgspec.field(default_factory=DisaggregationConfig)
    """Local or remote prefill per request (conditional disaggregation) and the roofline prior."""
    dynamo: DynamoConfig = msgspec.field(default_factory=DynamoConfig)
    """Beside NVIDIA Dynamo: its frontend, its discovery and its workers' KV events."""
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    """The endpoint picker behind Envoy."""
    workers: tuple[Worker, ...] = ()
    """The engines (not beside Dynamo, whose workers come from its discovery)."""

    def __post_init__(self) -> None:
        if self.cost.objective is CostObjective.PREDICTED_TTFT and not self.disaggregation.measured_rates:
            raise ConfigError("cost.objective", "predicted_ttft needs disaggregation.measured_rates: true")
