"""Fixtures shared by the unit and component tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.deploy.tiny_model import ensure_tiny_model
from tests.fakes.engine import word_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory the router can read with no model in it: the fake engine's
    word-level tokenizer and chat template (:func:`tests.fakes.engine.word_model_dir`).
    One per module, so that a module may write its router.yaml beside it."""
    return word_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The project's tiny model (:mod:`kvpilot.deploy.tiny_model`), for tests that build a real
    vLLM config: built locally on first use and cached (``$KVPILOT_CACHE`` or
    ``~/.cache/kvpilot``), never downloaded."""
    return ensure_tiny_model()
