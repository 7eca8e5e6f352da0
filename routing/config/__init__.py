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

One module per section (``cost``, ``index``, ``sessions``, ``server``, ``disaggregation``,
``dynamo``, ``gateway``, ``workers``), the whole in ``root`` (:class:`RouterConfig`), the
error in ``errors``, secrets in ``secret`` and the prior's model in ``prior``; every public
name is imported here, so ``kvpilot.routing.config`` is the one import path.
"""

from kvpilot.routing.config.cost import CostConfig, CostObjective
from kvpilot.routing.config.disaggregation import DisaggregationConfig
from kvpilot.routing.config.dynamo import DiscoveryBackend, DynamoConfig
from kvpilot.routing.config.errors import ConfigError
from kvpilot.routing.config.gateway import GatewayConfig
from kvpilot.routing.config.index import IndexBackend, IndexConfig, TierClass
from kvpilot.routing.config.prior import FALLBACK_MODEL_PRESET, prior_model
from kvpilot.routing.config.root import RouterConfig
from kvpilot.routing.config.secret import SECRET_FILE_SUFFIX, read_secret
from kvpilot.routing.config.server import ServerConfig
from kvpilot.routing.config.sessions import ForcedOption, HoldMode, SessionConfig, SessionStoreKind
from kvpilot.routing.config.workers import Role, Worker

__all__ = [
    "FALLBACK_MODEL_PRESET",
    "SECRET_FILE_SUFFIX",
    "ConfigError",
    "CostConfig",
    "CostObjective",
    "DisaggregationConfig",
    "DiscoveryBackend",
    "DynamoConfig",
    "ForcedOption",
    "GatewayConfig",
    "HoldMode",
    "IndexBackend",
    "IndexConfig",
    "Role",
    "RouterConfig",
    "ServerConfig",
    "SessionConfig",
    "SessionStoreKind",
    "TierClass",
    "Worker",
    "prior_model",
    "read_secret",
]
