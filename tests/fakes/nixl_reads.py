"""A fake of the NIXL worker state a read lives in, for :mod:`kvpilot.kvconnectors.inner_abort`.

vLLM's ``NixlBaseConnectorWorker`` keeps a read's transfer handles in
``_recving_transfers``, its metadata in ``_recving_metadata`` and reads queued behind a
handshake in ``_ready_requests``; releasing a handle is ``nixl_wrapper.release_xfer_handle``.
No NIXL agent runs in a unit test, so this holds the same attributes, and records the
handles released (:attr:`FakeNixlWrapper.released`); ``refuse`` makes a release raise, as
NIXL does when it cannot stop a transfer.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeNixlWrapper:
    released: list[int] = field(default_factory=list)
    refuse: bool = False

    def release_xfer_handle(self, handle: int) -> None:
        if self.refuse:
            raise RuntimeError("NIXL_ERR_BACKEND: transfer still in progress")
        self.released.append(handle)


@dataclass
class FakeNixlWorker:
    nixl_wrapper: FakeNixlWrapper = field(default_factory=FakeNixlWrapper)
    _recving_transfers: dict[str, list[int]] = field(default_factory=dict)
    _recving_metadata: dict[str, Any] = field(default_factory=dict)
    _recv_failures: set[str] = field(default_factory=set)
    _pending_recv_notifs: dict[str, Any] = field(default_factory=dict)
    _ready_requests: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)

    def post(self, request_id: str, *handles: int) -> None:
        """A read of ``request_id`` in flight on ``handles``."""
        self._recving_transfers[request_id] = list(handles)
        self._recving_metadata[request_id] = object()


@dataclass
class FakeNixlInner:
    """An inner connector as :mod:`kvpilot.kvconnectors.inner_abort` sees it."""

    connector_worker: FakeNixlWorker = field(default_factory=FakeNixlWorker)
