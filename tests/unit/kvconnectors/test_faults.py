"""The data-plane fault injector's choice of reads (:mod:`kvpilot.kvconnectors.faults`) and
its refusal without the explicit permission (:class:`KVPilotConfig`)."""

from __future__ import annotations

import re

import pytest

from kvpilot.kvconnectors.config import KVPilotConfig, KVPilotConfigError
from kvpilot.kvconnectors.faults import FaultInjection, FaultInjector, FaultKind


def test_an_injector_is_refused_without_the_explicit_permission() -> None:
    with pytest.raises(KVPilotConfigError, match=r"fault_injection: .*allow_fault_injection: true"):
        KVPilotConfig.parse({"fault_injection": {"kinds": ["corrupt_block"], "rate": 0.1}})


def test_an_allowed_injector_parses_and_is_off_by_default() -> None:
    assert KVPilotConfig.parse(None).fault_injection is None
    config = KVPilotConfig.parse(
        {"fault_injection": {"request_ids": {"abc": "stall_read"}}, "allow_fault_injection": True}
    )
    assert config.fault_injection == FaultInjection(request_ids={"abc": FaultKind.STALL_READ})


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ({"kinds": [], "rate": 0.5}, "fault_injection.kinds"),
        ({"request_ids": {"abc": "melt"}}, "fault_injection.request_ids.abc"),
        ({"kinds": ["melt"]}, "fault_injection.kinds[0]"),
        ({"kinds": ["stall_read"], "rate": 1.5}, "fault_injection.rate"),
        ({"kinds": ["stall_read"], "stall_s": 0}, "fault_injection.stall_s"),
        ({"kinds": ["stall_read"], "when": 1}, "fault_injection.when"),
    ],
)
def test_a_bad_injector_is_refused_naming_the_field(spec: dict[str, object], key: str) -> None:
    with pytest.raises(KVPilotConfigError, match=re.escape(f"kv_connector_extra_config.{key}:")):
        KVPilotConfig.parse({"fault_injection": spec, "allow_fault_injection": True})


def test_named_requests_get_their_fault_whatever_the_rate() -> None:
    spec = FaultInjection(request_ids={"s7": FaultKind.DROP_COMPLETION, "s9": FaultKind.STALL_READ})
    injector = FaultInjector(spec)
    assert injector.pick("cmpl-s7-step3-0") is FaultKind.DROP_COMPLETION
    assert injector.pick("cmpl-s9-0-1f2e") is FaultKind.STALL_READ
    assert injector.pick("cmpl-s8-step3-0") is None


def test_a_rate_picks_that_share_of_reads_repeatably() -> None:
    spec = FaultInjection(kinds=tuple(FaultKind), rate=0.1, seed=3)
    runs = [[injector.pick(f"r{i}") for i in range(2000)] for injector in (FaultInjector(spec), FaultInjector(spec))]
    assert runs[0] == runs[1]
    share = sum(p is not None for p in runs[0]) / 2000
    assert 0.08 < share < 0.12
    assert {p for p in runs[0] if p is not None} == set(FaultKind)
