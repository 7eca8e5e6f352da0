"""The agent benchmark's progress: a log line with the time (:func:`log`), a block's seconds
recorded in the run's timings (:func:`timed`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.agent.results import Run


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def timed(run: Run, what: str) -> Iterator[None]:
    """Record the seconds the block took as ``run.timings[what]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        run.timings[what] = time.perf_counter() - started
