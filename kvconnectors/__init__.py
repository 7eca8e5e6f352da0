"""kvpilot's KV connector for vLLM.

``KVPilotConnector`` (in :mod:`kvpilot.kvconnectors.connector`) wraps an inner vLLM connector
(``NixlConnector`` by default) and adds kvpilot's layers at the scheduler-side seams.
The pure modules (the hash contract, the kv_transfer_params schema, verification,
attach planning, the pull policy, the thread binding, the engine's metric names in
:mod:`kvpilot.kvconnectors.vllm_metrics`) never import vLLM at module level, so they are
tested without it; only :mod:`kvpilot.kvconnectors.connector`,
:mod:`kvpilot.kvconnectors.scheduler` (through :mod:`kvpilot.kvconnectors.stats`) and
:mod:`kvpilot.kvconnectors.plugin`'s ``register()`` do.

Citations: "the article" is the reference article "KV, Prefix, and Session Caching
in Co-located and Disaggregated LLM Serving", kvpilot's specification; "article
section 9.2" cites its section by number.
"""

CONNECTOR_NAME = "KVPilotConnector"
