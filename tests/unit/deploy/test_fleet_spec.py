from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.fleet_spec import FleetSpec, Role, plan_fleet


def _spec(**kw) -> FleetSpec:
    return FleetSpec(model_dir=Path("/m"), run_dir=Path("/r"), cores=2, **kw)


def test_plan_gives_each_engine_its_ports_core_and_connector() -> None:
    engines, router = plan_fleet(_spec(prefill=1, decode=2))
    assert [e.name for e in engines] == ["prefill-0", "decode-0", "decode-1"]
    assert [e.port for e in engines] == [8100, 8101, 8102]
    assert [e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in engines] == ["5600", "5601", "5602"]
    assert [e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in engines] == ["0", "1", "0"]
    for e in engines:
        argv = list(e.argv)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "KVPilotConnector" and "kv_connector_module_path" not in kv
        assert e.env["UCX_NET_DEVICES"] == "lo" and e.env["PYTHONHASHSEED"] == "0"
    assert router.argv.count("--prefill") == 1 and router.argv.count("--decode") == 2
    assert "127.0.0.1" in router.argv


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prefill": 1, "decode": 0}, "needs at least one decode"),
        ({"prefill": 0, "decode": 0}, "at least one decode or co-located"),
        ({"block_size": 16}, "multiple of 32"),
        ({"prefill": -1}, ">= 0"),
    ],
)
def test_invalid_fleets_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**kw)


def test_roles_are_named() -> None:
    engines, _ = plan_fleet(_spec(prefill=0, decode=0, colocated=1))
    assert engines[0].role is Role.COLOCATED
