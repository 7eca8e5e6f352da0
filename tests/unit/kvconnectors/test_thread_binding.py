"""The engine thread keeps its CPU binding across the inner connector's construction."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from kvpilot.kvconnectors.thread_binding import keeping_thread_binding

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to move between"
)


def _in_a_thread(body) -> object:
    """Run ``body`` in a fresh thread (its affinity changes stay out of pytest's) and return its result."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(body()))
    thread.start()
    thread.join()
    return result[0]


def test_a_thread_moved_inside_gets_its_cores_back(caplog: pytest.LogCaptureFixture) -> None:
    def body() -> tuple[set[int], set[int]]:
        before = os.sched_getaffinity(0)
        with keeping_thread_binding():
            os.sched_setaffinity(0, {max(before)})  # what vLLM's NIXL worker does on CPU
        return before, os.sched_getaffinity(0)

    with caplog.at_level(logging.WARNING, logger="kvpilot.connector"):
        before, after = _in_a_thread(body)
    assert after == before
    assert "restored to" in caplog.text


def test_a_thread_left_alone_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    def body() -> tuple[set[int], set[int]]:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        before = os.sched_getaffinity(0)
        with keeping_thread_binding():
            pass
        return before, os.sched_getaffinity(0)

    with caplog.at_level(logging.WARNING, logger="kvpilot.connector"):
        before, after = _in_a_thread(body)
    assert after == before and len(after) == 1
    assert caplog.text == ""


def test_threads_started_inside_keep_the_binding_they_were_given() -> None:
    """vLLM means the reserved core for the transfer threads the connector starts."""

    def body() -> tuple[set[int], set[int]]:
        reserved = {max(os.sched_getaffinity(0))}
        seen: list[set[int]] = []
        with keeping_thread_binding():
            os.sched_setaffinity(0, reserved)
            started = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            started.start()
            started.join()
        return seen[0], reserved

    seen, reserved = _in_a_thread(body)
    assert seen == reserved
