"""The typed configuration of ``KVPilotConnector``, parsed once from
``kv_transfer_config.kv_connector_extra_config``.

A drop-in for ``NixlConnector``: swap the connector's name and keep its keys::

    --kv-transfer-config '{"kv_connector": "KVPilotConnector", "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": true,
                                      "decoder_kv_blocks_ttl": 480}}'

Keys the inner connector reads (:data:`INNER_KEYS`) may stand at the top level or
inside ``inner_extra_config`` (the explicit form; both at once is an error). Then
kvpilot's own keys:

* ``inner_connector``: the vLLM connector that moves the bytes (default ``NixlConnector``).
* ``recompute_policy``: ``"roofline"`` (the default) lets
  :class:`policies.RecomputeVsTransferPolicy` decide each pull of a peer's KV
  (a D->P session pull) from live inputs; ``"threshold"`` keeps vLLM's fixed
  ``kv_recompute_threshold``. Giving ``kv_recompute_threshold`` pins
  ``"threshold"`` unless ``recompute_policy`` says otherwise.
* ``peer_retry_after_s`` (default 30): after a pull from a peer fails, that peer's
  offers are prefilled locally for this long instead of paying another failed
  handshake.
* ``policy_hardware``, ``policy_model``, ``policy_link``: preset names
  (:mod:`policies.presets`) overriding what the policy derives from the engine's
  own config; ``policy_link`` is the prior used until this engine has measured
  its own NIXL transfers.

Pure: no vLLM import. Whether ``inner_connector`` names a connector vLLM knows is
checked where the registry is at hand (:mod:`kvconnectors.connector`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from kvconnectors.pull_policy import PEER_RETRY_AFTER_S

EXTRA_CONFIG = "kv_connector_extra_config"

# Connectors that cannot sit inside KVPilotConnector: itself, and wrappers whose
# children would bypass the verification.
_FORBIDDEN_INNER = frozenset({"KVPilotConnector", "MultiConnector"})
DEFAULT_INNER_CONNECTOR = "NixlConnector"

NIXL_KEYS = frozenset(
    {
        "backends",
        "bidirectional_kv_xfer",
        "decoder_kv_blocks_ttl",
        "enforce_handshake_compat",
        "engine_ttl",
        "kv_lease_duration",
        "kv_recompute_threshold",
        "num_threads",
        "push_registration_timeout",
    }
)
"""Every ``kv_connector_extra_config`` key vLLM 0.32's NIXL connectors read
(``get_from_extra_config`` in ``kv_connector/v1/nixl/``)."""

INNER_KEYS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "NixlConnector": NIXL_KEYS,
        "NixlPullConnector": NIXL_KEYS,
        "NixlPushConnector": NIXL_KEYS,
    }
)
"""Per inner connector, the keys accepted at the top level. Another inner connector
takes its keys through ``inner_extra_config`` only."""

RECOMPUTE_THRESHOLD_KEY = "kv_recompute_threshold"
RecomputePolicyName = Literal["roofline", "threshold"]
_OWN_STR_KEYS = ("policy_hardware", "policy_model", "policy_link")


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
    """The inner connector's own ``kv_connector_extra_config``, as the user gave it
    (top-level inner keys merged in). :meth:`inner_config_for_vllm` is what it gets."""

    recompute_policy: RecomputePolicyName = "roofline"
    policy_hardware: str | None = None
    policy_model: str | None = None
    policy_link: str | None = None
    peer_retry_after_s: float = PEER_RETRY_AFTER_S

    def inner_config_for_vllm(self) -> dict[str, Any]:
        """What the inner connector is built with. Under the roofline policy its fixed
        ``kv_recompute_threshold`` is switched off (0): kvpilot decides before it."""
        inner = dict(self.inner_extra_config)
        if self.recompute_policy == "roofline" and self.inner_connector in INNER_KEYS:
            inner[RECOMPUTE_THRESHOLD_KEY] = 0
        return inner

    @classmethod
    def parse(cls, raw: object) -> KVPilotConfig:
        """Parse and validate ``raw`` (the extra-config dict; ``None`` means defaults).

        Raises :class:`KVPilotConfigError` naming the first bad key.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise KVPilotConfigError("<root>", f"expected a JSON object, got {type(raw).__name__}")
        inner = raw.get("inner_connector", DEFAULT_INNER_CONNECTOR)
        if not isinstance(inner, str) or not inner:
            raise KVPilotConfigError("inner_connector", f"expected a connector name, got {inner!r}")
        if inner in _FORBIDDEN_INNER:
            raise KVPilotConfigError("inner_connector", f"{inner} cannot be wrapped by KVPilotConnector")
        inner_keys = INNER_KEYS.get(inner, frozenset())
        own = {"inner_connector", "inner_extra_config", "recompute_policy", "peer_retry_after_s", *_OWN_STR_KEYS}
        for key in raw:
            if key not in own and key not in inner_keys:
                known = ", ".join(sorted(own | inner_keys))
                raise KVPilotConfigError(str(key), f"unknown key (known keys: {known})")
        explicit = raw.get("inner_extra_config", {})
        if not isinstance(explicit, Mapping):
            raise KVPilotConfigError("inner_extra_config", f"expected a JSON object, got {type(explicit).__name__}")
        merged = dict(explicit)
        for key in inner_keys & raw.keys():
            if key in explicit:
                raise KVPilotConfigError(key, "given both at the top level and in inner_extra_config")
            merged[key] = raw[key]
        policy = raw.get("recompute_policy", "threshold" if RECOMPUTE_THRESHOLD_KEY in merged else "roofline")
        if policy not in ("roofline", "threshold"):
            raise KVPilotConfigError("recompute_policy", f"expected 'roofline' or 'threshold', got {policy!r}")
        names: dict[str, str | None] = {}
        for key in _OWN_STR_KEYS:
            value = raw.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise KVPilotConfigError(key, f"expected a preset name, got {value!r}")
            names[key] = value
        _check_presets(names)
        retry = raw.get("peer_retry_after_s", PEER_RETRY_AFTER_S)
        if isinstance(retry, bool) or not isinstance(retry, int | float) or not retry > 0 or retry == float("inf"):
            raise KVPilotConfigError("peer_retry_after_s", f"expected a positive number of seconds, got {retry!r}")
        return cls(
            inner_connector=inner,
            inner_extra_config=MappingProxyType(merged),
            recompute_policy=policy,
            peer_retry_after_s=float(retry),
            **names,
        )


def _check_presets(names: Mapping[str, str | None]) -> None:
    from policies.presets import hardware_preset, link_preset, model_preset
    from policies.specs import SpecError

    for key, lookup in (
        ("policy_hardware", hardware_preset),
        ("policy_model", model_preset),
        ("policy_link", link_preset),
    ):
        name = names[key]
        if name is not None:
            try:
                lookup(name)
            except SpecError as exc:
                raise KVPilotConfigError(key, str(exc)) from None
