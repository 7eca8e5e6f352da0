"""Why the router refuses a request before routing it: one closed set, the ``reason``
label of ``kvpilot_router_rejected_total`` (every value exists from the start at 0),
and the exception that carries a refusal to the front that answers the client (the HTTP
front or Envoy's picker). Below ``serve/``, ``gateway/`` and ``metrics/``, which all name
these reasons. Pure."""

from __future__ import annotations

import enum


class RejectReason(str, enum.Enum):
    """A counted refusal; the value is the metric label."""

    BODY_TOO_LARGE = "body_too_large"  # over server.max_body_bytes (413)
    PROMPT_TOO_LONG = "prompt_too_long"  # over server.max_prompt_tokens (400)
    MAX_TOKENS = "max_tokens"  # max_tokens over server.max_output_tokens (400)
    QUEUE_FULL = "queue_full"  # admission: the queue is full (429)
    QUEUE_TIMEOUT = "queue_timeout"  # admission: waited past server.queue_timeout_s (503)
    TTFT_SLO = "ttft_slo"  # admission: predicted TTFT over server.ttft_slo_s (429 for load, else 503)
    UNAUTHORIZED = "unauthorized"  # missing or wrong API key (401)


class BadRequest(Exception):
    """A request refused before routing: ``status`` is what the client gets;
    ``reason``, when set, labels ``kvpilot_router_rejected_total`` (refusals without
    one, such as malformed JSON, are not counted there)."""

    def __init__(self, message: str, status: int = 400, reason: RejectReason | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
