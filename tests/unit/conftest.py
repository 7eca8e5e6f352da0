"""Fixtures any unit or component test may use."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The project's tiny model (:mod:`deploy.tiny_model`): built locally on first use
    and cached (``$KVPILOT_CACHE`` or ``~/.cache/kvpilot``), never downloaded."""
    return ensure_tiny_model()
