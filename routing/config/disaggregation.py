"""The ``disaggregation`` section: local or remote prefill per request, and the roofline prior's presets."""

from __future__ import annotations

from kvpilot.policies.disaggregation import LocalPrefillConfig
from kvpilot.policies.typed_config import check_range
from kvpilot.routing.config.errors import ConfigError


class DisaggregationConfig(LocalPrefillConfig, frozen=True):
    """The policy's own :class:`~kvpilot.policies.disaggregation.LocalPrefillConfig` (one type:
    the router hands this section to the policy as it is) plus the preset names it
    costs with. Its defaults are kvpilot's (:data:`~kvpilot.policies.disaggregation.KVPILOT_DEFAULT`),
    not Dynamo's (:data:`~kvpilot.policies.disaggregation.DYNAMO_DEFAULT`): the decode-busy guard at
    90% of D's KV, and the cost checks (the stall budget on D's running streams, local only
    when cheaper than remote), priced from the measured rates."""

    error_type = ConfigError

    decode_busy_kv_usage: float | None = 0.9
    """D's KV usage (the larger of the router's ledger over ``kv_blocks`` and D's own gauge)
    at or above which a local prefill on D is out; null: no guard."""
    compare_costs: bool = True
    """Also require a local prefill to stall D's running streams at most ``max_stall_s``
    and to be cheaper than the remote one (false: Dynamo's length and share rules alone)."""
    model_preset: str = ""
    """The model the roofline prior prices: ``""``, the served model's own ``config.json`` in
    ``server.model_dir`` (:func:`prior_model`); a :mod:`kvpilot.policies.presets` name overrides it."""
    p_hardware: str = "h100"
    """The prefill workers' hardware for the roofline prior (a :mod:`kvpilot.policies.presets` name),
    until measured rates replace it."""
    d_hardware: str = "h100"
    """The decode workers' hardware for the prior, likewise."""
    link_preset: str = "rdma"
    """The KV link between P and D for the prior (a :mod:`kvpilot.policies.presets` link name)."""
    kv_format: str = "bf16"
    """The KV cache's element format for the prior (a :mod:`kvpilot.policies.presets` format name)."""
    measured_rates: bool = True
    """True (the default): the local-vs-remote verdict and the session options are priced
    with the measured rates (:mod:`kvpilot.routing.decide.rates`) where they exist, the roofline
    prior otherwise; False: the roofline of the presets alone."""

    def __post_init__(self) -> None:
        check_range(self, "max_stall_s", "max_local_tokens", "max_local_fraction", "decode_busy_kv_usage", at_least=0)
