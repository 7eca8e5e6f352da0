"""The one error of the router's config: :class:`ConfigError`, naming the key by its dotted path."""

from __future__ import annotations

from kvpilot.policies.typed_config import TypedConfigError


class ConfigError(TypedConfigError):
    """A router config value or key is wrong: ``key`` names it by its dotted path
    (``cost.router_seed``, ``workers[0].url``), ``problem`` says what is wrong."""

    ROOT_KEY = "top level"
