"""The ``cost`` section: Dynamo's cost parameters plus kvpilot's own, and what is minimized."""

from __future__ import annotations

import enum

import msgspec

from kvpilot.policies.presets import link_preset
from kvpilot.policies.specs import SpecError
from kvpilot.policies.typed_config import TypedConfig, check_range
from kvpilot.routing.config.errors import ConfigError


class CostObjective(str, enum.Enum):
    """What the router minimizes over its candidates (``cost.objective``)."""

    BLOCKS = "blocks"
    """Dynamo's cost in blocks (:mod:`kvpilot.routing.decide.cost`'s formula): the default."""
    PREDICTED_TTFT = "predicted_ttft"
    """Each candidate's predicted TTFT from the measured rates
    (:func:`kvpilot.routing.decide.rates.predict_ttft`: the prefill queue ahead, the prefill of its
    uncached tokens, the KV read for a pair, the first decode step beside the worker's
    running streams). Needs ``disaggregation.measured_rates``."""


class CostConfig(TypedConfig, frozen=True):
    """Dynamo's cost parameters (same names, same defaults) plus session affinity, and
    what is minimized (``objective``)."""

    error_type = ConfigError

    overlap_score_credit: float = 1.0
    """Blocks of credit per block of the prompt the candidate holds in GPU."""
    overlap_score_credit_decay: float = 0.0
    """The GPU credit is divided by ``1 + decay x`` the candidate's active prefill blocks, so a
    cache-rich but busy worker stops winning every hot prefix; 0: no decay (Dynamo's default)."""
    host_cache_hit_weight: float = 0.75
    """Credit per prompt block held in host memory (a ``host`` tier) beyond the GPU prefix
    (Dynamo's preset; see ``host_restore_link``)."""
    disk_cache_hit_weight: float = 0.25
    """Credit per prompt block held on disk (a ``disk`` tier) beyond the GPU and host prefixes
    (Dynamo's preset; see ``disk_restore_link``)."""
    host_restore_link: str = ""
    """kvpilot's own: the link (a :mod:`kvpilot.policies.presets` name, ``pcie``) a worker
    restores its host tier over. Set, the host credit is what a block's restore saves against
    recomputing it, on the roofline of the prior's model, ``disaggregation.kv_format`` and
    ``d_hardware`` (:func:`kvpilot.policies.tier_credit.host_block_credit`; llama-8b on an
    H100 over PCIe: 0.96) in place of ``host_cache_hit_weight``; empty: that weight."""
    disk_restore_link: str = ""
    """The same for the ``disk`` tier (``nvme``) in place of ``disk_cache_hit_weight``."""
    shared_cache_multiplier: float = 0.5
    """Credit per prompt block in a ``shared`` tier (a cache every worker reads) beyond the rest."""
    prefill_load_scale: float = 1.0
    """The weight of the prefill term (the candidate's queued prefill blocks plus the prompt's
    uncredited blocks) against the decode term."""
    decode_active_request_weight: float = 0.0
    """Blocks added per request already running on the decode worker; 0: the term is off."""
    router_temperature: float = 0.0
    """0: the lowest cost wins (ties broken by the seeded RNG); above 0: a candidate is drawn
    with probability ``softmax(-normalized cost / temperature)``."""
    session_affinity_credit: float = 16.0
    """kvpilot's own: blocks of credit for the decode worker that served the session's last
    step (it holds the session's newest KV). A credit, never a pin."""
    session_residency_weight: float = 1.0
    """kvpilot's own: blocks added to a session's first step per block of the sessions living
    on the decode worker, and on a pair's prefill worker (each one's latest prompt, in flight
    or between steps: :mod:`kvpilot.routing.decide.residency`), so the first step is placed
    for the later ones; 0: the term is off (Dynamo counts the unique blocks of requests in
    flight)."""
    session_stays_unless_sooner: bool = True
    """kvpilot's own: a session's later step stays on the decode worker that served its last
    step unless another candidate would start it sooner (less prefill queued plus
    uncached; with ``objective: predicted_ttft``, a lower predicted TTFT:
    :func:`kvpilot.routing.decide.cost.eligible`); false: Dynamo's cost decides, the affinity
    credit aside. Not applied where decode workers never prefill (prefill workers and
    ``disaggregation.max_local_tokens: 0``, as beside Dynamo): the history a step reuses is
    then P's, which the pair's prefix overlap already credits, and D is free to follow load."""
    router_seed: int = 0
    """The seed of the RNG that breaks ties and samples (decisions repeat run to run)."""
    pair_failure_cost_blocks: float = 32.0
    """kvpilot's own (``kvpilot.routing.health.pair_health``): blocks added to a (P, D) pair's cost per
    recent transfer failure or expired lease, halved every ``pair_failure_half_life_s``."""
    pair_failure_half_life_s: float = 60.0
    """How fast a (P, D) pair's failure penalty fades: halved every this many seconds."""
    pair_transfer_cost_blocks_per_s: float = 64.0
    """Blocks added per second of the pair's mean NIXL transfer time."""
    objective: CostObjective = CostObjective.BLOCKS
    """What is minimized: ``blocks``, Dynamo's cost above; ``predicted_ttft``, each
    candidate's predicted TTFT from the measured rates (needs ``disaggregation.measured_rates``)."""

    def __post_init__(self) -> None:
        weights = (
            f.name
            for f in msgspec.structs.fields(self)
            if f.name
            not in ("router_seed", "objective", "session_stays_unless_sooner", "host_restore_link", "disk_restore_link")
        )
        check_range(self, *weights, at_least=0)
        check_range(self, "pair_failure_half_life_s", above=0)
        for key in ("host_restore_link", "disk_restore_link"):
            if getattr(self, key):
                try:
                    link_preset(getattr(self, key))
                except SpecError as exc:
                    raise ConfigError(key, str(exc)) from None
