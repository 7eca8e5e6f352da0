"""Keep the engine thread's CPU binding across the inner connector's construction.

vLLM 0.32's NIXL worker, on the CPU platform, pins the thread that constructs it to
the last core of each NUMA node, to keep KV transfers off the compute cores
(vllm#32365). That thread is the worker's main thread, and it also runs the model:
an engine bound to its own core (``VLLM_CPU_OMP_THREADS_BIND``) has its compute moved
to the box's last core, beside every other engine moved there and beside the
transfer threads it was meant to avoid. On a 2-core box the prefill engine's
compute and the decode engine's compute and NIXL progress thread all shared core 1.

Threads the inner connector starts while it is built keep the binding it gave them;
only the constructing thread gets its own binding back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("kvpilot.connector")


@contextmanager
def keeping_thread_binding() -> Iterator[None]:
    """Restore the calling thread's CPU affinity on exit if the body changed it."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux: nothing was bound
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            logger.warning(
                "kvpilot: the inner connector moved this engine thread to cores %s; restored to %s",
                sorted(after),
                sorted(before),
            )
