"""The metric names kvpilot reads from an engine: each one the installed vLLM (or
kvpilot's own connector) really registers, with the kind the module gives it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpilot.kvconnectors import vllm_metrics as vm

# prometheus_client's type of each family class.
KINDS = {vm.GaugeFamily: "gauge", vm.CounterFamily: "counter", vm.HistogramFamily: "histogram"}
LABELS = (["model_name", "engine"], {0: ["tiny", "0"]})
CONFIG = SimpleNamespace(kv_transfer_config=None)
"""What a connector's metrics read of the VllmConfig (``KVConnectorPromMetrics.__init__``)."""


def _recorder(registered: dict[str, str]) -> dict[type, type]:
    """``metric_types`` for vLLM's metric seams: prometheus_client's classes that
    record each family's base name and type and register nowhere."""
    from prometheus_client import Counter, Gauge, Histogram

    def recording(base: type) -> type:
        class Recording(base):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                if "name" in kwargs:  # a family; .labels() builds children positionally
                    registered[kwargs["name"]] = base._type
                super().__init__(*args, **{**kwargs, "registry": None})

        return Recording

    return {kind: recording(kind) for kind in (Gauge, Counter, Histogram)}


@pytest.fixture(scope="module")
def vllm_registers() -> dict[str, str]:
    """Every family (base name -> type) vLLM's ``PrometheusStatLogger`` and
    ``NixlPromMetrics`` register, built through the class attributes and the
    ``metric_types`` vLLM gives subclasses and connectors to choose their classes."""
    pytest.importorskip("vllm")
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from kvpilot.deploy.tiny_model import ensure_tiny_model

    registered: dict[str, str] = {}
    types = _recorder(registered)

    class RecordingStatLogger(PrometheusStatLogger):
        _gauge_cls = types[Gauge]
        _counter_cls = types[Counter]
        _histogram_cls = types[Histogram]

    RecordingStatLogger(EngineArgs(model=str(ensure_tiny_model()), enforce_eager=True).create_engine_config())
    NixlPromMetrics(CONFIG, types, *LABELS)
    return registered


@pytest.mark.parametrize("family", vm.VLLM_FAMILIES + vm.NIXL_FAMILIES, ids=lambda f: f.name)
def test_vllm_registers_each_family_with_its_kind(vllm_registers: dict[str, str], family: vm.Family) -> None:
    assert vllm_registers.get(family.name) == KINDS[type(family)]


def test_the_recorder_sees_what_vllm_registers(vllm_registers: dict[str, str]) -> None:
    """Not vacuous: vLLM's families beyond the ones kvpilot reads were seen too."""
    assert vllm_registers["vllm:time_to_first_token_seconds"] == "histogram"
    assert len(vllm_registers) > len(vm.VLLM_FAMILIES) + len(vm.NIXL_FAMILIES)


def test_the_prompt_token_sources_are_vllms() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.metrics.stats import PromptTokenStats

    assert tuple(source.value for source in vm.PromptTokenSource) == PromptTokenStats.ALL_SOURCES


def test_kvpilots_connector_registers_exactly_its_families_as_counters() -> None:
    pytest.importorskip("vllm")
    from kvpilot.kvconnectors.stats import COUNTERS, KVPilotPromMetrics

    registered: dict[str, str] = {}
    types = _recorder(registered)
    KVPilotPromMetrics(CONFIG, types, *LABELS, inner=None)
    assert registered == {family.name: "counter" for family in vm.KVPILOT_FAMILIES}
    assert tuple(spec.metric for spec in COUNTERS) == vm.KVPILOT_FAMILIES


@pytest.mark.parametrize(
    ("family", "series"),
    [
        (vm.GaugeFamily("vllm:g"), {"sample": "vllm:g"}),
        (vm.CounterFamily("vllm:c"), {"total": "vllm:c_total"}),
        (vm.HistogramFamily("vllm:h"), {"bucket": "vllm:h_bucket", "sum": "vllm:h_sum", "count": "vllm:h_count"}),
    ],
)
def test_each_kind_exposes_its_prometheus_series(family: vm.Family, series: dict[str, str]) -> None:
    assert {attr: getattr(family, attr) for attr in series} == series


def test_every_name_is_in_vllms_namespace_and_defined_once() -> None:
    families = vm.VLLM_FAMILIES + vm.NIXL_FAMILIES + vm.KVPILOT_FAMILIES
    assert all(family.name.startswith("vllm:") for family in families)
    assert len({family.name for family in families}) == len(families)
    defined = {value.name for value in vars(vm).values() if isinstance(value, tuple(KINDS))}
    assert defined == {family.name for family in families}, "every family constant is in one of the tuples"
