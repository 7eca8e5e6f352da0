"""The router's configuration: frozen, typed, parsed once (YAML, then CLI flags).

The ``cost`` section uses NVIDIA Dynamo's ``KvRouterConfig`` names and defaults
(read from ``ai-dynamo-runtime`` 1.6.1's ``dynamo/_core.pyi``), so a Dynamo user can
paste them. Every key is a field of the structs below, documented under it; the
generated reference (``docs/reference/router-config.md``, ``kvpilot docs reference``)
lists them all with type, default and unit. A minimal 1 P + 1 D file::

    server: {model_dir: /path/to/model, model_name: tiny}
    workers:
      - {name: prefill-0, role: prefill, url: "http://127.0.0.1:8100",
         kv_events_endpoint: "tcp://127.0.0.1:5700", replay_endpoint: "tcp://127.0.0.1:5800"}
      - {name: decode-0, role: decode, url: "http://127.0.0.1:8101",
         kv_events_endpoint: "tcp://127.0.0.1:5701", replay_endpoint: "tcp://127.0.0.1:5801"}

Every scalar leaf outside ``workers`` also has a flag named by its key
(:mod:`kvpilot.routing.config_load`: ``--cost-overlap-score-credit 0.5``, ``--disaggregation-compare-costs
true``, ``--disaggregation-max-local-tokens none``, ``--index-backend dynamo``: an enum
leaf's flag takes only its values); flags override YAML, YAML overrides defaults.
:func:`kvpilot.policies.typed_config.convert` (the one converter, shared with
``kvconnectors/config.py`` and ``policies/presets.py``) turns the merged mapping into
these frozen structs, running each section's own range checks; an unknown key is a
:class:`ConfigError` naming its path (``cost.overlap_score_credt``), and so is a value
of the wrong type (``cost.router_seed: Expected `int`, got `float```), outside its
enum (``index.backend``, ``index.tiers.GPU``, ``sessions.force_option``,
``sessions.store``, a worker's ``role``) or out of range.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from urllib.parse import urlsplit

import msgspec

from kvpilot.policies.disaggregation import LocalPrefillConfig
from kvpilot.policies.presets import link_preset, model_from_mapping, model_preset
from kvpilot.policies.session_options import Option
from kvpilot.policies.specs import ModelSpec, SpecError
from kvpilot.policies.typed_config import TypedConfig, TypedConfigError, check_range
from kvpilot.routing.ids import WorkerId

log = logging.getLogger(__name__)


class ConfigError(TypedConfigError):
    """A router config value or key is wrong: ``key`` names it by its dotted path
    (``cost.router_seed``, ``workers[0].url``), ``problem`` says what is wrong."""

    ROOT_KEY = "top level"


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


class IndexBackend(str, enum.Enum):
    """``index.backend``: the block index the router keeps."""

    KVPILOT = "kvpilot"
    """:class:`kvpilot.routing.index.block_index.BlockIndex`."""
    DYNAMO = "dynamo"
    """Dynamo's ``RadixTree`` (:mod:`kvpilot.routing.index.dynamo`; needs ``kvpilot[dynamo]``)."""


class TierClass(str, enum.Enum):
    """What a KV event's medium counts as in the cost (``index.tiers`` maps media to
    these), best first: blocks are credited only beyond the better classes."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"
    SHARED = "shared"


class ForcedOption(str, enum.Enum):
    """``sessions.force_option``: a :class:`~kvpilot.policies.session_options.Option` by its
    name, or ``""`` (:attr:`CHEAPEST`): the cheapest by the roofline."""

    CHEAPEST = ""
    REPREFILL = Option.REPREFILL.value
    PULL = Option.PULL.value
    AFFINITY = Option.AFFINITY.value
    SHARED_TIER = Option.SHARED_TIER.value
    LOCAL = Option.LOCAL.value

    @property
    def option(self) -> Option | None:
        """The option a session's later steps take while it is available; ``None``: the cheapest."""
        return None if self is ForcedOption.CHEAPEST else Option(self.value)


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


class IndexConfig(TypedConfig, frozen=True):
    """Which block index, and how it reads KV events."""

    error_type = ConfigError

    backend: IndexBackend = IndexBackend.KVPILOT
    """The block index: ``kvpilot``'s own, or ``dynamo``, Dynamo's ``RadixTree`` fed the same
    events (needs ``kvpilot[dynamo]``)."""
    block_size: int = 16
    """The engines' KV block size in tokens (vLLM's ``--block-size``): every engine of the
    fleet must use it; a KV event of another size is skipped (counted)."""
    kv_group: int = 0
    """The KV cache group whose events are indexed (vLLM's ``group_idx``; a hybrid model
    publishes one per group); events of other groups are skipped."""
    removal_log_capacity: int = 65536
    """Removals the ``kvpilot`` index keeps so a session's next step re-matches only what
    was evicted since its last one; past it, the step is matched from scratch."""
    events_stale_after_s: float = 0.0
    """A worker that prefilled blocks its entries lacked and then published no KV
    event for this long is routed on load alone (``kvpilot.routing.health.event_watch``); 0 = off
    (the default: right after a router restart the index can lack blocks an engine
    holds, and a prefill of those publishes nothing)."""
    tiers: Mapping[str, TierClass] = msgspec.field(
        default_factory=lambda: {
            "GPU": TierClass.GPU,
            "CPU": TierClass.HOST,
            "CPU_PINNED": TierClass.HOST,
            "STORAGE": TierClass.DISK,
        }
    )
    """A KV event's medium -> its :class:`TierClass`; media not listed earn nothing. ``CPU``
    is vLLM's offloading connectors' host tier, ``CPU_PINNED`` Dynamo's (its publishers'
    ``StorageTier::HostPinned``)."""

    def __post_init__(self) -> None:
        check_range(self, "block_size", "removal_log_capacity", above=0)
        check_range(self, "kv_group", "events_stale_after_s", at_least=0)
        msgspec.structs.force_setattr(self, "tiers", MappingProxyType(dict(self.tiers)))


class SessionStoreKind(str, enum.Enum):
    """``sessions.store``: where the sessions' placement, affinity and D's offers live."""

    MEMORY = "memory"
    """This router's memory only (lost on a restart, not seen by another replica)."""
    REDIS = "redis"
    """Also Redis at ``sessions.redis_url`` (:mod:`kvpilot.routing.state`; needs ``kvpilot[redis]``)."""


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class HoldMode(str, enum.Enum):
    """Whether D holds a finished step's KV for the session's next step (vLLM's bidirectional mode)."""

    PRICED = "priced"  # kvpilot.policies.session_hold decides per step
    ALWAYS = "always"  # vLLM's own: every step held for decoder_kv_blocks_ttl


class SessionConfig(TypedConfig, frozen=True):
    """Agent sessions: how many are kept, which option their later steps take, where they live."""

    error_type = ConfigError

    max_sessions: int = 10000
    """Sessions the router keeps (least recently used dropped beyond it)."""
    force_option: ForcedOption = ForcedOption.CHEAPEST
    """A session's later steps take this option of the article's section 9.2 while it
    is available (``reprefill``, ``pull``, ``affinity``, ``shared_tier``, ``local``);
    ``""``: the cheapest by the roofline."""
    store: SessionStoreKind = SessionStoreKind.MEMORY
    """Where the sessions' placement, affinity and D's offers live: ``memory`` (this
    router's) or ``redis`` (shared by replicas, kept across restarts; needs ``kvpilot[redis]``)."""
    redis_url: str = ""
    """``redis://host:port/db`` (or ``rediss://``, ``unix://``) when ``store`` is ``redis``;
    a password in it is refused (a config file or command line would carry it): name it
    with ``redis_password_env``. A user name (Redis ACLs) may stay."""
    redis_password_env: str = ""
    """The environment variable holding Redis's password (``AUTH``), or ``<it>_FILE``
    naming a file that holds it (:func:`read_secret`); ``""``: none."""
    max_sessions_per_client: int = 1000
    """Live sessions one client may hold (the client as the router sees it: the relay's TCP
    peer, or through Envoy the client's TCP peer address as Envoy saw it, ``source.address``;
    a gateway that sends none gets no limit); a client's new session beyond it drops that
    client's least recently named session, never another client's. 0: no limit."""
    store_key_prefix: str = "kvpilot:"
    """Every key the router writes starts with this (one Redis may serve several fleets)."""
    store_read_timeout_s: float = 0.05
    """A session's record not read within this is routed on the local state (counted)."""
    store_write_timeout_s: float = 0.05
    """A write not acknowledged within this is given up (counted); the answer waits for it
    at most this long (:mod:`kvpilot.routing.state.sync` says why it waits)."""
    store_ttl_s: float = 600.0
    """How long a record lives when D stated no hold on the session's blocks (else: D's lease)."""
    resident_s: float = 30.0
    """A session that sent no step for this long after its latest one ended no longer counts
    as living on its worker (``cost.session_residency_weight``): an agent's tool call takes
    seconds; a session idle longer may not come back."""

    hold: HoldMode = HoldMode.PRICED
    """Whether D holds a finished step's blocks for P to pull back (vLLM's bidirectional mode
    holds every one for ``decoder_kv_blocks_ttl``): ``priced`` holds only a session expected
    back within D's hold and ``resident_s``, on a D below ``hold_release_kv_usage``
    (:mod:`kvpilot.policies.session_hold`); ``always``, as vLLM does."""
    hold_release_kv_usage: float | None = 0.9
    """D's KV usage (as the local-vs-remote policy reads it) at or above which a priced hold is
    released, so that its blocks stay evictable; null: never for pressure."""

    def __post_init__(self) -> None:
        check_range(self, "max_sessions", above=0)
        check_range(self, "hold_release_kv_usage", at_least=0)
        check_range(self, "max_sessions_per_client", at_least=0)
        if urlsplit(self.redis_url).password is not None:
            raise ConfigError("redis_url", "holds a password: name its variable in sessions.redis_password_env instead")
        check_range(self, "store_read_timeout_s", "store_write_timeout_s", "store_ttl_s", "resident_s", above=0)
        if self.store is SessionStoreKind.REDIS and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ConfigError(
                "redis_url", f"must be redis://, rediss:// or unix:// with store: redis, got {self.redis_url!r}"
            )


class ServerConfig(TypedConfig, frozen=True):
    """The HTTP front: where it listens, the model it serves, upstream timeouts."""

    error_type = ConfigError

    host: str = "127.0.0.1"
    """The address the HTTP front (and the picker) binds; anything but loopback is
    reachable from other machines and warned about at start."""
    port: int = 8000
    """The HTTP front's port."""
    model_name: str = "tiny"
    """The model name clients send (``"model"``) and ``/v1/models`` lists; a request naming
    another is refused (404)."""
    model_dir: str = ""
    """The served model's directory: its ``tokenizer.json`` and ``tokenizer_config.json``
    (the router tokenizes once), and its ``config.json`` (the roofline prior). Required by
    ``kvpilot router``."""
    prefill_timeout_s: float = 30.0
    """The floor of P's timeout for a remote prefill: P is given ``max(this, 3 x its
    predicted queue and prefill)``; past it the request is prefilled on D instead."""
    request_timeout_s: float = 600.0
    """The longest a request may take end to end (D's whole answer); past it the router ends
    it (and a request Envoy carries is released from the picker's books)."""
    engine_metrics_interval_s: float = 5.0
    """How often each engine's ``/metrics`` is read (running, waiting, KV usage; the measured
    rates); 0: never (beside Dynamo it is never read: its workers publish no vLLM metrics)."""
    max_body_bytes: int = 4 << 20
    """Larger bodies are refused (413): 4 MiB holds 8K token ids or a long chat."""
    max_prompt_tokens: int = 0
    """Prompts longer than this are refused (400) before routing; 0: no limit. The
    fleet sets the engines' max model length."""
    max_output_tokens: int = 0
    """``max_tokens`` (``max_completion_tokens``) above this is refused (400); 0: no limit."""
    max_model_len: int = 0
    """The engines' ``--max-model-len``: with it the router refuses, before any engine sees
    them, the prompts and output lengths vLLM would refuse, with vLLM's messages
    (:mod:`kvpilot.routing.serve.engine_checks`), and truncates as vLLM does. 0: learned at
    start from the engines' ``/v1/models``; set, it must equal what they state there
    (:mod:`kvpilot.routing.serve.learned_limits`)."""
    allow_unchecked_lengths: bool = False
    """Serve even when ``max_model_len`` is known neither from the engines nor from the config,
    leaving prompt and output lengths to the engines (a refusal then reaches the client from
    D, after P prefilled). Off: the router refuses to start without a length."""
    max_logprobs: int = 20
    """The engines' ``--max-logprobs`` (vLLM's default 20; -1: the vocabulary): more
    ``logprobs``, ``top_logprobs`` or ``prompt_logprobs`` are refused with vLLM's message.
    vLLM states it on no endpoint, so it is not learned: ``kvpilot fleet up`` sets it from
    ``--engine-args``; a router started otherwise must be given the engines' value."""
    max_concurrent_requests: int = 0
    """Requests in flight at once; 0: no limit (no queue)."""
    max_queued_requests: int = 256
    """Requests waiting for a slot; more are refused at once (429)."""
    queue_timeout_s: float = 30.0
    """A queued request not admitted within this is refused (503)."""
    ttft_slo_s: float = 0.0
    """A routed request whose predicted TTFT (:mod:`kvpilot.routing.decide.rates`: queue,
    prefill, transfer, first decode step) is over this is refused before any engine
    sees it: 429 when the queue ahead of it is what puts it over, else 503, both with
    ``Retry-After`` (:func:`kvpilot.routing.serve.admission.check_ttft_slo`). 0: no SLO (the
    router's default; ``kvpilot fleet up`` sets one, docs/concepts/policies.md)."""
    max_retries: int = 1
    """A request whose decode worker failed before anything reached the client
    (no answer, 5xx, timeout) is tried again this many times on other decode workers."""
    circuit_failures: int = 3
    """Consecutive failures (no answer, timeout, 5xx) that open a worker's circuit; 0: off."""
    circuit_open_s: float = 10.0
    """How long an open circuit keeps a worker out of routing before it is tried again."""
    api_key_env: str = ""
    """The environment variable holding the router's API key (``""``: no key). With a
    key, every endpoint except ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <key>``. Named, not stored, so no config file or command
    line carries the secret."""

    admin_token_env: str = ""
    """The environment variable (or ``<it>_FILE``, :func:`read_secret`) holding the admin
    token that ``POST /debug/route`` needs (``Authorization: Bearer <token>``), from any
    address; the client API key does not open it. ``""``: ``/debug/route`` answers only a
    loopback peer (an operator on the router's host), with the API key if one is set."""

    engine_api_key_env: str = ""
    """The environment variable holding the engines' API key (vLLM's ``--api-key``),
    sent to every engine as ``Authorization: Bearer <key>``; ``""``: none."""
    calibration_prompt_tokens: list[int] = msgspec.field(default_factory=lambda: [256, 1024, 4096])
    """Before it serves, the router times a prefill of each of these lengths from nothing,
    and of a few tokens after each (:mod:`kvpilot.routing.serve.calibrate`); lengths over
    ``max_prompt_tokens`` are skipped."""
    calibration_decode_streams: list[int] = msgspec.field(default_factory=lambda: [1, 4])
    """Before it serves, the router times decode steps with each of these numbers of streams."""
    calibration_workers: int = 0
    """Workers calibrated per role (prefill, decode, co-located) before the router serves, the
    fleet's first: the others are predicted from them (one model) until their own traffic is
    timed. 0: no calibration (the router's default; ``kvpilot fleet up`` sets 1)."""

    def __post_init__(self) -> None:
        check_range(self, "port", at_least=0, below=65536)
        check_range(
            self,
            "engine_metrics_interval_s",
            "max_prompt_tokens",
            "max_output_tokens",
            "max_model_len",
            "max_concurrent_requests",
            "max_queued_requests",
            "circuit_failures",
            "max_retries",
            "ttft_slo_s",
            at_least=0,
        )
        check_range(self, "max_body_bytes", at_least=1024)
        check_range(self, "queue_timeout_s", "circuit_open_s", "prefill_timeout_s", "request_timeout_s", above=0)
        check_range(self, "calibration_workers", at_least=0)
        check_range(self, "max_logprobs", at_least=-1)
        for key in ("calibration_prompt_tokens", "calibration_decode_streams"):
            if any(n < 1 for n in getattr(self, key)):
                raise ConfigError(key, f"must hold positive counts, got {getattr(self, key)}")


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


class DiscoveryBackend(str, enum.Enum):
    """Where Dynamo's own discovery client finds the workers (its ``--discovery-backend``)."""

    FILE = "file"  # the directory in $DYN_FILE_KV
    ETCD = "etcd"  # ETCD_ENDPOINTS
    KUBERNETES = "kubernetes"


class DynamoConfig(TypedConfig, frozen=True):
    """Routing a Dynamo deployment through its frontend in direct mode
    (:mod:`kvpilot.routing.ingest.dynamo_discovery`, :mod:`kvpilot.routing.serve.dynamo_upstream`).

    The workers are the instances of ``decode_endpoint`` (decode, or aggregated when
    no prefill instance exists) and ``prefill_endpoint``, read through Dynamo's own
    discovery client every ``discovery_interval_s``. Each worker's vLLM-format KV events
    are read at ``tcp://<its request-plane host>:<port>``, the port being its
    request-plane port plus ``kv_events_port_offset`` (many workers on one host, each
    started with its own ``DYN_TCP_RPC_PORT``) or ``kv_events_port`` (the same port on
    every host); both 0: no KV events (routed on load alone). ``kv_events_endpoints``
    names the endpoint of an instance by its id in hex (``40c4d0cf81efebb0``) and comes
    before both rules: workers that share one process (``dynamo.mocker --num-workers``)
    share its request-plane port, so no port rule tells them apart."""

    error_type = ConfigError

    frontend_url: str = ""
    """Dynamo's frontend in direct mode (``http://host:port``): every request goes there with
    the chosen instances named; ``""``: not beside Dynamo (the ``workers`` are vLLM engines)."""
    discovery_backend: DiscoveryBackend = DiscoveryBackend.FILE
    """Where Dynamo's own discovery client finds the workers: ``file`` (``$DYN_FILE_KV``),
    ``etcd`` (``$ETCD_ENDPOINTS``) or ``kubernetes``."""
    decode_endpoint: str = "dynamo.backend.generate"
    """The decode (or aggregated) workers' endpoint, ``namespace.component.endpoint``."""
    prefill_endpoint: str = "dynamo.prefill.generate"
    """The prefill workers' endpoint, ``namespace.component.endpoint``."""
    discovery_interval_s: float = 1.0
    """How often discovery is read: workers that joined are routed to, those that left dropped."""
    kv_events_port_offset: int = 0
    """A worker's KV events are at its request-plane port plus this (many workers on one
    host); 0: this rule is off."""
    kv_events_port: int = 0
    """A worker's KV events are at this port on its host (one worker per host); 0: off."""
    kv_events_endpoints: Mapping[str, str] = msgspec.field(default_factory=dict)
    """Instance id in hex -> ``tcp://host:port`` of its KV events, before both port rules
    (workers that share one process share its request-plane port)."""
    kv_replay_port_offset: int = 0
    """With ``kv_events_port_offset``: each worker serves its KV-event replay at its
    request-plane port plus this (``dynamo.mocker --zmq-replay-ports``), so a restarted
    router reads back the blocks the workers hold; 0: no replay."""

    @property
    def enabled(self) -> bool:
        return bool(self.frontend_url)

    def __post_init__(self) -> None:
        if self.frontend_url:
            parts = urlsplit(self.frontend_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError("frontend_url", f"must be http(s)://host:port, got {self.frontend_url!r}")
            msgspec.structs.force_setattr(self, "frontend_url", self.frontend_url.rstrip("/"))
        for name in ("decode_endpoint", "prefill_endpoint"):
            if len(getattr(self, name).split(".")) != 3:
                raise ConfigError(name, f"must be namespace.component.endpoint, got {getattr(self, name)!r}")
        check_range(self, "discovery_interval_s", above=0)
        if self.kv_events_port and self.kv_events_port_offset:
            raise ConfigError("kv_events_port", "set kv_events_port or kv_events_port_offset, not both")
        check_range(self, "kv_events_port", at_least=0, below=65536)
        check_range(self, "kv_events_port_offset", above=-65536, below=65536)
        check_range(self, "kv_replay_port_offset", above=-65536, below=65536)
        if self.kv_replay_port_offset and not self.kv_events_port_offset:
            raise ConfigError("kv_replay_port_offset", "needs kv_events_port_offset (the same port rule)")
        for instance, endpoint in self.kv_events_endpoints.items():
            try:
                int(instance, 16)
            except ValueError:
                raise ConfigError("kv_events_endpoints", f"keys are instance ids in hex, got {instance!r}") from None
            if not endpoint.startswith("tcp://"):
                raise ConfigError("kv_events_endpoints", f"{instance}: must be tcp://host:port, got {endpoint!r}")
        endpoints = {instance.lower(): endpoint for instance, endpoint in self.kv_events_endpoints.items()}
        msgspec.structs.force_setattr(self, "kv_events_endpoints", MappingProxyType(endpoints))


class GatewayConfig(TypedConfig, frozen=True):
    """kvpilot as Envoy's endpoint picker (:mod:`kvpilot.routing.gateway`): with ``picker_port``
    set the router also serves, on ``server.host:picker_port``, the gRPC services Envoy
    calls: ``ext_proc`` (each request's headers and body; the answer names the
    destination) and the OpenTelemetry logs service (Envoy's access log: each request's
    end and first-token time). Streams then go from the engines to the clients through
    Envoy, not through the router (``deploy/envoy_spec.py`` writes Envoy's config).
    ``picker_port`` 0: no picker (the HTTP front alone)."""

    error_type = ConfigError

    picker_port: int = 0
    """The picker's gRPC port on ``server.host`` (Envoy's ``ext_proc`` and access log);
    0: no picker."""
    token_env: str = ""
    """The environment variable (or ``<it>_FILE``, :func:`read_secret`) holding the token
    every gRPC call to the picker must carry as ``authorization: Bearer <token>`` metadata
    (Envoy's ``grpc_service.initial_metadata``); a call without it is refused
    (``UNAUTHENTICATED``) before it reaches the picker or the access log. Set it wherever
    the picker is reachable from other hosts (``server.host`` not loopback; warned at start
    without it: a GAIE gateway that cannot send metadata leaves the NetworkPolicy as the
    only fence); ``""``: no token."""

    def __post_init__(self) -> None:
        check_range(self, "picker_port", at_least=0, below=65536)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class Worker(TypedConfig, frozen=True):
    """One engine: an OpenAI-compatible server at ``url`` with optional KV events, as
    written in YAML and as the router uses it (:mod:`kvpilot.routing.fleet` checks the fleet)."""

    error_type = ConfigError

    name: WorkerId
    """The worker's name in routes, metrics and logs (unique in the fleet)."""
    role: Role
    """``prefill``, ``decode`` or ``colocated`` (prefills and decodes its own requests)."""
    url: str
    """The engine's OpenAI-compatible server, ``http(s)://host:port``."""
    kv_events_endpoint: str | None = None
    """Where the engine publishes its KV events (vLLM's ``--kv-events-config`` endpoint, as
    seen from the router: ``tcp://host:port``); null: routed on load alone."""
    replay_endpoint: str | None = None
    """The engine's KV-event replay endpoint (vLLM's ``replay_endpoint``): the router asks it
    for the events it missed; null: a gap clears the worker's entries instead."""
    topic: str = "kv"
    """The ZMQ topic of the engine's KV events (vLLM's ``topic``)."""
    kv_blocks: int = 0
    """KV capacity in blocks (0 = unknown: the decode-busy guard reads usage 0)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name", "must be a non-empty string")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError("url", f"must be http(s)://host:port, got {self.url!r}")
        msgspec.structs.force_setattr(self, "url", self.url.rstrip("/"))
        for name in ("kv_events_endpoint", "replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(_EVENT_SCHEMES):
                raise ConfigError(name, f"must be a tcp://, ipc:// or inproc:// endpoint, got {endpoint!r}")
        if self.replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("replay_endpoint", "needs kv_events_endpoint")
        check_range(self, "kv_blocks", at_least=0)


class RouterConfig(TypedConfig, frozen=True):
    """The router's whole configuration: the YAML of ``kvpilot router --config``."""

    error_type = ConfigError

    cost: CostConfig = msgspec.field(default_factory=CostConfig)
    """Dynamo's cost function: its parameters under Dynamo's names and defaults, plus kvpilot's own."""
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    """The global block index and the KV events that feed it."""
    sessions: SessionConfig = msgspec.field(default_factory=SessionConfig)
    """Agent sessions: affinity, D's offers, the article's five options, the shared store."""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    """The HTTP front: address, model, limits, admission, timeouts, circuits, API keys."""
    disaggregation: DisaggregationConfig = msgspec.field(default_factory=DisaggregationConfig)
    """Local or remote prefill per request (conditional disaggregation) and the roofline prior."""
    dynamo: DynamoConfig = msgspec.field(default_factory=DynamoConfig)
    """Beside NVIDIA Dynamo: its frontend, its discovery and its workers' KV events."""
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    """The endpoint picker behind Envoy."""
    workers: tuple[Worker, ...] = ()
    """The engines (not beside Dynamo, whose workers come from its discovery)."""

    def __post_init__(self) -> None:
        if self.cost.objective is CostObjective.PREDICTED_TTFT and not self.disaggregation.measured_rates:
            raise ConfigError("cost.objective", "predicted_ttft needs disaggregation.measured_rates: true")


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
