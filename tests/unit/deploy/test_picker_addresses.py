"""The picker names an ``IP:port`` (Envoy's original-destination cluster takes nothing
else): :class:`~kvpilot.routing.gateway.picker.Addresses` resolves host names off the request
path and keeps them. A scripted lookup stands in for DNS, except for ``localhost`` (the
system resolver's ``/etc/hosts``, no network)."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.routing.config import Role, Worker
from kvpilot.routing.gateway.picker import Addresses, resolve_host
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.serve.upstream import UpstreamError

DECODE = Worker(name=WorkerId("decode-0"), role=Role.DECODE, url="http://kvpilot-decode-0:8100")


class Dns:
    """A lookup that answers from ``records`` (a missing name raises ``OSError``) and
    counts the questions."""

    def __init__(self, records: dict[str, str]) -> None:
        self.records = records
        self.asked: list[str] = []

    async def __call__(self, host: str) -> str:
        self.asked.append(host)
        if host not in self.records:
            raise OSError(f"{host}: no such name")
        return self.records[host]


def test_localhost_resolves_to_ipv4_first() -> None:
    assert asyncio.run(resolve_host("localhost")) == "127.0.0.1"


def test_a_name_is_answered_from_memory_after_the_refresh() -> None:
    async def scenario() -> None:
        dns = Dns({"kvpilot-decode-0": "10.1.0.5"})
        addresses = Addresses(dns)
        await addresses.refresh(["kvpilot-decode-0", "10.9.9.9"])
        assert dns.asked == ["kvpilot-decode-0"]  # an IP address is never looked up
        for _ in range(3):
            assert await addresses.ip_port(DECODE, "kvpilot-decode-0:8100") == "10.1.0.5:8100"
        assert await addresses.ip_port(DECODE, "10.9.9.9:8101") == "10.9.9.9:8101"
        assert await addresses.ip_port(DECODE, "fd00::7:8100") == "[fd00::7]:8100"
        assert dns.asked == ["kvpilot-decode-0"]  # per request: no lookup

    asyncio.run(scenario())


def test_a_refresh_follows_a_moved_pod_and_keeps_an_address_dns_lost() -> None:
    async def scenario() -> None:
        dns = Dns({"kvpilot-decode-0": "10.1.0.5"})
        addresses = Addresses(dns)
        await addresses.refresh(["kvpilot-decode-0"])
        dns.records["kvpilot-decode-0"] = "10.1.0.9"  # the pod was rescheduled
        await addresses.refresh()  # every name seen before, none given
        assert await addresses.ip_port(DECODE, "kvpilot-decode-0:8100") == "10.1.0.9:8100"
        del dns.records["kvpilot-decode-0"]  # not ready: a headless Service has no record
        await addresses.refresh()
        assert await addresses.ip_port(DECODE, "kvpilot-decode-0:8100") == "10.1.0.9:8100"

    asyncio.run(scenario())


def test_a_name_first_seen_in_a_request_is_resolved_once_and_one_that_fails_is_a_502() -> None:
    async def scenario() -> None:
        dns = Dns({"frontend": "10.2.0.1"})
        addresses = Addresses(dns)
        await addresses.refresh(["gone"])  # never resolved: unknown, not an error
        assert await addresses.ip_port(DECODE, "frontend:8090") == "10.2.0.1:8090"
        assert await addresses.ip_port(DECODE, "frontend:8090") == "10.2.0.1:8090"
        assert dns.asked.count("frontend") == 1
        with pytest.raises(UpstreamError, match="'gone' does not resolve") as raised:
            await addresses.ip_port(DECODE, "gone:8100")
        assert raised.value.status == 502 and raised.value.worker is DECODE

    asyncio.run(scenario())
