"""Render the manifests: ``kvpilot k8s render`` writes the committed defaults to
``deploy/k8s/manifests/``; with counts, image or model it writes a fleet of one's own
to ``--out``; ``--check`` says whether the committed files are what the code renders.

Files: ``base.yaml`` (namespace, API-key Secret, ServiceMonitor, PrometheusRule,
dashboards), one per :class:`~kvpilot.deploy.k8s.plan.Transport` (the P/D engines, the router and
its picker, Envoy in front, the InferencePool and HTTPRoute for a GAIE gateway, the
NetworkPolicies), and ``dynamo.yaml`` (the DynamoGraphDeployment example with the
router). Apply ``base.yaml`` and one of the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import yaml

from kvpilot.deploy.k8s.dynamo import dynamo_example
from kvpilot.deploy.k8s.gateway import gateway_objects
from kvpilot.deploy.k8s.network import network_policies
from kvpilot.deploy.k8s.objects import Obj
from kvpilot.deploy.k8s.observability import observability
from kvpilot.deploy.k8s.plan import ClusterSpec, Transport, plan_cluster
from kvpilot.deploy.k8s.workloads import api_keys_secret, namespace, workloads

MANIFEST_DIR = Path(__file__).resolve().parent / "manifests"
BASE = "base"
DEFAULT = ClusterSpec(Transport.RDMA)
DYNAMO = "dynamo"


def overlays(spec: ClusterSpec) -> dict[str, list[Obj]]:
    """Each file's objects, by file stem: the base, one per transport, Dynamo's example.
    ``spec.transport`` is replaced by each transport in turn."""
    out = {BASE: [namespace(), api_keys_secret(), *observability(spec)]}
    for transport in Transport:
        plan = plan_cluster(dataclasses.replace(spec, transport=transport))
        out[transport.value] = [*workloads(plan), *gateway_objects(plan), *network_policies(plan)]
    out[DYNAMO] = dynamo_example(plan_cluster(spec))
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the router's config, dashboards) as literal blocks; no
    anchors (each object reads alone); long lines (JSON flags) unfolded."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _str)


def to_yaml(objects: list[Obj]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=4096)


def render(spec: ClusterSpec) -> dict[str, str]:
    """Each file's text, by file name."""
    return {f"{stem}.yaml": to_yaml(objects) for stem, objects in overlays(spec).items()}


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``k8s render`` to a ``kvpilot`` subparsers object."""
    k8s = subparsers.add_parser(
        "k8s",
        help="Kubernetes manifests",
        description="Kubernetes manifests for a GPU fleet (docs/guides/kubernetes.md).",
    )
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True)
    parser = k8s_sub.add_parser(
        "render",
        help="render the manifests",
        description="Render the Kubernetes manifests (base.yaml, one file per transport, dynamo.yaml) for a fleet; "
        "with --check, only compare them with the files in --out.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="the folder the YAML files are written to (default: the package's deploy/k8s/manifests)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from what is rendered")
    parser.add_argument("--prefill", type=int, default=1, help="prefill engines (one GPU pod each)")
    parser.add_argument("--decode", type=int, default=1, help="decode engines (one GPU pod each)")
    parser.add_argument("--image", default=DEFAULT.image, help="the engines' and the router's container image")
    parser.add_argument("--served-model-name", default=DEFAULT.served_model_name, help="the model name clients send")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=DEFAULT.tensor_parallel_size, help="GPUs per engine"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``kvpilot k8s render``: write the manifests, or with ``--check`` only compare; 2
    for counts that cannot be planned (the reason on stderr)."""
    try:
        spec = dataclasses.replace(
            DEFAULT,
            prefill=args.prefill,
            decode=args.decode,
            image=args.image,
            served_model_name=args.served_model_name,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except ValueError as exc:
        print(f"kvpilot k8s render: {exc}", file=sys.stderr)
        return 2
    files = render(spec)
    out: Path = args.out if args.out is not None else MANIFEST_DIR
    if args.check:
        stale = [name for name, text in files.items() if not (out / name).is_file() or (out / name).read_text() != text]
        for name in stale:
            print(f"{out / name} is not what `kvpilot k8s render` renders", file=sys.stderr)
        return 1 if stale else 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        print(out / name)
    return 0
