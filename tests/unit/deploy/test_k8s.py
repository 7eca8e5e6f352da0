"""deploy/k8s: every manifest renders, validates against Kubernetes' schemas (and, where
the CRDs are laid in shared/crds/, the custom resources against their CRDs), carries the
CPU fleet's flags and environment, and its NetworkPolicies select the pods they name. No
cluster, no network."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from kvpilot.deploy.dashboards import DASHBOARD_DIR
from kvpilot.deploy.fleet_spec import ENGINE_API_KEY_ENV, plan_fleet
from kvpilot.deploy.k8s.dynamo import FRONTEND_PORT, GRAPH, KV_EVENTS_PORT, WORKER_ROLES, dynamo_kv_transfer_config
from kvpilot.deploy.k8s.network import pods_of
from kvpilot.deploy.k8s.plan import (
    CPU_ONLY_ENV,
    CPU_ONLY_FLAGS,
    ENGINE_PORT,
    ROUTER_API_KEY_ENV,
    SIDE_CHANNEL_HOST_ENV,
    ClusterSpec,
    Transport,
)
from kvpilot.deploy.k8s.render import BASE, DEFAULT, DYNAMO, MANIFEST_DIR, overlays, render
from kvpilot.deploy.observe import DEFAULT_RULES
from kvpilot.routing.config_load import load_config

ROOT = Path(__file__).resolve().parents[3]
CRDS = Path(__file__).resolve().parents[4] / "shared" / "crds"
"""Third-party CRDs are not committed here (only the steering repo's shared/ may hold
fetched data): prometheus-operator's ``monitoring.coreos.com_servicemonitors.yaml`` and
``monitoring.coreos.com_prometheusrules.yaml`` (v0.93.0, ``example/prometheus-operator-crd/``)
and ai-dynamo/dynamo's ``nvidia.com_dynamographdeployments.yaml``
(``deploy/cloud/operator/config/crd/bases/``), laid there as they are."""
K8S_VERSIONS = ("1.29", "1.33", "1.37")
"""The supported range's ends and middle: kubernetes-validate 1.37.0 ships 1.25-1.37."""
CUSTOM_GROUPS = ("monitoring.coreos.com/", "nvidia.com/", "inference.networking.k8s.io/", "gateway.networking.k8s.io/")
OVERLAYS = overlays(DEFAULT)


def _all() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, objects in OVERLAYS.items():
        for obj in objects:
            yield name, obj


def _kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _by_name(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in _kind(objects, kind)}


def _flags(argv: list[str] | tuple[str, ...]) -> dict[str, str | None]:
    """``--flag value`` pairs (``None`` for a flag given alone) after ``python -m module`` or
    ``vllm serve MODEL``."""
    out: dict[str, str | None] = {}
    rest = list(argv[3:])
    while rest:
        flag = rest.pop(0)
        assert flag.startswith("--"), flag
        out[flag] = rest.pop(0) if rest and not rest[0].startswith("--") else None
    return out


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # the only form rendered
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_committed_manifests_are_what_the_code_renders() -> None:
    files = render(DEFAULT)
    assert sorted(files) == sorted(p.name for p in MANIFEST_DIR.glob("*.yaml"))
    for name, text in files.items():
        assert (MANIFEST_DIR / name).read_text() == text, (
            f"run: kvpilot k8s render --out deploy/k8s/manifests ({name} is stale)"
        )
    # and the committed YAML reads back as the objects
    assert list(yaml.safe_load_all((MANIFEST_DIR / "rdma.yaml").read_text())) == OVERLAYS[Transport.RDMA.value]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_kubernetes_schemas(version: str) -> None:
    checked = 0
    for _, obj in _all():
        if not obj["apiVersion"].startswith(CUSTOM_GROUPS):
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked >= 15
    broken = copy.deepcopy(_kind(OVERLAYS[Transport.RDMA.value], "Deployment")[0])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: a misspelt field fails
        kubernetes_validate.validate(broken, version, strict=True)


def _strict(schema: Any) -> Any:
    """``schema`` with unknown fields refused wherever Kubernetes would prune them
    (kubectl's default field validation, Strict, refuses them too), and Go's leading
    inline regex flags (``^(?i)...``) moved where Python's ``re`` takes them."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if isinstance(schema.get("pattern"), str):
            schema["pattern"] = re.sub(r"^\^\(\?([a-z]+)\)", r"(?\1)^", schema["pattern"])
        prunes = "properties" in schema and "additionalProperties" not in schema
        if prunes and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_schema(path: Path, version: str) -> dict[str, Any]:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _strict(served["schema"]["openAPIV3Schema"])


CRD_FILES = (
    "monitoring.coreos.com_servicemonitors.yaml",
    "monitoring.coreos.com_prometheusrules.yaml",
    "nvidia.com_dynamographdeployments.yaml",
    "inference.networking.k8s.io_inferencepools.yaml",
    "gateway.networking.k8s.io_httproutes.yaml",
)
VALIDATORS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): lambda: _crd_schema(
        CRDS / "monitoring.coreos.com_servicemonitors.yaml", "v1"
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): lambda: _crd_schema(
        CRDS / "monitoring.coreos.com_prometheusrules.yaml", "v1"
    ),
    ("nvidia.com/v1alpha1", "DynamoGraphDeployment"): lambda: _crd_schema(
        CRDS / "nvidia.com_dynamographdeployments.yaml", "v1alpha1"
    ),
    ("inference.networking.k8s.io/v1", "InferencePool"): lambda: _crd_schema(
        CRDS / "inference.networking.k8s.io_inferencepools.yaml", "v1"
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): lambda: _crd_schema(
        CRDS / "gateway.networking.k8s.io_httproutes.yaml", "v1"
    ),
}


def test_custom_resources_validate_against_their_crd_schemas() -> None:
    missing = [name for name in CRD_FILES if not (CRDS / name).is_file()]
    if missing:
        pytest.skip(f"CRD schemas not laid in {CRDS}: {', '.join(missing)} (see CRDS)")
    schemas = {key: load() for key, load in VALIDATORS.items()}
    custom = [obj for _, obj in _all() if obj["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert {(o["apiVersion"], o["kind"]) for o in custom} == set(schemas)
    # Draft 2020-12 without its meta-schema check (seconds on Dynamo's schema): the
    # vendored schemas are Kubernetes-accepted OpenAPI v3, a subset it reads alike.
    validators = {key: jsonschema.Draft202012Validator(schema) for key, schema in schemas.items()}
    for obj in custom:
        validators[obj["apiVersion"], obj["kind"]].validate(obj)
    (graph,) = _kind(custom, "DynamoGraphDeployment")
    broken = copy.deepcopy(graph)
    broken["spec"]["services"]["Frontend"]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validators["nvidia.com/v1alpha1", "DynamoGraphDeployment"].validate(broken)


@pytest.mark.parametrize("transport", list(Transport))
def test_engines_carry_the_cpu_fleets_flags_and_env(transport: Transport) -> None:
    spec = msgspec.structs.replace(DEFAULT, transport=transport)
    cpu_engines, _, _ = plan_fleet(spec.fleet_spec)
    deployments = _by_name(OVERLAYS[transport.value], "Deployment")
    for cpu in cpu_engines:
        (container,) = deployments[f"kvpilot-{cpu.name}"]["spec"]["template"]["spec"]["containers"]
        assert container["image"] == spec.image
        cpu_flags, pod_flags = _flags(cpu.argv), _flags(container["command"])
        assert container["command"][:3] == ["vllm", "serve", cpu_flags["--model"]]  # vLLM's console script
        changed = {"--model", "--host", "--port", "--kv-transfer-config", "--kv-events-config"}
        for flag, value in cpu_flags.items():
            if flag in CPU_ONLY_FLAGS:
                assert flag not in pod_flags
            elif flag not in changed:
                assert pod_flags[flag] == value, flag
        assert pod_flags["--host"] == "0.0.0.0" and pod_flags["--port"] == str(ENGINE_PORT)  # one port, any pod
        cpu_kv, pod_kv = (json.loads(f["--kv-transfer-config"] or "") for f in (cpu_flags, pod_flags))
        assert pod_kv == {**cpu_kv, "kv_buffer_device": "cuda"}
        assert pod_kv["kv_connector"] == "KVPilotConnector"
        cpu_events, pod_events = (json.loads(f["--kv-events-config"] or "") for f in (cpu_flags, pod_flags))
        assert pod_events["endpoint"] == "tcp://kvpilot-router:" + cpu_events["endpoint"].rsplit(":", 1)[1]
        assert pod_events["replay_endpoint"] == "tcp://*:" + cpu_events["replay_endpoint"].rsplit(":", 1)[1]
        assert {k: v for k, v in pod_events.items() if "endpoint" not in k} == {
            k: v for k, v in cpu_events.items() if "endpoint" not in k
        }
        extra = set(pod_flags) - set(cpu_flags)
        assert extra == {"--tensor-parallel-size", *(["--enable-sleep-mode"] if transport is Transport.MNNVL else [])}

        env = _env(container)
        for name, value in cpu.env.items():
            if name == "VLLM_API_KEY":
                assert env[name] == {"secretKeyRef": {"name": "kvpilot-api-keys", "key": "engine"}}
            elif name in CPU_ONLY_ENV:
                assert name not in env or name in (*spec.transport_env(), SIDE_CHANNEL_HOST_ENV), name
            else:
                assert env[name] == value, name
        assert env["PYTHONHASHSEED"] == "0"
        assert env[SIDE_CHANNEL_HOST_ENV] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert {k: env[k] for k in spec.transport_env()} == spec.transport_env()
        assert ("UCX_CUDA_IPC_ENABLE_MNNVL" in env) is (transport is Transport.MNNVL)
        assert "lo" not in env["UCX_NET_DEVICES"]

        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": ENGINE_PORT, "nixl": cpu.side_ports[0], "kv-replay": cpu.side_ports[1]}
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == str(spec.tensor_parallel_size) and limits[spec.rdma_resource] == "1"


def test_the_image_is_built_on_the_gpu_extras_vllm() -> None:
    dockerfile = (ROOT / "deploy" / "k8s" / "Dockerfile").read_text()
    (base,) = [line.split("=", 1)[1] for line in dockerfile.splitlines() if line.startswith("ARG BASE=")]
    assert base.startswith("vllm/vllm-openai:v")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (vllm,) = [Requirement(r) for r in extras["gpu"] if Requirement(r).name == "vllm"]
    assert Version(base.split(":v", 1)[1]) in vllm.specifier
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert DEFAULT.image == f"kvpilot:{project['version']}"


def test_make_image_builds_the_image_the_manifests_name() -> None:
    """``make image`` (dry run: no Docker daemon here) builds the Dockerfile into the tag the
    default values name, and ``BASE=`` swaps the base image."""
    dry = subprocess.run(["make", "-s", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert dry.stdout.split() == ["docker", "build", "-f", "deploy/k8s/Dockerfile", "-t", DEFAULT.image, "."]
    other = subprocess.run(["make", "-s", "-n", "image", "BASE=b:1"], cwd=ROOT, capture_output=True, text=True)
    assert "--build-arg BASE=b:1 -t " + DEFAULT.image in other.stdout


@pytest.mark.parametrize("transport", list(Transport))
def test_router_runs_the_cpu_fleets_command_with_a_valid_config(transport: Transport, tmp_path: Path) -> None:
    objects = OVERLAYS[transport.value]
    _, cpu_router, cpu_config = plan_fleet(DEFAULT.fleet_spec)
    (container,) = _by_name(objects, "Deployment")["kvpilot-router"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python3", *cpu_router.argv[1:]]
    path = tmp_path / "router.yaml"
    path.write_text(_by_name(objects, "ConfigMap")["kvpilot-router-config"]["data"]["router.yaml"])
    config = load_config(path)
    assert config.server.host == "0.0.0.0" and config.server.port == cpu_router.port
    env = _env(container)
    assert env[config.server.api_key_env] == {"secretKeyRef": {"name": "kvpilot-api-keys", "key": "router"}}
    assert config.server.api_key_env == ROUTER_API_KEY_ENV and config.server.engine_api_key_env == ENGINE_API_KEY_ENV
    # the router sends the key the engines check
    assert env[ENGINE_API_KEY_ENV] == {"secretKeyRef": {"name": "kvpilot-api-keys", "key": "engine"}}
    services = _by_name(objects, "Service")
    router_ports = {p["port"] for p in services["kvpilot-router"]["spec"]["ports"]}
    assert [w.name for w in config.workers] == [w["name"] for w in cpu_config["workers"]]  # type: ignore[attr-defined]
    for worker in config.workers:
        service = services[f"kvpilot-{worker.name}"]
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert worker.url == f"http://kvpilot-{worker.name}:{ports['http']}"
        assert worker.replay_endpoint == f"tcp://kvpilot-{worker.name}:{ports['kv-replay']}"
        assert worker.kv_events_endpoint is not None and worker.kv_events_endpoint.startswith("tcp://0.0.0.0:")
        assert int(worker.kv_events_endpoint.rsplit(":", 1)[1]) in router_ports  # engines connect, router binds
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in _kind(objects, "Deployment")}


def _port_names(pod: dict[str, Any]) -> set[str]:
    return {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}


@pytest.mark.parametrize("transport", list(Transport))
def test_network_policies_select_the_pods_they_name(transport: Transport) -> None:
    objects = OVERLAYS[transport.value]
    pods = _pods(objects)
    engines = {n for n in pods if n not in ("kvpilot-router", "kvpilot-gateway")}
    assert len(engines) == DEFAULT.prefill + DEFAULT.decode

    def selected(selector: dict[str, Any]) -> set[str]:
        return {n for n, pod in pods.items() if _selects(selector, pod["metadata"]["labels"])}

    policies = _by_name(objects, "NetworkPolicy")
    reach: dict[tuple[str, str], set[str]] = {}
    """(target pod, port name) -> who is let in: pod names, or ``ns:<namespace>``, or ``*``."""
    for policy in policies.values():
        targets = selected(policy["spec"]["podSelector"])
        assert targets and policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            peers: set[str] = set()
            for peer in rule.get("from", [{"*": None}]):
                if "podSelector" in peer:
                    assert selected(peer["podSelector"]), peer
                    peers |= selected(peer["podSelector"])
                elif "namespaceSelector" in peer:
                    peers.add("ns:" + peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
                else:
                    peers.add("*")
            for port in rule["ports"]:
                for target in targets:
                    assert port["port"] in _port_names(pods[target]), (target, port)
                    reach.setdefault((target, port["port"]), set()).update(peers)
    assert reach["kvpilot-router", "picker"] == {"kvpilot-gateway"}  # no stranger forges access-log records
    for engine in engines:
        assert reach[engine, "http"] == {"kvpilot-router", "kvpilot-gateway", "ns:monitoring"}
        assert reach[engine, "kv-replay"] == {"kvpilot-router"}
        assert reach[engine, "nixl"] == engines
    router_events = {p for p in _port_names(pods["kvpilot-router"]) if p.startswith("kv-events-")}
    assert len(router_events) == len(engines)
    assert all(reach["kvpilot-router", p] == engines for p in router_events)
    assert reach["kvpilot-router", "http"] == {"*"}
    assert selected(pods_of("router")) == {"kvpilot-router"}


def test_service_monitor_rule_and_dashboards() -> None:
    base = OVERLAYS[BASE]
    (monitor,) = _kind(base, "ServiceMonitor")
    (rule,) = _kind(base, "PrometheusRule")
    for transport in Transport:
        services = _kind(OVERLAYS[transport.value], "Service")
        scraped = [s for s in services if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert len(scraped) == len(services) - 1 == DEFAULT.prefill + DEFAULT.decode + 1  # all but Envoy's
        assert all("http" in {p["name"] for p in s["spec"]["ports"]} for s in scraped)
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert rule["spec"]["groups"] == yaml.safe_load(DEFAULT_RULES.read_text())["groups"]
    assert sum(len(g["rules"]) for g in rule["spec"]["groups"]) >= 8
    dashboards = [c for c in _kind(base, "ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    files = sorted(DASHBOARD_DIR.glob("*.json"))
    assert [next(iter(c["data"])) for c in dashboards] == [p.name for p in files]
    for config_map, path in zip(dashboards, files, strict=True):
        assert json.loads(config_map["data"][path.name]) == json.loads(path.read_text())


def test_dynamo_example_routes_dynamo_vllm_workers_with_kvpilots_connector(tmp_path: Path) -> None:
    objects = OVERLAYS[DYNAMO]
    (graph,) = _kind(objects, "DynamoGraphDeployment")
    services = graph["spec"]["services"]
    frontend = services["Frontend"]["extraPodSpec"]["mainContainer"]
    assert frontend["command"] == ["python3", "-m", "dynamo.frontend"]
    assert _flags(["", "", "", *frontend["args"]])["--router-mode"] == "direct"
    (engine,) = [
        d for d in _kind(OVERLAYS[Transport.RDMA.value], "Deployment") if d["metadata"]["name"].endswith("prefill-0")
    ]
    engine_flags = _flags(engine["spec"]["template"]["spec"]["containers"][0]["command"])
    for service, mode in WORKER_ROLES.items():
        assert services[service]["subComponentType"] == mode
        worker = services[service]["extraPodSpec"]["mainContainer"]
        assert worker["command"] == ["python3", "-m", "dynamo.vllm"]
        flags = _flags(["", "", "", *worker["args"]])
        assert flags["--disaggregation-mode"] == mode
        # the engines' config under the name Dynamo's handoff table knows (tests/unit/kvconnectors/test_dynamo_seam.py)
        assert flags["--kv-transfer-config"] == dynamo_kv_transfer_config(engine_flags["--kv-transfer-config"] or "")
        assert flags["--block-size"] == engine_flags["--block-size"]
        assert json.loads(flags["--kv-events-config"] or "")["endpoint"] == f"tcp://*:{KV_EVENTS_PORT}"
        assert _env(worker)["PYTHONHASHSEED"] == "0"
    path = tmp_path / "router.yaml"
    path.write_text(_by_name(objects, "ConfigMap")["kvpilot-router-config"]["data"]["router.yaml"])
    config = load_config(path)
    assert config.dynamo.frontend_url == f"http://{GRAPH}-frontend:{FRONTEND_PORT}"
    assert config.dynamo.kv_events_port == KV_EVENTS_PORT and config.dynamo.discovery_backend.value == "kubernetes"
    assert config.disaggregation.max_local_tokens == 0 and not config.workers


def test_other_counts_render_one_engine_each_and_the_router_names_them_all() -> None:
    spec = msgspec.structs.replace(DEFAULT, prefill=2, decode=3, tensor_parallel_size=4)
    objects = overlays(spec)[Transport.RDMA.value]
    names = sorted(_by_name(objects, "Deployment"))
    assert names == sorted(
        [
            "kvpilot-router",
            "kvpilot-gateway",
            *(f"kvpilot-prefill-{i}" for i in range(2)),
            *(f"kvpilot-decode-{i}" for i in range(3)),
        ]
    )
    config = yaml.safe_load(_by_name(objects, "ConfigMap")["kvpilot-router-config"]["data"]["router.yaml"])
    assert [w["name"] for w in config["workers"]] == [
        *(f"prefill-{i}" for i in range(2)),
        *(f"decode-{i}" for i in range(3)),
    ]
    engine = _by_name(objects, "Deployment")["kvpilot-decode-2"]["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert _flags(engine["command"])["--tensor-parallel-size"] == "4"
    with pytest.raises(ValueError, match="at least one prefill"):
        ClusterSpec(Transport.RDMA, prefill=0)


def test_render_check_reports_a_stale_file(tmp_path: Path) -> None:
    from kvpilot.deploy.cli import main

    assert main(["k8s", "render", "--out", str(tmp_path)]) == 0
    assert main(["k8s", "render", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "base.yaml").write_text("stale\n")
    assert main(["k8s", "render", "--out", str(tmp_path), "--check"]) == 1


def test_envoy_and_a_gaie_gateway_reach_the_router_s_picker() -> None:
    objects = OVERLAYS[Transport.RDMA.value]
    router_config = yaml.safe_load(_by_name(objects, "ConfigMap")["kvpilot-router-config"]["data"]["router.yaml"])
    picker_port = router_config["gateway"]["picker_port"]
    (router_service,) = [s for s in _kind(objects, "Service") if s["metadata"]["name"] == "kvpilot-router"]
    assert {"name": "picker", "port": picker_port, "targetPort": "picker", "appProtocol": "kubernetes.io/h2c"} in (
        router_service["spec"]["ports"]
    )
    (pool,) = _kind(objects, "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "kvpilot-router",
        "port": {"number": picker_port},
        "failureMode": "FailClose",
    }
    pods = _pods(objects)
    pooled = {n for n, pod in pods.items() if _selects(pool["spec"]["selector"], pod["metadata"]["labels"])}
    assert pooled == {"kvpilot-decode-0"}  # the destinations the picker names
    (route,) = _kind(objects, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    bootstrap = yaml.safe_load(_by_name(objects, "ConfigMap")["kvpilot-gateway-config"]["data"]["envoy.yaml"])
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"  # admin on the pod's loopback
    picker = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvpilot_picker")
    (endpoint,) = picker["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert picker["type"] == "STRICT_DNS"
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": "kvpilot-router.kvpilot.svc.cluster.local",
        "port_value": picker_port,
    }
