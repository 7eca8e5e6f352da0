"""Keep the data plane's busy-polling threads from starving a CPU engine's compute.

NIXL's UCX backend starts a progress thread that calls ``ucp_worker_progress`` in a
loop (over TCP it never sleeps: ``epoll_wait`` with a zero timeout), so every
engine spins one core even when idle. On a GPU host that is one core of many; on a
CPU box the same cores run the model, and two engines on two cores stall each other
for minutes. vLLM builds the NIXL agent itself and does not expose NIXL's
``enable_prog_thread``, so kvpilot lowers the scheduling priority of the threads
that the inner connector's construction started (Linux: ``setpriority`` on a thread
id affects that thread only): they still run whenever a core is free, and yield it
to the forward pass when it is not.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("kvpilot.connector")
_T = TypeVar("_T")


def thread_ids() -> set[int]:
    """This process's thread ids (empty where ``/proc`` is unavailable)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def start_with_niceness(build: Callable[[], _T], niceness: int) -> _T:
    """Call ``build`` and give every thread it started ``niceness`` (0 leaves them be).

    A thread that ended meanwhile, or a refused change, is skipped with a debug log:
    priority is an optimisation, never a reason to fail the engine.
    """
    before = thread_ids()
    built = build()
    if niceness:
        started = sorted(thread_ids() - before)
        for tid in started:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except OSError as exc:
                logger.debug("kvpilot: could not renice thread %d: %s", tid, exc)
        logger.info("kvpilot: %d data-plane threads run at niceness %d", len(started), niceness)
    return built
