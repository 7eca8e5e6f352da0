"""What the router builds from its config: the local-vs-remote policy
(:func:`policy_from_config`) and the ``cost`` section as it applies to a fleet
(:func:`effective_cost`). Raises :class:`~kvpilot.routing.config.ConfigError` naming the
section for an unknown preset."""

from __future__ import annotations

import msgspec

from kvpilot.policies.disaggregation import LocalVsRemotePolicy
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset
from kvpilot.policies.specs import ModelSpec, SpecError
from kvpilot.policies.tier_credit import host_block_credit
from kvpilot.routing.config import ConfigError, CostConfig, DisaggregationConfig, RouterConfig, prior_model
from kvpilot.routing.fleet import Fleet


def policy_from_config(cfg: DisaggregationConfig, model: ModelSpec) -> LocalVsRemotePolicy:
    """The local-vs-remote policy the ``disaggregation`` section describes, pricing
    ``model`` (:func:`kvpilot.routing.config.prior_model`).

    Raises :class:`ConfigError` naming the field for an unknown preset.
    """
    try:
        return LocalVsRemotePolicy(
            model,
            kv_format_preset(cfg.kv_format),
            hardware_preset(cfg.p_hardware),
            hardware_preset(cfg.d_hardware),
            link_preset(cfg.link_preset),
            cfg,
        )
    except SpecError as exc:
        raise ConfigError("disaggregation", str(exc)) from None


def effective_cost(config: RouterConfig, fleet: Fleet) -> CostConfig:
    """The ``cost`` section as it applies to ``fleet``: ``session_stays_unless_sooner`` off
    where decode workers never prefill (its docstring), and a tier with a restore link
    credited by what its restore saves (``host_restore_link``, ``disk_restore_link``)."""
    cost = config.cost
    never_local = bool(fleet.prefill) and config.disaggregation.max_local_tokens == 0
    if never_local and cost.session_stays_unless_sooner:
        cost = msgspec.structs.replace(cost, session_stays_unless_sooner=False)
    links = {"host_cache_hit_weight": cost.host_restore_link, "disk_cache_hit_weight": cost.disk_restore_link}
    if any(links.values()):
        model, cfg = prior_model(config), config.disaggregation
        try:
            fmt, hw = kv_format_preset(cfg.kv_format), hardware_preset(cfg.d_hardware)
        except SpecError as exc:
            raise ConfigError("disaggregation", str(exc)) from None
        credits = {
            weight: host_block_credit(model, fmt, hw, link_preset(link), config.index.block_size)
            for weight, link in links.items()
            if link
        }
        cost = msgspec.structs.replace(cost, **credits)
    return cost
