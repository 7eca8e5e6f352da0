"""Whether an address the router binds is reachable from other machines: the HTTP front
(:mod:`kvpilot.routing.cli`) and the picker (:mod:`kvpilot.routing.gateway.service`) warn
at start when it is. Pure."""

from __future__ import annotations

import ipaddress


def beyond_loopback(host: str) -> bool:
    """Whether binding ``host`` accepts connections from other machines."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return True
