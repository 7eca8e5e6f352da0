"""KVPilotConnector under the name ``NixlConnector``: the seam for Dynamo's vLLM workers.

Dynamo 1.6.1's ``dynamo.vllm`` prefill handler picks the P->D handoff protocol by the
``kv_connector`` *name* of the engine's ``KVTransferConfig``
(``dynamo/vllm/kv_connector_protocols.py``, ``make_kv_connector_protocol``: its table
``KV_CONNECTOR_PROTOCOLS`` knows ``NixlConnector``, ``NeuronNixlConnector``,
``MooncakeConnector`` and ``LMCacheMPConnector``; ``MultiConnector``/``PdConnector``
delegate to their one child of those names) and raises ``ValueError: Unsupported
kv_connector='KVPilotConnector' for PD`` for any other name.

vLLM 0.32, for its part, loads the class named ``kv_connector`` *from*
``kv_connector_module_path`` when that is set, before its own registry
(``KVConnectorFactory.get_connector_class``: "External module path takes priority over
internal registry"). So the engine config::

    {"kv_connector": "NixlConnector",
     "kv_connector_module_path": "kvpilot.kvconnectors.dynamo_nixl", ...}

makes vLLM build :class:`~kvpilot.kvconnectors.connector.KVPilotConnector` (its log says
``Creating v1 connector with name: KVPilotConnector``) and makes Dynamo use its NIXL
protocol, which is the one KVPilotConnector speaks: P's request carries NixlConnector's
``do_remote_decode`` params, and D gets P's ``kv_transfer_params`` unchanged
(``NixlConnectorProtocol.decode_request_kv_transfer_params``), kvpilot's verification
offer (``"kvpilot"``) included. The inner connector is still vLLM's own NixlConnector
from vLLM's registry (:func:`~kvpilot.kvconnectors.connector.inner_transfer_config` drops the
module path). vLLM's NIXL-specific config checks (``KVTransferConfig.has_connector("NixlConnector")``:
DCP interleave, the CPU platform's Mamba conv-state layout) then apply too, as they should:
the data plane is NixlConnector's.

No Dynamo or vLLM code is patched or copied. ``deploy/recipes/dynamo-kv-transfer-config.json``
is the config; ``docs/guides/dynamo.md`` says what of it has been run.
"""

from __future__ import annotations

from kvpilot.kvconnectors.connector import KVPilotConnector

NixlConnector = KVPilotConnector
"""What vLLM loads for ``kv_connector: NixlConnector`` with this module's path."""

MODULE_PATH = __name__
"""``kv_connector_module_path`` for the seam."""

__all__ = ["MODULE_PATH", "NixlConnector"]
