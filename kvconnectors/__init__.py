"""kvpilot's KV connector for vLLM.

``KVPilotConnector`` (in :mod:`kvconnectors.connector`) wraps an inner vLLM connector
(``NixlConnector`` by default) and adds kvpilot's layers at the scheduler-side seams.
Modules that the router shares with the connector (the hash contract, the
kv_transfer_params schema) never import vLLM at module level; only
:mod:`kvconnectors.connector`, :mod:`kvconnectors.stats` and :mod:`kvconnectors.plugin`'s
``register()`` do.
"""

CONNECTOR_NAME = "KVPilotConnector"
