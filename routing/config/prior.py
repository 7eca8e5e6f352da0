"""The model the roofline prior prices (:func:`prior_model`), from a preset or the served
model's ``config.json``; it reads that file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvpilot.policies.presets import model_from_mapping, model_preset
from kvpilot.policies.specs import ModelSpec, SpecError
from kvpilot.routing.config.errors import ConfigError
from kvpilot.routing.config.root import RouterConfig

log = logging.getLogger(__name__)

FALLBACK_MODEL_PRESET = "llama-8b"
"""The prior's model for a router whose ``server.model_dir`` holds no ``config.json`` and
that names no ``disaggregation.model_preset``."""


def prior_model(config: RouterConfig) -> ModelSpec:
    """The model the roofline prior prices (see ``disaggregation.model_preset``): the named
    preset, else the served model's ``config.json`` in ``server.model_dir``, else (none
    there: a tokenizer-only directory, or no directory) :data:`FALLBACK_MODEL_PRESET`, with
    a warning. Raises :class:`ConfigError` naming the key for an unknown preset or a
    ``config.json`` that is unreadable or lacks a field the roofline needs."""
    cfg = config.disaggregation
    path = Path(config.server.model_dir) / "config.json" if config.server.model_dir else None
    if not cfg.model_preset and path is not None and path.is_file():
        try:
            return model_from_mapping(json.loads(path.read_text()), str(path))
        except (OSError, ValueError, SpecError) as exc:
            raise ConfigError("server.model_dir", f"the prior's model comes from {path}: {exc}") from None
    if not cfg.model_preset:
        log.warning(
            "no model config.json in server.model_dir (%r): the roofline prior prices %s until rates are measured",
            config.server.model_dir,
            FALLBACK_MODEL_PRESET,
        )
    try:
        return model_preset(cfg.model_preset or FALLBACK_MODEL_PRESET)
    except SpecError as exc:
        raise ConfigError("disaggregation.model_preset", str(exc)) from None
