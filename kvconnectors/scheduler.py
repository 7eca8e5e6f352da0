"""kvpilot's scheduler-side layer: what ``KVPilotConnector`` adds between vLLM's
scheduler and the inner connector.

P side: ``request_finished`` stamps kvpilot's offer into the kv_transfer_params the
inner connector returns for a decode peer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconnectors.stats import KVPilotStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

PARAMS_KEY = "kvpilot"
SCHEMA_VERSION = 1


class KVPilotScheduler:
    """Scheduler-side state of one ``KVPilotConnector``. Not thread-safe: vLLM's
    scheduler calls it from one thread."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._stats = KVPilotStats()

    def stamp_offer(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Add kvpilot's offer to ``params`` when they hand this prefill to a decode peer.

        Returns ``params`` (mutated) or ``None`` when the inner connector returned none.
        """
        if params is None or not params.get("do_remote_prefill"):
            return params
        params[PARAMS_KEY] = {"version": SCHEMA_VERSION}
        self._stats.count("offers")
        return params

    def take_stats(self) -> KVPilotStats:
        """The counts since the last call; resets them."""
        stats, self._stats = self._stats, KVPilotStats()
        return stats
