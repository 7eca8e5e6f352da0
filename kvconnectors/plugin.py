"""The ``vllm.general_plugins`` entry point: registers ``KVPilotConnector`` with
vLLM's ``KVConnectorFactory``.

vLLM calls general plugins in every process it starts (API server, engine core,
workers), and may call them more than once per process, so :func:`register` is
idempotent. It only registers a lazy ``module:class`` path; nothing heavy is
imported until vLLM builds the connector. It also has kvpilot's loggers print where
vLLM's do (:func:`log_like_vllm`).
"""

from __future__ import annotations

import contextlib
import logging

from kvpilot.kvconnectors import CONNECTOR_NAME


def log_like_vllm() -> None:
    """Give the ``kvpilot`` loggers vLLM's handlers and level (``VLLM_LOGGING_LEVEL``),
    unless they have handlers of their own. vLLM configures only its ``vllm`` logger:
    without this, kvpilot's INFO and DEBUG lines in an engine (each pull decision with
    its inputs, the policy it runs) were dropped, and its warnings reached Python's
    last-resort handler. Idempotent; ``propagate`` stays on (a root handler, such as
    pytest's, still sees them)."""
    ours, theirs = logging.getLogger("kvpilot"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)


def register() -> None:
    """Register ``KVPilotConnector`` unless this process already has it; see
    :func:`log_like_vllm`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    log_like_vllm()

    # vLLM's factory refuses a second registration: this process has it already.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvpilot.kvconnectors.connector", "KVPilotConnector")
