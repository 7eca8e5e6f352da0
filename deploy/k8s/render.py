"""Render the manifests: ``kvpilot k8s render`` prints a fleet's manifests, or writes every
file to ``--out``, from a values file and flags (:mod:`kvpilot.deploy.k8s.values`);
``--check`` says whether the files in a folder (by default the committed
``deploy/k8s/manifests/``, which the default values render) are what the code renders.

Files: ``base.yaml`` (namespace, API-key Secret, ServiceMonitor, PrometheusRule,
dashboards), one per :class:`~kvpilot.deploy.k8s.plan.Transport` (the P/D engines, the router and
its picker, Envoy in front, the InferencePool and HTTPRoute for a GAIE gateway, the
NetworkPolicies), and ``dynamo.yaml`` (the DynamoGraphDeployment example with the
router). Apply ``base.yaml`` and one of the others.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import yaml

from kvpilot.deploy.k8s.dynamo import dynamo_example
from kvpilot.deploy.k8s.gateway import gateway_objects
from kvpilot.deploy.k8s.network import network_policies
from kvpilot.deploy.k8s.objects import Obj
from kvpilot.deploy.k8s.observability import observability
from kvpilot.deploy.k8s.plan import ClusterSpec, Transport, plan_cluster
from kvpilot.deploy.k8s.values import add_value_flags, cluster_spec, default_values, load_values
from kvpilot.deploy.k8s.workloads import api_keys_secret, namespace, workloads

MANIFEST_DIR = Path(__file__).resolve().parent / "manifests"
BASE = "base"
DEFAULT = ClusterSpec()
DYNAMO = "dynamo"


def overlays(spec: ClusterSpec) -> dict[str, list[Obj]]:
    """Each file's objects, by file stem: the base, one per transport, Dynamo's example.
    ``spec.transport`` is replaced by each transport in turn."""
    out = {BASE: [namespace(spec), api_keys_secret(spec), *observability(spec)]}
    for transport in Transport:
        plan = plan_cluster(msgspec.structs.replace(spec, transport=transport))
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
    """Add ``k8s render`` and ``k8s values`` to a ``kvpilot`` subparsers object."""
    k8s = subparsers.add_parser(
        "k8s",
        help="Kubernetes manifests",
        description="Kubernetes manifests for a GPU fleet (docs/guides/kubernetes.md).",
    )
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True)
    parser = k8s_sub.add_parser(
        "render",
        help="render the manifests",
        description="Render the Kubernetes manifests of a fleet from a values file and flags: without --out, "
        "base.yaml and the transport's file to stdout (for kubectl apply -f -); with --out, every file "
        "(base.yaml, rdma.yaml, mnnvl.yaml, dynamo.yaml) into that folder; with --check, only compare.",
    )
    parser.add_argument("--values", metavar="FILE", type=Path, help="a YAML or JSON file of cluster values")
    parser.add_argument("--out", type=Path, help="the folder every YAML file is written to (default: stdout)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming each file of --out (default: the package's deploy/k8s/manifests) "
        "that differs from what is rendered",
    )
    add_value_flags(parser)
    parser.set_defaults(func=run)
    values = k8s_sub.add_parser(
        "values",
        help="print the default values file",
        description="Print every cluster value at its default, as a values file for k8s render --values.",
    )
    values.set_defaults(func=_print_values)


def _print_values(_: argparse.Namespace) -> int:
    sys.stdout.write(default_values())
    return 0


def run(args: argparse.Namespace) -> int:
    """``kvpilot k8s render``: the manifests to stdout or ``--out``, or with ``--check`` only
    compare; 2 for values that cannot be planned (the key and the reason on stderr)."""
    try:
        spec = cluster_spec(load_values(args.values) if args.values is not None else {}, args)
    except ValueError as exc:
        print(f"kvpilot k8s render: {exc}", file=sys.stderr)
        return 2
    files = render(spec)
    if args.check:
        out: Path = args.out if args.out is not None else MANIFEST_DIR
        stale = [name for name, text in files.items() if not (out / name).is_file() or (out / name).read_text() != text]
        for name in stale:
            print(f"{out / name} is not what `kvpilot k8s render` renders", file=sys.stderr)
        return 1 if stale else 0
    if args.out is None:
        for name in (f"{BASE}.yaml", f"{spec.transport.value}.yaml"):
            sys.stdout.write(f"# {name}\n---\n{files[name]}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text)
        print(args.out / name)
    return 0
