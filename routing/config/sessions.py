"""The ``sessions`` section: how many sessions are kept, which option their later steps
take, where they live and whether D holds their KV."""

from __future__ import annotations

import enum
from urllib.parse import urlsplit

from kvpilot.policies.session_options import Option
from kvpilot.policies.typed_config import TypedConfig, check_range
from kvpilot.routing.config.errors import ConfigError


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
