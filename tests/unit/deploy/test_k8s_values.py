"""``kvpilot k8s render`` from a values file and flags: every ClusterSpec field settable,
stdout or ``--out``, dynamo.yaml's counts and TP, and a GAIE gateway's namespace let in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml

from kvpilot.deploy.cli import main
from kvpilot.deploy.k8s.plan import ClusterSpec, Transport
from kvpilot.deploy.k8s.render import DYNAMO, MANIFEST_DIR, overlays
from kvpilot.deploy.k8s.values import add_value_flags, cluster_spec, default_values, flag_name
from tests.unit.deploy.test_k8s import CUSTOM_GROUPS, K8S_VERSIONS

ROOT = Path(__file__).resolve().parents[3]
VALUES = ROOT / "deploy" / "k8s" / "values.yaml"
NAMESPACE = "kvpilot"

NOT_DEFAULT: dict[str, Any] = {
    "transport": "mnnvl",
    "namespace": "llm-serving",
    "prefill": 2,
    "decode": 3,
    "image": "registry.example/kvpilot:1",
    "dynamo_image": "registry.example/kvpilot-dynamo:1",
    "served_model_name": "qwen",
    "models_claim": "weights",
    "tensor_parallel_size": 2,
    "block_size": 16,
    "max_model_len": 32768,
    "rdma_resource": "rdma/hca",
    "net_devices": "mlx5_0:1,mlx5_1:1",
    "prometheus_labels": {"release": "prom"},
    "monitoring_namespace": "observability",
    "gateway_namespace": "gaie-gw",
}


def test_the_committed_values_file_is_every_field_at_its_default() -> None:
    assert VALUES.read_text() == default_values(), "run: kvpilot k8s values > deploy/k8s/values.yaml"
    assert set(yaml.safe_load(VALUES.read_text())) == {f.name for f in msgspec.structs.fields(ClusterSpec)}


def test_rendering_the_default_values_reproduces_the_committed_manifests(tmp_path: Path) -> None:
    assert main(["k8s", "render", "--values", str(VALUES), "--check"]) == 0
    assert main(["k8s", "render", "--values", str(VALUES), "--out", str(tmp_path)]) == 0
    for committed in MANIFEST_DIR.glob("*.yaml"):
        assert (tmp_path / committed.name).read_text() == committed.read_text(), committed.name


def test_every_field_is_a_values_key_and_every_scalar_a_flag(tmp_path: Path) -> None:
    assert set(NOT_DEFAULT) == {f.name for f in msgspec.structs.fields(ClusterSpec)}  # a new field needs a case here
    path = tmp_path / "values.json"  # JSON is YAML too
    path.write_text(json.dumps(NOT_DEFAULT))
    from kvpilot.deploy.k8s.values import load_values

    spec = cluster_spec(load_values(path))
    assert msgspec.to_builtins(spec) == NOT_DEFAULT
    import argparse

    parser = argparse.ArgumentParser()
    add_value_flags(parser)
    flags = [a for f, v in NOT_DEFAULT.items() if not isinstance(v, dict) for a in (flag_name(f), str(v))]
    assert msgspec.to_builtins(cluster_spec({}, parser.parse_args(flags))) == {
        **NOT_DEFAULT,
        "prometheus_labels": ClusterSpec().prometheus_labels,
    }
    override = cluster_spec(NOT_DEFAULT, parser.parse_args(["--decode", "5"]))
    assert (override.decode, override.prefill) == (5, 2)  # the flag over the file, the file over the default


@pytest.mark.parametrize(
    ("values", "flags", "named"),
    [
        ("colour: red\n", [], "colour: unknown key"),
        ("prefill: two\n", [], "prefill: Expected `int`, got `str`"),
        ("transport: tcp\n", [], "transport: "),
        ("image: ''\n", [], "image: must not be empty"),
        ("", ["--image", " "], "image: must not be empty"),
        ("", ["--tensor-parallel-size", "0"], "tensor_parallel_size: must be a finite number >= 1"),
        ("- 1\n", [], "must hold a mapping of cluster values, got list"),
        ("prometheus_labels: {release: 1}\n", [], "prometheus_labels"),
    ],
)
def test_a_wrong_value_is_refused_naming_its_key(
    values: str, flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(values)
    assert main(["k8s", "render", "--values", str(path), "--out", str(tmp_path / "out"), *flags]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("transport", list(Transport))
def test_without_out_base_and_the_transport_s_file_go_to_stdout(
    transport: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p.name: p.read_text() for p in MANIFEST_DIR.glob("*.yaml")}
    assert main(["k8s", "render", "--transport", transport.value]) == 0
    out = capsys.readouterr().out
    objects = [o for o in yaml.safe_load_all(out) if o is not None]
    expected = overlays(ClusterSpec(transport=transport))
    assert objects == [*expected["base"], *expected[transport.value]]  # what kubectl apply -f - takes
    assert {p.name: p.read_text() for p in MANIFEST_DIR.glob("*.yaml")} == before  # the package's files untouched


def test_dynamo_yaml_honours_the_counts_and_the_tensor_parallel_size() -> None:
    (graph,) = [
        o
        for o in overlays(ClusterSpec(prefill=2, decode=3, tensor_parallel_size=4))[DYNAMO]
        if o["kind"] == "DynamoGraphDeployment"
    ]
    services = graph["spec"]["services"]
    for service, replicas in (("VllmPrefillWorker", 2), ("VllmDecodeWorker", 3)):
        worker = services[service]
        assert worker["replicas"] == replicas
        assert worker["resources"]["limits"]["gpu"] == "4"
        args = worker["extraPodSpec"]["mainContainer"]["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "4"
        assert worker["extraPodSpec"]["mainContainer"]["image"] == ClusterSpec().dynamo_image


# ---- who may connect: the NetworkPolicies evaluated as Kubernetes does -----------------


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_admits(peer: dict[str, Any], namespace: str, labels: dict[str, str], own: str) -> bool:
    """A ``from`` entry: a podSelector alone means the policy's own namespace, ``own``."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    if "namespaceSelector" in peer:
        ok = _matches(peer["namespaceSelector"], ns_labels)
        return ok and ("podSelector" not in peer or _matches(peer["podSelector"], labels))
    return namespace == own and _matches(peer["podSelector"], labels)


def may_connect(objects: list[dict[str, Any]], namespace: str, labels: dict[str, str], target: str, port: str) -> bool:
    """Whether a pod (``namespace``, ``labels``) may open ``port`` (a port name) on the pod of
    Deployment ``target``: not selected by any policy, or admitted by one rule of one."""
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] == "Deployment"}
    target_labels = pods[target]["metadata"]["labels"]
    policies = [
        o for o in objects if o["kind"] == "NetworkPolicy" and _matches(o["spec"]["podSelector"], target_labels)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            if port not in [p["port"] for p in rule["ports"]]:
                continue
            own = policy["metadata"]["namespace"]
            if "from" not in rule or any(_peer_admits(peer, namespace, labels, own) for peer in rule["from"]):
                return True
    return False


GAIE_PROXY = {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}


@pytest.mark.parametrize("transport", list(Transport))
def test_a_gaie_gateway_in_its_namespace_is_let_in_and_a_stranger_is_not(transport: Transport) -> None:
    objects = overlays(ClusterSpec(gateway_namespace="gaie-gw"))[transport.value]
    for target, port in (("kvpilot-decode-0", "http"), ("kvpilot-prefill-0", "http"), ("kvpilot-router", "picker")):
        assert may_connect(objects, "gaie-gw", GAIE_PROXY, target, port), (target, port)
        assert not may_connect(objects, "stranger", GAIE_PROXY, target, port), (target, port)
        assert not may_connect(objects, NAMESPACE, {"app": "other"}, target, port), (target, port)
    for target, port in (("kvpilot-decode-0", "nixl"), ("kvpilot-decode-0", "kv-replay")):
        assert not may_connect(objects, "gaie-gw", GAIE_PROXY, target, port), (target, port)  # data plane closed
    router_events = [
        p["name"] for c in _router_containers(objects) for p in c["ports"] if p["name"].startswith("kv-events")
    ]
    assert router_events and not any(
        may_connect(objects, "gaie-gw", GAIE_PROXY, "kvpilot-router", p) for p in router_events
    )
    # without the setting, the same gateway stays out (the committed manifests)
    default = overlays(ClusterSpec())[transport.value]
    assert not may_connect(default, "gaie-gw", GAIE_PROXY, "kvpilot-decode-0", "http")
    assert not may_connect(default, "gaie-gw", GAIE_PROXY, "kvpilot-router", "picker")
    envoy = {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": "gateway"}
    assert may_connect(default, NAMESPACE, envoy, "kvpilot-router", "picker")  # the standalone Envoy


def _router_containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (router,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "kvpilot-router"]
    return list(router["spec"]["template"]["spec"]["containers"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_values_away_from_the_defaults_still_validate(version: str) -> None:
    spec = msgspec.convert(NOT_DEFAULT, ClusterSpec)
    checked = 0
    for objects in overlays(spec).values():
        for obj in objects:
            if not obj["apiVersion"].startswith(CUSTOM_GROUPS):
                kubernetes_validate.validate(obj, version, strict=True)
                checked += 1
    assert checked >= 15


def test_the_image_s_build_context_leaves_out_the_clone_s_own_state() -> None:
    """``docker build -f deploy/k8s/Dockerfile .`` sends the clone: not its virtual environment
    (gigabytes), its git history or what it built, but every file pip needs."""
    import fnmatch

    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and p[0] != "#"]

    def ignored(path: str) -> bool:
        """Docker's rule, for the patterns used: a pattern names a path from the context's
        root (or, after ``**/``, at any depth), and excludes everything under it."""
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for pattern in patterns:
            if pattern.startswith("**/"):
                if any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts):
                    return True
            elif any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
                return True
        return False

    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "build/lib/x.py",
        "routing/__pycache__/a.txt",
        "policies/a.pyc",
        "kvpilot.egg-info/PKG-INFO",
    ):
        assert ignored(path), path
    for path in (
        "pyproject.toml",
        "README.md",
        "routing/cli.py",
        "deploy/recipes/kv-transfer-config.json",
        "grafana/alerts.yml",
    ):
        assert not ignored(path), path


def test_every_object_lives_in_the_namespace_the_values_name() -> None:
    spec = ClusterSpec(namespace="llm-serving", gateway_namespace="gaie-gw")
    files = overlays(spec)
    (created,) = [o for o in files["base"] if o["kind"] == "Namespace"]
    assert created["metadata"] == {"name": "llm-serving", "labels": {"kubernetes.io/metadata.name": "llm-serving"}}
    for objects in files.values():
        for obj in objects:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == "llm-serving", (obj["kind"], obj["metadata"]["name"])
    (monitor,) = [o for o in files["base"] if o["kind"] == "ServiceMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm-serving"]}
    rdma = files[Transport.RDMA.value]
    (envoy,) = [o for o in rdma if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvpilot-gateway-config"]
    assert "kvpilot-router.llm-serving.svc.cluster.local" in envoy["data"]["envoy.yaml"]
    envoy_pod = {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": "gateway"}
    assert may_connect(rdma, "llm-serving", envoy_pod, "kvpilot-router", "picker")
    assert not may_connect(rdma, NAMESPACE, envoy_pod, "kvpilot-router", "picker")  # the default's name: another one
    assert may_connect(rdma, "gaie-gw", GAIE_PROXY, "kvpilot-decode-0", "http")


@pytest.mark.parametrize("bad", ["LLM", "-x", "a_b", "x" * 64, ""])
def test_a_namespace_kubernetes_would_refuse_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="namespace: must be a DNS label"):
        ClusterSpec(namespace=bad)
