"""Secrets named, never stored, by the config (``*_env`` keys): :func:`read_secret`."""

from __future__ import annotations

import os
from pathlib import Path

from kvpilot.routing.config.errors import ConfigError

SECRET_FILE_SUFFIX = "_FILE"


def read_secret(env_name: str, key: str) -> str | None:
    """The secret a ``*_env`` key names: the variable ``env_name``'s value, or, when
    ``<env_name>_FILE`` is set instead, the contents of that file less surrounding
    whitespace (a mounted Kubernetes or Docker secret). ``None`` when ``env_name`` is
    ``""`` (no secret configured). Raises :class:`ConfigError` naming ``key`` and the
    variable (never the value) when the secret is unset, empty or its file unreadable."""
    if not env_name:
        return None
    path = os.environ.get(env_name + SECRET_FILE_SUFFIX, "")
    if path and env_name in os.environ:
        raise ConfigError(key, f"set {env_name} or {env_name}{SECRET_FILE_SUFFIX}, not both")
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(key, f"{env_name}{SECRET_FILE_SUFFIX}: cannot read {path}: {exc.strerror}") from None
    else:
        value = os.environ.get(env_name, "")
    if not value:
        unset = f"names {env_name!r}, which is unset or empty (and {env_name}{SECRET_FILE_SUFFIX} is unset)"
        raise ConfigError(key, unset)
    return value
