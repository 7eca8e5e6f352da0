"""Abandoning a read inside vLLM's NIXL worker: the one place kvpilot touches its state.

``KVConnectorBase_V1`` has no call to cancel a read in flight, and a read abandoned but
left running would go on writing into blocks vLLM has handed back for recomputation. So
:func:`abort_read` releases the read's NIXL transfer handles (NIXL aborts a transfer whose
handle is released while it runs; vLLM's own failure path does the same) and removes the
request from the worker's books, so that it is never reported done, and
:func:`drop_queued_reads` removes a read queued behind a handshake before the inner
connector's ``start_load_kv`` can post it; a handshake that finishes between the two (its
callback runs on NIXL's handshake thread) can still get a read posted, which the worker
layer stops right after ``start_load_kv`` (:func:`posted_read`), before that step's forward
pass: a window of one ``start_load_kv`` call remains. The attributes read are vLLM 0.32's
``NixlBaseConnectorWorker`` (``connector_worker``): ``_recving_transfers``,
``_recving_metadata``, ``_recv_failures``, ``_pending_recv_notifs``, ``_ready_requests``
and ``nixl_wrapper``. Another inner connector, or a NIXL worker without them, cannot
abandon a read: :func:`abort_read` returns ``False`` and the read is left to finish.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Collection
from typing import Any

logger = logging.getLogger("kvpilot.connector")


def _nixl_worker(inner: object) -> Any | None:
    worker = getattr(inner, "connector_worker", None)
    needed = ("_recving_transfers", "_recving_metadata", "nixl_wrapper")
    return worker if worker is not None and all(hasattr(worker, name) for name in needed) else None


def abort_read(inner: object, request_id: str) -> bool:
    """Stop the inner connector's read for ``request_id`` and forget it. ``True`` when no
    transfer of it can write any more (released, or none posted); ``False`` when the inner
    connector is not a NIXL worker or a handle would not release (the read is left alone)."""
    worker = _nixl_worker(inner)
    if worker is None:
        return False
    handles = list(worker._recving_transfers.get(request_id, ()))
    for handle in handles:
        try:
            worker.nixl_wrapper.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own types; a status error does not prove the DMA stopped
            logger.warning(
                "kvpilot %s: could not release a NIXL read handle (%s); the read is left to finish", request_id, exc
            )
            return False
    worker._recving_transfers.pop(request_id, None)
    worker._recving_metadata.pop(request_id, None)
    getattr(worker, "_recv_failures", set()).discard(request_id)
    getattr(worker, "_pending_recv_notifs", {}).pop(request_id, None)
    drop_queued_reads(inner, {request_id})
    return True


def posted_read(inner: object, request_id: str) -> bool:
    """Whether the inner NIXL worker has a transfer of ``request_id`` in its books."""
    worker = _nixl_worker(inner)
    return worker is not None and request_id in worker._recving_transfers


def drop_queued_reads(inner: object, request_ids: Collection[str]) -> None:
    """Remove reads of ``request_ids`` queued behind a handshake (not posted yet)."""
    worker = _nixl_worker(inner)
    ready = getattr(worker, "_ready_requests", None)
    if not request_ids or not isinstance(ready, queue.Queue):
        return
    kept = []
    while True:
        try:
            entry = ready.get_nowait()
        except queue.Empty:
            break
        if entry[0] not in request_ids:
            kept.append(entry)
    for entry in kept:
        ready.put(entry)
