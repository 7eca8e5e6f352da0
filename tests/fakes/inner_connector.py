"""A fake *inner* connector: the seam ``KVPilotConnector`` wraps, with knobs.

Where the real inner connector runs, the tests use it. vLLM's ``NixlConnector``
keeps its NIXL agent, handshakes and transfers on its worker side; its scheduler
side is plain bookkeeping that needs no agent, so the component tests of kvpilot's
scheduler layer build it for real inside a real ``Scheduler`` and only play its
worker's part by hand (the ``KVConnectorOutput`` a worker reports: received, failed,
transfer telemetry).

This fake is for what no real connector can show:

* which calls ``KVPilotConnector`` makes to its inner connector, with which
  kv_transfer_params (a real connector keeps no record): a fully verified offer is
  left to the inner connector's own plan, a partly verified one reaches it cut, a
  pull already made is not asked about again;
* an answer that no NIXL arithmetic gives (:attr:`FakeInnerConnector.matched`), so
  that a test can tell the inner connector's number from kvpilot's own;
* the calls newer vLLM releases make that vLLM 0.32's base class lacks (sleep mode's
  KV cache remap in 0.33, the KV cache access flags in 0.34), so that the forwards of
  ``KVPilotConnector`` are exercised on 0.32.

Name it as ``inner_connector`` in the extra config after :func:`register`; reach the
instance as ``scheduler.connector.inner``. It moves no bytes: on the worker side it
records the KV cache's (un)registration and refuses every data-plane call.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

INNER_NAME = "FakeInnerConnector"

FinishedParams = Callable[["Request", list[int]], tuple[bool, dict[str, Any] | None]]


@dataclass(frozen=True, slots=True)
class InnerCall:
    """One call the fake got: the method, the request, a deep copy of the request's
    kv_transfer_params at that moment, and the call's token count
    (``num_computed_tokens`` or ``num_external_tokens``; ``None`` for others)."""

    method: str
    request_id: str
    params: dict[str, Any] | None
    num_tokens: int | None = None


class FakeInnerConnector(KVConnectorBase_V1):
    """An inner connector answering from its knobs:

    * :attr:`matched`: what ``get_num_new_matched_tokens`` reports, for every request;
    * :attr:`finished`: what ``request_finished`` returns; by default NIXL-shaped
      P->D handoff params (:meth:`hand_off`) for a request that asked for them
      (``do_remote_decode``), and ``(False, None)`` for any other;
    * ``sleeps`` in its own extra config: what :meth:`supports_sleep_mode` answers.

    Every scheduler-side call that concerns a request is appended to :attr:`calls`;
    every worker-side call on the KV cache's registration, by name, to :attr:`cache_calls`.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.matched: tuple[int | None, bool] = (0, False)
        self.finished: FinishedParams = self.hand_off
        self.calls: list[InnerCall] = []
        self.cache_calls: list[str] = []

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.33 on asks; the answer is the ``sleeps`` key of ``kv_transfer_config``'s
        extra config (default ``False``)."""
        return bool(kv_transfer_config.kv_connector_extra_config.get("sleeps", False))

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> KVTransferConfig:
        """vLLM 0.34 on asks (for ``KVCacheAccess`` flags); the answer is the config it was
        asked with, so that a test can see what reached the inner connector."""
        return kv_transfer_config

    def asked(self, method: str, request_id: str | None = None) -> list[InnerCall]:
        """The recorded calls to ``method`` (for ``request_id``, if given), oldest first."""
        return [c for c in self.calls if c.method == method and request_id in (None, c.request_id)]

    def hand_off(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The default :attr:`finished`: the fields vLLM's NIXL scheduler returns to
        hand a prefilled request's blocks to D (all of them, held until D reads)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not block_ids:
            return False, None
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "tp_size": 1,
        }

    def _record(self, method: str, request: Request, num_tokens: int | None = None) -> None:
        params = copy.deepcopy(request.kv_transfer_params)
        self.calls.append(InnerCall(method, request.request_id, params, num_tokens))

    # ------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        self._record("on_new_request", request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._record("get_num_new_matched_tokens", request, num_computed_tokens)
        return self.matched

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._record("update_state_after_alloc", request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._record("request_finished", request)
        return self.finished(request, block_ids)

    # ------------------------------------------------------------ worker side: the KV cache's registration
    def unregister_kv_caches(self) -> None:
        self.cache_calls.append("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self.cache_calls.append("restore_kv_caches")

    # ------------------------------------------------------------ worker side: no data plane
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError(INNER_NAME)

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError(INNER_NAME)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError(INNER_NAME)

    def wait_for_save(self) -> None:
        raise NotImplementedError(INNER_NAME)


def register() -> str:
    """Register the fake with vLLM's connector factory (idempotent); returns its name."""
    with contextlib.suppress(ValueError):  # the factory refuses a second registration
        KVConnectorFactory.register_connector(INNER_NAME, __name__, FakeInnerConnector.__name__)
    return INNER_NAME
