"""What Envoy's config (``deploy/envoy_spec.py``) and the picker's services must agree on:
header names, the access log's name and attributes. Pure constants."""

from __future__ import annotations

import enum
import ipaddress

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""GAIE's endpoint-picker protocol: the ``IP:port`` the picker chose (an address, never a
host name: Envoy's original-destination cluster connects to nothing else), as a header and
under the same key in the dynamic metadata namespace :data:`DESTINATION_METADATA_NAMESPACE`."""
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
DECIDED_HEADER = "x-kvpilot-decided-by"
"""Set by the compiled picker in Envoy (``routing/native/kvp_module.c``) on a request it decided:
Envoy then skips ext_proc for it."""
ROUTING_HEADERS = (DESTINATION_HEADER, DECIDED_HEADER, "x-dynamo-worker-instance-id", "x-dynamo-prefill-instance-id")
"""Headers only the picker sets: Envoy strips them from what clients send, so no client
routes itself past the picker."""
ANSWER_HEADERS = (
    "x-request-id",
    "x-kvpilot-route",
    "x-kvpilot-prefill-worker",
    "x-kvpilot-decode-worker",
    "x-kvpilot-predicted-ttft-ms",
)
"""The picker's headers on D's request that Envoy copies to the client's answer
(:class:`~kvpilot.routing.serve.proxy.Begun`'s ``headers``, lower-case)."""
CLIENT_ATTRIBUTE = "source.address"
"""The request attribute Envoy's ext_proc filter sends the picker with each request's headers:
the client's ``IP:port`` as Envoy sees it (the TCP peer's, by ``use_remote_address``)."""
ACCESS_LOG_NAME = "kvpilot"


class LogAttribute(str, enum.Enum):
    """The attributes of Envoy's access-log record for each request."""

    REQUEST_ID = "request_id"
    STATUS = "status"
    FIRST_BODY_BYTE_US = "first_body_byte_us"
    """Microseconds from the request's first byte to the destination's first body byte
    (``-`` when none came): a stream's first token."""
    DURATION_US = "duration_us"
    """Microseconds from the request's first byte to the answer's last byte sent."""
    RESPONSE_FLAGS = "response_flags"
    """Envoy's response flags (``-`` for none, else comma-separated: ``UR`` the destination
    reset the stream, ``UC`` it closed the connection, ``DC`` the client left, ...)."""

    @property
    def envoy_format(self) -> str:
        """Envoy's access-log format string for the attribute."""
        return _FORMATS[self]


_FORMATS = {
    LogAttribute.REQUEST_ID: "%REQ(X-REQUEST-ID)%",
    LogAttribute.STATUS: "%RESPONSE_CODE%",
    LogAttribute.FIRST_BODY_BYTE_US: "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
    LogAttribute.DURATION_US: "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
    LogAttribute.RESPONSE_FLAGS: "%RESPONSE_FLAGS%",
}


def is_ip_address(host: str) -> bool:
    """Whether ``host`` is an IP address as written (the picker names one as is; a host name
    is resolved first, and Envoy's clusters look it up themselves)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
