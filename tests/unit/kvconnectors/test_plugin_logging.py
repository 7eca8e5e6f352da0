"""kvpilot's loggers print through vLLM's handler, at vLLM's level."""

from __future__ import annotations

import logging

import pytest

from kvpilot.kvconnectors.plugin import log_like_vllm


def test_kvpilot_logs_where_vllm_logs_and_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = logging.getLogger("kvpilot"), logging.getLogger("vllm")
    handler = logging.StreamHandler()
    monkeypatch.setattr(theirs, "handlers", [handler])  # as vLLM's logging config leaves it
    monkeypatch.setattr(theirs, "level", logging.INFO)
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    log_like_vllm()
    log_like_vllm()  # vLLM may load general plugins twice in one process
    assert ours.handlers == [handler] and ours.propagate
    assert logging.getLogger("kvpilot.connector").getEffectiveLevel() == logging.INFO


def test_a_process_without_vllms_handler_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = logging.getLogger("kvpilot")
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    monkeypatch.setattr(ours, "handlers", [])
    log_like_vllm()
    assert ours.handlers == []
