"""The typed configuration of ``KVPilotConnector``, parsed once from
``kv_transfer_config.kv_connector_extra_config``.

Example::

    --kv-transfer-config '{"kv_connector": "KVPilotConnector", "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "inner_connector": "NixlConnector",
            "inner_extra_config": {"kv_recompute_threshold": 64}}}'

Pure: no vLLM import. Whether ``inner_connector`` names a connector vLLM knows is
checked where the registry is at hand (:mod:`kvconnectors.connector`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

EXTRA_CONFIG = "kv_connector_extra_config"

# Connectors that cannot sit inside KVPilotConnector: itself, and wrappers whose
# children would bypass the verification.
_FORBIDDEN_INNER = frozenset({"KVPilotConnector", "MultiConnector"})
DEFAULT_INNER_CONNECTOR = "NixlConnector"


class KVPilotConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; ``key`` names the offending key."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"KVPilotConnector: {EXTRA_CONFIG}.{key}: {problem}")


@dataclass(frozen=True, slots=True)
class KVPilotConfig:
    """What ``KVPilotConnector`` reads from its extra config. Unknown keys are errors."""

    inner_connector: str = DEFAULT_INNER_CONNECTOR
    """Name of the vLLM connector that moves the bytes (registered in vLLM's factory)."""

    inner_extra_config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Passed verbatim as the inner connector's own ``kv_connector_extra_config``."""

    @classmethod
    def parse(cls, raw: object) -> KVPilotConfig:
        """Parse and validate ``raw`` (the extra-config dict; ``None`` means defaults).

        Raises :class:`KVPilotConfigError` naming the first bad key.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise KVPilotConfigError("<root>", f"expected a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise KVPilotConfigError(str(key), f"unknown key (known keys: {', '.join(sorted(known))})")
        inner = raw.get("inner_connector", DEFAULT_INNER_CONNECTOR)
        if not isinstance(inner, str) or not inner:
            raise KVPilotConfigError("inner_connector", f"expected a connector name, got {inner!r}")
        if inner in _FORBIDDEN_INNER:
            raise KVPilotConfigError("inner_connector", f"{inner} cannot be wrapped by KVPilotConnector")
        inner_extra = raw.get("inner_extra_config", {})
        if not isinstance(inner_extra, Mapping):
            raise KVPilotConfigError(
                "inner_extra_config", f"expected a JSON object, got {type(inner_extra).__name__}"
            )
        return cls(inner_connector=inner, inner_extra_config=MappingProxyType(dict(inner_extra)))
