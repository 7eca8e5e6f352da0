"""The ``vllm.general_plugins`` entry point: registers ``KVPilotConnector`` with
vLLM's ``KVConnectorFactory``.

vLLM calls general plugins in every process it starts (API server, engine core,
workers), and may call them more than once per process, so :func:`register` is
idempotent. It only registers a lazy ``module:class`` path; nothing heavy is
imported until vLLM builds the connector.
"""

from __future__ import annotations

import contextlib

from kvconnectors import CONNECTOR_NAME


def register() -> None:
    """Register ``KVPilotConnector`` unless this process already has it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM's factory refuses a second registration: this process has it already.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvconnectors.connector", "KVPilotConnector")
