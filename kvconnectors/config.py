"""The typed configuration of ``KVPilotConnector``, parsed once from
``kv_transfer_config.kv_connector_extra_config``.

A drop-in for ``NixlConnector``: swap the connector's name and keep its keys::

    --kv-transfer-config '{"kv_connector": "KVPilotConnector", "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": true,
                                      "decoder_kv_blocks_ttl": 480}}'

Keys the inner connector reads (:data:`INNER_KEYS`) may stand at the top level or
inside ``inner_extra_config`` (the explicit form; both at once is an error). kvpilot's
own keys are the fields of :class:`KVPilotConfig`, each documented under it (the
generated reference lists them: ``docs/reference/connector-config.md``).

Pure: no vLLM import. Whether ``inner_connector`` names a connector vLLM knows is
checked where the registry is at hand (:mod:`kvpilot.kvconnectors.connector`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any

import msgspec

from kvpilot.kvconnectors.faults import FaultInjection
from kvpilot.kvconnectors.pull_policy import PEER_RETRY_AFTER_S, RecomputePolicy
from kvpilot.kvconnectors.read_deadline import READ_DEADLINE_FACTOR, READ_DEADLINE_FLOOR_S, DeadlineRule
from kvpilot.policies.typed_config import TypedConfig, TypedConfigError, check_range, convert

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
        "ucx_backend_params",
    }
)
"""Every ``kv_connector_extra_config`` key vLLM 0.32-0.34's NIXL connectors read
(``get_from_extra_config`` in ``kv_connector/v1/nixl/``; ``ucx_backend_params`` from
0.34, which earlier versions ignore). :mod:`kvpilot.kvconnectors.vllm_contract` reports
a key a checked vLLM reads that is missing here."""

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


class KVPilotConfigError(TypedConfigError):
    """A bad ``kv_connector_extra_config``; ``key`` names the offending key."""

    PREFIX = f"KVPilotConnector: {EXTRA_CONFIG}."


PresetName = Annotated[str, msgspec.Meta(min_length=1)]


class KVPilotConfig(TypedConfig, frozen=True):
    """What ``KVPilotConnector`` reads from its extra config. Unknown keys are errors."""

    error_type = KVPilotConfigError

    inner_connector: Annotated[str, msgspec.Meta(min_length=1)] = DEFAULT_INNER_CONNECTOR
    """Name of the vLLM connector that moves the bytes (registered in vLLM's factory)."""

    inner_extra_config: Mapping[str, Any] = msgspec.field(default_factory=lambda: MappingProxyType({}))
    """The inner connector's own ``kv_connector_extra_config``, as the user gave it
    (top-level inner keys merged in). :meth:`inner_config_for_vllm` is what it gets."""

    recompute_policy: RecomputePolicy = RecomputePolicy.ROOFLINE
    """Who decides whether a verified span of a peer's KV is pulled or recomputed: ``roofline``,
    the live pull policy (this engine's backlog, measured link and prefill rate); ``threshold``,
    the inner connector's fixed ``kv_recompute_threshold`` (implied when that key is given)."""
    policy_hardware: PresetName | None = None
    """The pull policy's hardware (a ``kvpilot.policies.presets`` name), pricing recomputing until this
    engine has timed its own steps; null: the engine's own (its bound CPU cores, or its GPU
    times the tensor-parallel size)."""
    policy_model: PresetName | None = None
    """The pull policy's prior model (a preset name); null: the served model's ``config.json``."""
    policy_link: PresetName | None = None
    """The pull policy's KV link prior (a preset name) until this engine has measured its own
    NIXL transfers; null: ``loopback`` on a CPU box, ``rdma`` on GPUs."""
    peer_retry_after_s: float = PEER_RETRY_AFTER_S
    """After a pull from a peer fails, that peer's offers are prefilled locally for this long
    instead of paying another failed handshake."""
    kv_digest: bool = True
    """Digest every offered block's KV bytes (all layers, every KV-cache group) on the holder,
    and check what a read brought against it before attaching: a block that differs is a
    failed load (recomputed from the first bad block under ``kv_load_failure_policy:
    recompute``). Off: offers carry no digests and reads are attached on the token check alone."""
    read_deadline_floor_s: float = READ_DEADLINE_FLOOR_S
    """The least time a read of a peer's KV is given before it is abandoned (its blocks then
    fail to load): the bound is ``max(floor, bytes / measured link rate * read_deadline_factor)``."""
    read_deadline_factor: float = READ_DEADLINE_FACTOR
    """How many times its size over the measured link rate a read may take before it is abandoned."""
    fault_injection: FaultInjection | None = None
    """Testing only: faults injected into this engine's reads: ``request_ids`` (a request id part
    -> its fault: ``corrupt_block``, ``reused_block``, ``stall_read``, ``drop_completion``), else
    at ``rate`` one of ``kinds``; ``stall_s``, ``seed``. Refused unless ``allow_fault_injection``
    is true."""
    allow_fault_injection: bool = False
    """The explicit permission ``fault_injection`` needs; without it a config that carries one is refused."""

    def __post_init__(self) -> None:
        if self.inner_connector in _FORBIDDEN_INNER:
            problem = f"{self.inner_connector} cannot be wrapped by KVPilotConnector"
            raise KVPilotConfigError("inner_connector", problem)
        check_range(self, "peer_retry_after_s", above=0)
        check_range(self, "read_deadline_floor_s", above=0)
        check_range(self, "read_deadline_factor", above=0)
        if self.fault_injection is not None and self.fault_injection.rate and not self.fault_injection.kinds:
            raise KVPilotConfigError("fault_injection.kinds", "a fault rate needs at least one kind")
        if self.fault_injection is not None and not self.allow_fault_injection:
            problem = "injects faults into reads; set allow_fault_injection: true beside it (never in production)"
            raise KVPilotConfigError("fault_injection", problem)
        _check_presets({key: getattr(self, key) for key in _PRESET_KEYS})
        msgspec.structs.force_setattr(self, "inner_extra_config", MappingProxyType(dict(self.inner_extra_config)))

    def deadline_rule(self) -> DeadlineRule:
        """The bound on each read, from ``read_deadline_floor_s`` and ``read_deadline_factor``."""
        return DeadlineRule(self.read_deadline_floor_s, self.read_deadline_factor)

    def inner_config_for_vllm(self) -> dict[str, Any]:
        """What the inner connector is built with. Under the roofline policy its fixed
        ``kv_recompute_threshold`` is switched off (0): kvpilot decides before it."""
        inner = dict(self.inner_extra_config)
        if self.recompute_policy is RecomputePolicy.ROOFLINE and self.inner_connector in INNER_KEYS:
            inner[RECOMPUTE_THRESHOLD_KEY] = 0
        return inner

    @classmethod
    def parse(cls, raw: object) -> KVPilotConfig:
        """Parse and validate ``raw`` (the extra-config dict; ``None`` means defaults):
        the inner connector's keys merged into ``inner_extra_config``, then
        :func:`kvpilot.policies.typed_config.convert` against this class's types and checks.

        The top-level keys are checked here, not by msgspec: which inner keys may
        stand there depends on ``inner_connector``, and the message lists both kinds.
        Raises :class:`KVPilotConfigError` naming the first bad key.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise KVPilotConfigError(KVPilotConfigError.ROOT_KEY, f"expected a JSON object, got {type(raw).__name__}")
        own = {key: raw[key] for key in _OWN_KEYS & raw.keys()}
        inner = own.get("inner_connector", DEFAULT_INNER_CONNECTOR)
        inner_keys = INNER_KEYS.get(inner, frozenset()) if isinstance(inner, str) else frozenset()
        for key in raw:
            if key not in _OWN_KEYS and key not in inner_keys:
                known = ", ".join(sorted(_OWN_KEYS | inner_keys))
                raise KVPilotConfigError(str(key), f"unknown key (known keys: {known})")
        explicit = own.get("inner_extra_config", {})
        if isinstance(explicit, Mapping):
            merged = dict(explicit)
            for key in inner_keys & raw.keys():
                if key in explicit:
                    raise KVPilotConfigError(key, "given both at the top level and in inner_extra_config")
                merged[key] = raw[key]
            own["inner_extra_config"] = merged
            implied = RecomputePolicy.THRESHOLD if RECOMPUTE_THRESHOLD_KEY in merged else RecomputePolicy.ROOFLINE
            own.setdefault("recompute_policy", implied.value)
        return convert(own, cls)


_OWN_KEYS = frozenset(f.name for f in msgspec.structs.fields(KVPilotConfig))
_PRESET_KEYS = ("policy_hardware", "policy_model", "policy_link")


def _check_presets(names: Mapping[str, str | None]) -> None:
    from kvpilot.policies.presets import hardware_preset, link_preset, model_preset
    from kvpilot.policies.specs import SpecError

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
