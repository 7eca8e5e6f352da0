"""The ``index`` section: which block index, and how it reads KV events (tiers included)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from kvpilot.policies.typed_config import TypedConfig, check_range
from kvpilot.routing.config.errors import ConfigError


class IndexBackend(str, enum.Enum):
    """``index.backend``: the block index the router keeps."""

    KVPILOT = "kvpilot"
    """:class:`kvpilot.routing.index.block_index.BlockIndex`."""
    DYNAMO = "dynamo"
    """Dynamo's ``RadixTree`` (:mod:`kvpilot.routing.index.dynamo`; needs ``kvpilot[dynamo]``)."""


class TierClass(str, enum.Enum):
    """What a KV event's medium counts as in the cost (``index.tiers`` maps media to
    these), best first: blocks are credited only beyond the better classes."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"
    SHARED = "shared"


class IndexConfig(TypedConfig, frozen=True):
    """Which block index, and how it reads KV events."""

    error_type = ConfigError

    backend: IndexBackend = IndexBackend.KVPILOT
    """The block index: ``kvpilot``'s own, or ``dynamo``, Dynamo's ``RadixTree`` fed the same
    events (needs ``kvpilot[dynamo]``)."""
    block_size: int = 16
    """The engines' KV block size in tokens (vLLM's ``--block-size``): every engine of the
    fleet must use it; a KV event of another size is skipped (counted)."""
    kv_group: int = 0
    """The KV cache group whose events are indexed (vLLM's ``group_idx``; a hybrid model
    publishes one per group); events of other groups are skipped."""
    removal_log_capacity: int = 65536
    """Removals the ``kvpilot`` index keeps so a session's next step re-matches only what
    was evicted since its last one; past it, the step is matched from scratch."""
    events_stale_after_s: float = 30.0
    """A worker that prefilled blocks its entries lacked and then published no KV
    event for this long is routed on load alone (``kvpilot.routing.health.event_watch``),
    flagged in ``kvpilot_router_kv_events_stale{worker}`` and named in a warning: an engine
    whose ``--kv-events-config`` does not reach the router is found within this long of its
    first prefill. 0 = off. A false alarm (right after a router restart the index can lack
    blocks an engine holds, and a prefill of those publishes nothing) costs that worker its
    overlap credit until its next batch."""
    events_idle_read_s: float = 0.1
    """While the router has matched no request against the index for a second (a compiled
    picker in front decides them all), its feeder reads the engines' KV events this often
    instead of as each batch arrives, waking once a period rather than once a batch; the
    first request matched after such a spell sees events up to this late. 0 = always as each
    batch arrives."""
    tiers: Mapping[str, TierClass] = msgspec.field(
        default_factory=lambda: {
            "GPU": TierClass.GPU,
            "CPU": TierClass.HOST,
            "CPU_PINNED": TierClass.HOST,
            "STORAGE": TierClass.DISK,
        }
    )
    """A KV event's medium -> its :class:`TierClass`; media not listed earn nothing. ``CPU``
    is vLLM's offloading connectors' host tier, ``CPU_PINNED`` Dynamo's (its publishers'
    ``StorageTier::HostPinned``)."""

    def __post_init__(self) -> None:
        check_range(self, "block_size", "removal_log_capacity", above=0)
        check_range(self, "kv_group", "events_stale_after_s", "events_idle_read_s", at_least=0)
        msgspec.structs.force_setattr(self, "tiers", MappingProxyType(dict(self.tiers)))
