"""The Kubernetes render routes by pod address, for any number of engines: one target port
for the InferencePool (GAIE reads its ``targetPorts`` as ports every selected pod serves),
headless engine Services (their names resolve to the pods' IPs, which the picker names to
Envoy), and a clear error past what one router's plan holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml

from kvpilot.deploy.cli import main
from kvpilot.deploy.k8s.plan import ENGINE_PORT, MAX_ENGINES, ClusterSpec, Transport
from kvpilot.deploy.k8s.render import DEFAULT, overlays

CRDS = Path(__file__).resolve().parents[4] / "shared" / "crds"
POOL_CRD = CRDS / "inference.networking.k8s.io_inferencepools.yaml"


def _kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _pool_schema() -> dict[str, Any]:
    (crd,) = [d for d in yaml.safe_load_all(POOL_CRD.read_text()) if d]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return dict(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (2, 9), (3, 40), (1, MAX_ENGINES - 1)])
def test_every_count_renders_one_pool_port_that_every_decode_pod_serves(prefill: int, decode: int) -> None:
    spec = msgspec.structs.replace(DEFAULT, prefill=prefill, decode=decode)
    for transport in Transport:
        objects = overlays(msgspec.structs.replace(spec, transport=transport))[transport.value]
        (pool,) = _kind(objects, "InferencePool")
        assert pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
        selector = pool["spec"]["selector"]["matchLabels"]
        pods = [d["spec"]["template"] for d in _kind(objects, "Deployment")]
        pooled = [p for p in pods if all(p["metadata"]["labels"].get(k) == v for k, v in selector.items())]
        assert len(pooled) == decode
        for pod in pooled:
            (container,) = pod["spec"]["containers"]
            assert {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"} in container["ports"]
        if POOL_CRD.is_file():
            jsonschema.Draft202012Validator(_pool_schema()).validate(pool)


def test_engine_services_are_headless_so_their_names_resolve_to_pods() -> None:
    objects = overlays(msgspec.structs.replace(DEFAULT, prefill=2, decode=3))[Transport.RDMA.value]
    services = {s["metadata"]["name"]: s for s in _kind(objects, "Service")}
    (config_map,) = [c for c in _kind(objects, "ConfigMap") if c["metadata"]["name"] == "kvpilot-router-config"]
    workers = yaml.safe_load(config_map["data"]["router.yaml"])["workers"]
    assert len(workers) == 5
    for worker in workers:
        service = services[f"kvpilot-{worker['name']}"]
        assert service["spec"]["clusterIP"] == "None"
        assert worker["url"] == f"http://kvpilot-{worker['name']}:{ENGINE_PORT}"
        assert {"name": "http", "port": ENGINE_PORT, "targetPort": "http"} in service["spec"]["ports"]
    # the router and the gateway keep a virtual IP: clients and Envoy reach them through it
    assert "clusterIP" not in services["kvpilot-router"]["spec"]
    assert "clusterIP" not in services["kvpilot-gateway"]["spec"]


def test_the_command_renders_nine_decode_engines_and_refuses_too_many_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["k8s", "render", "--out", str(tmp_path / "nine"), "--decode", "9"]) == 0
    (pool,) = _kind(list(yaml.safe_load_all((tmp_path / "nine" / "rdma.yaml").read_text())), "InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
    capsys.readouterr()
    assert main(["k8s", "render", "--out", str(tmp_path / "many"), "--decode", str(MAX_ENGINES)]) == 2
    err = capsys.readouterr().err
    assert f"at most {MAX_ENGINES} engines" in err and "Traceback" not in err
    assert not (tmp_path / "many").exists()
    with pytest.raises(ValueError, match=f"at most {MAX_ENGINES} engines"):
        ClusterSpec(Transport.RDMA, prefill=1, decode=MAX_ENGINES)
