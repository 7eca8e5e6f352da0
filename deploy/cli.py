"""The ``kvpilot`` console script: one entry, one subcommand per job."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpilot.deploy.cli_parser import Parser, argument_string, json_object, model_dir
from kvpilot.deploy.envoy_spec import PickerFailure

if TYPE_CHECKING:  # imported where used: the console script starts without them
    from kvpilot.deploy.dynamo_spec import DynamoFleetSpec
    from kvpilot.deploy.fleet_spec import FleetSpec

DEFAULT_RUN_DIR = Path(".kvpilot") / "fleet"
DEFAULT_CONNECTOR = "KVPilotConnector"


def _tiny_model(args: argparse.Namespace) -> int:
    from kvpilot.deploy.tiny_model import build_tiny_model, ensure_tiny_model, tree_digest

    if args.path is None:
        path = ensure_tiny_model()
    else:
        if args.path.exists():
            if not args.force:
                print(f"kvpilot tiny-model: {args.path} exists (use --force to rebuild)", file=sys.stderr)
                return 2
            shutil.rmtree(args.path)
        path = build_tiny_model(args.path)
    print(f"{path}  sha256-tree={tree_digest(path)[:16]}")
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("kvpilot")


def _fleet_spec(args: argparse.Namespace) -> FleetSpec:
    from kvpilot.deploy.fleet_spec import ENGINE_API_KEY_ENV, FleetSpec
    from kvpilot.deploy.tiny_model import ensure_tiny_model
    from kvpilot.routing.config import IndexBackend

    return FleetSpec(
        model_dir=args.model_dir or ensure_tiny_model(),
        run_dir=args.run_dir,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        engine_port=args.engine_port,
        side_channel_port=args.side_channel_port,
        events_port=args.events_port,
        router_port=args.server_port,
        connector=args.connector,
        connector_extra_config=args.connector_extra_config or {},
        disaggregation=args.disaggregation,
        index_backend=IndexBackend(args.index_backend),
        ttft_slo_s=args.server_ttft_slo_s,
        gateway_port=args.gateway_port,
        picker_port=args.gateway_picker_port,
        envoy_admin_port=args.gateway_picker_port + 1,
        on_picker_failure=PickerFailure(args.on_picker_failure),
        session_store_url=args.sessions_redis_url,
        engine_api_key=os.environ.get(ENGINE_API_KEY_ENV) or None,
        engine_args=args.engine_args,
    )


def _ignored_beside_dynamo(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The flags given to ``fleet up --dynamo`` that a Dynamo fleet cannot honour, each
    with the reason (given: set away from its default)."""
    from kvpilot.routing.config import IndexBackend

    checks = [
        (args.observe, "--observe", "Dynamo's mockers publish no vLLM or NIXL metrics for Prometheus to scrape"),
        (
            args.connector != DEFAULT_CONNECTOR or args.connector_extra_config,
            "--connector / --connector-extra-config",
            "Dynamo's mockers are not vLLM engines: no KV connector runs",
        ),
        (
            args.index_backend != IndexBackend.KVPILOT.value,
            "--index-backend",
            "beside Dynamo the router reads the workers' events into its own index only",
        ),
        (args.colocated, "--colocated", "Dynamo's aggregated workers are --workers N"),
        (
            args.on_picker_failure != PickerFailure.REFUSE.value,
            "--on-picker-failure",
            "it must be refuse: Dynamo's direct-mode frontend routes nothing the picker did not name",
        ),
        (args.sessions_redis_url, "--sessions-redis-url", "the Dynamo fleet keeps the router's sessions in memory"),
        (args.engine_args, "--engine-args", "Dynamo's mockers are not vLLM engines"),
        (
            args.python_picker and not args.workers,
            "--python-picker",
            "a disaggregated Dynamo fleet has only the Python picker (the compiled one places co-located workers)",
        ),
    ]
    return [(flag, why) for given, flag, why in checks if given]


def dynamo_fleet_spec(args: argparse.Namespace, model_dir: Path) -> DynamoFleetSpec:
    """``fleet up --dynamo``'s fleet from its flags: aggregated workers get the compiled picker
    in Envoy unless ``--python-picker`` (or no Envoy)."""
    from kvpilot.deploy.dynamo_spec import DynamoFleetSpec

    counts = {"workers": args.workers} if args.workers else {"prefill": args.prefill, "decode": args.decode}
    return DynamoFleetSpec(
        model_dir=model_dir,
        run_dir=args.run_dir,
        speedup_ratio=args.speedup_ratio,
        worker_port=args.worker_port,
        frontend_port=args.frontend_port,
        router_port=args.server_port,
        gateway_port=args.gateway_port,
        picker_port=args.gateway_picker_port,
        envoy_admin_port=args.gateway_picker_port + 1,
        on_picker_failure=PickerFailure(args.on_picker_failure),
        ttft_slo_s=args.server_ttft_slo_s,
        native_picker=bool(args.workers) and bool(args.gateway_port) and not args.python_picker,
        **counts,
    )


def _dynamo_fleet_up(args: argparse.Namespace) -> int:
    """``fleet up --dynamo``: Dynamo's frontend and mocker workers beside the router."""
    from kvpilot.deploy import dynamo_fleet
    from kvpilot.deploy.fleet import FleetStartError
    from kvpilot.deploy.tiny_model import ensure_tiny_model

    refused = _ignored_beside_dynamo(args)
    if refused:
        for flag, why in refused:
            print(f"kvpilot fleet up --dynamo: {flag} is refused: {why}", file=sys.stderr)
        return 2
    spec = dynamo_fleet_spec(args, args.model_dir or ensure_tiny_model())
    counts = {"workers": spec.workers} if spec.workers else {"prefill": spec.prefill, "decode": spec.decode}
    print(f"kvpilot fleet up --dynamo: {', '.join(f'{n} {k}' for k, n in counts.items())} (dynamo.mocker)")
    try:
        started = dynamo_fleet.up(spec, timeout=args.timeout)
    except FleetStartError as exc:
        print(f"kvpilot fleet up failed: {exc}", file=sys.stderr)
        return 1
    print(f"clients: {spec.client_url}   router: {started.router.url}   frontend: {spec.frontend_url}")
    print(f"(state in {args.run_dir})")
    return 0


def _fleet(args: argparse.Namespace) -> int:
    from kvpilot.deploy import fleet

    if args.action == "up" and args.dynamo:
        return _dynamo_fleet_up(args)
    if args.action == "up":
        try:
            spec = _fleet_spec(args)
        except ValueError as exc:
            print(f"kvpilot fleet up: {exc}", file=sys.stderr)
            return 2
        print(f"kvpilot fleet up: {spec.prefill} prefill, {spec.decode} decode, {spec.colocated} co-located")
        observe = None
        if args.observe:
            from kvpilot.deploy.observe import ObserveSpec

            observe = ObserveSpec(port=args.prometheus_port, nixl_telemetry=not args.no_nixl_telemetry)
        try:
            started = fleet.up(spec, timeout=args.timeout, observe=observe)
        except fleet.FleetStartError as exc:
            print(f"kvpilot fleet up failed: {exc}", file=sys.stderr)
            return 1
        print(f"clients: {started.client_url}   router: {started.router.url}")
        print(f"(state in {args.run_dir / fleet.STATE_FILE})")
        if started.prometheus is not None:
            print(f"prometheus: {started.prometheus.url}   (dashboards: grafana/README.md)")
        return 0
    if args.action == "status":
        rows = fleet.status(args.run_dir)
        if not rows:
            print(f"no fleet recorded in {args.run_dir}")
            return 1
        for proc, alive, healthy in rows:
            print(f"{proc.name:<14} pid {proc.pid:<8} {proc.url:<24} alive={alive} healthy={healthy}")
        return 0 if all(alive and healthy for _, alive, healthy in rows) else 1
    stopped = fleet.down(args.run_dir)
    print(f"stopped {stopped} processes" if stopped else f"no fleet recorded in {args.run_dir}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvpilot.deploy.demo import run_demo

    return run_demo(args.run_dir, args.disaggregation)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpilot`` command and its subcommands. A flag that sets a router setting has
    the router's name for it (:func:`kvpilot.routing.config_load.flag_name`: ``--server-port``,
    ``--index-backend``, ``--sessions-redis-url``, ``--server-ttft-slo-s``)."""
    from kvpilot.deploy.fleet_spec import FLEET_TTFT_SLO_S
    from kvpilot.routing.config import IndexBackend

    parser: argparse.ArgumentParser = Parser(
        prog="kvpilot", description="KV, prefix and session caching for vLLM fleets."
    )
    parser.add_argument(
        "--version", action="version", version=f"kvpilot {_version()}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser(
        "tiny-model",
        help="build the tiny offline Llama (deterministic, no hub)",
        description="Build the tiny offline Llama the CPU fleet and the tests serve.",
    )
    tiny.add_argument("path", type=Path, nargs="?", help="where to build it (default: the shared cache)")
    tiny.add_argument("--force", action="store_true", help="replace PATH if it exists")
    tiny.set_defaults(func=_tiny_model)

    fl = sub.add_parser(
        "fleet",
        help="a local CPU fleet of vLLM engines (or Dynamo mockers) behind the router and Envoy",
        description="Start, inspect or stop a local fleet: engines, the router, Envoy (and Prometheus).",
    )
    fl.add_argument("action", choices=["up", "status", "down"], help="start the fleet, list its processes, stop it")
    fl.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="logs, pids and fleet.json")
    fl.add_argument("--model-dir", type=model_dir, help="the served model's directory (default: the tiny model)")
    fl.add_argument("--prefill", type=int, default=1, help="prefill (P) engines")
    fl.add_argument("--decode", type=int, default=1, help="decode (D) engines")
    fl.add_argument("--colocated", type=int, default=0, help="co-located engines (prefill and decode their own)")
    fl.add_argument("--engine-port", type=int, default=8100, help="first engine's HTTP port")
    fl.add_argument("--side-channel-port", type=int, default=5600, help="first engine's NIXL side-channel port")
    fl.add_argument("--events-port", type=int, default=5700, help="first engine's KV-event port (router binds)")
    fl.add_argument("--server-port", type=int, default=8000, help="the router's HTTP port (YAML: server.port)")
    fl.add_argument("--connector", default=DEFAULT_CONNECTOR, help="kv_connector for every engine")
    fl.add_argument(
        "--sessions-redis-url",
        help="keep the router's sessions in Redis at this URL (redis://127.0.0.1:6379/0; started by you; "
        "YAML: sessions.redis_url with sessions.store: redis)",
    )
    fl.add_argument(
        "--connector-extra-config", type=json_object, help="a JSON object: the engines' kv_connector_extra_config"
    )
    fl.add_argument(
        "--engine-args",
        type=argument_string,
        default="",
        help="more `vllm serve` arguments for every engine, as one shell-quoted string (tool calling: "
        "'--enable-auto-tool-choice --tool-call-parser hermes'; a reasoning parser: '--reasoning-parser qwen3')",
    )
    fl.add_argument(
        "--disaggregation",
        choices=["conditional", "always"],
        default="conditional",
        help="conditional: the router picks local or remote prefill per request; always: prefill on P",
    )
    fl.add_argument(
        "--index-backend",
        choices=[backend.value for backend in IndexBackend],
        default=IndexBackend.KVPILOT.value,
        help="the router's block index: kvpilot's, or Dynamo's RadixTree (kvpilot[dynamo]; YAML: index.backend)",
    )
    fl.add_argument(
        "--server-ttft-slo-s",
        type=float,
        default=FLEET_TTFT_SLO_S,
        help="seconds: the router refuses (429/503, Retry-After) a request whose predicted TTFT is over this; "
        "0: off (YAML: server.ttft_slo_s)",
    )
    fl.add_argument(
        "--observe",
        action="store_true",
        help="also start Prometheus scraping every engine and the router, with the alert rules",
    )
    fl.add_argument(
        "--prometheus-port",
        type=int,
        default=9090,
        help="with --observe: Prometheus' port; engine i's NIXL exporter gets port + 1 + i",
    )
    fl.add_argument(
        "--no-nixl-telemetry", action="store_true", help="with --observe: leave NIXL's own Prometheus exporter off"
    )
    fl.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for health")
    fl.add_argument(
        "--gateway-port",
        type=int,
        default=8080,
        help="Envoy's port, where clients send requests (the router's endpoint picker decides, Envoy carries the "
        "streams); 0: no Envoy, clients send to the router, which relays the streams",
    )
    fl.add_argument(
        "--gateway-picker-port",
        type=int,
        default=8070,
        help="the router's endpoint picker (gRPC, for Envoy; YAML: gateway.picker_port); Envoy's admin "
        "interface gets this port + 1",
    )
    fl.add_argument(
        "--on-picker-failure",
        choices=[f.value for f in PickerFailure],
        default=PickerFailure.REFUSE.value,
        help="what Envoy does when the picker is down: refuse (a 503 naming it) or round_robin over the engines "
        "that can serve alone, with only the fields the picker accepts (not with --dynamo: its direct-mode "
        "frontend routes nothing the picker did not name)",
    )
    dyn = fl.add_argument_group("beside NVIDIA Dynamo (docs/guides/dynamo.md)")
    dyn.add_argument(
        "--dynamo",
        action="store_true",
        help="Dynamo's frontend (direct mode) and dynamo.mocker workers behind the router, instead of vLLM engines; "
        "flags a Dynamo fleet cannot honour (--observe, --connector, --index-backend, --colocated, "
        "--sessions-redis-url) are refused",
    )
    dyn.add_argument(
        "--workers", type=int, default=0, help="with --dynamo: N aggregated workers (else --prefill/--decode)"
    )
    dyn.add_argument("--speedup-ratio", type=float, default=10.0, help="with --dynamo: the mocker's simulated speedup")
    dyn.add_argument("--worker-port", type=int, default=20000, help="with --dynamo: worker 0's request-plane port")
    dyn.add_argument("--frontend-port", type=int, default=8090, help="with --dynamo: the frontend's HTTP port")
    dyn.add_argument(
        "--python-picker",
        action="store_true",
        help="with --dynamo --workers: Envoy asks the router's Python picker for every request (default: Envoy "
        "decides token-id prompts itself with the compiled picker, routing/native; the Python picker the rest)",
    )
    fl.set_defaults(func=_fleet)

    from kvpilot.deploy.dashboards import add_subcommands as add_dashboard_subcommands
    from kvpilot.deploy.engine_flags import add_subcommands as add_engine_flags_subcommands
    from kvpilot.deploy.gateway import add_subcommands as add_gateway_subcommands
    from kvpilot.deploy.k8s.render import add_subcommands as add_k8s_subcommands
    from kvpilot.policies.cli import add_subcommands as add_policy_subcommands
    from kvpilot.routing.cli import add_subcommands as add_router_subcommands

    add_policy_subcommands(sub)  # cost, plan, agent
    add_router_subcommands(sub)  # router
    add_engine_flags_subcommands(sub)  # engine-flags
    add_k8s_subcommands(sub)  # k8s render
    add_gateway_subcommands(sub)  # gateway
    add_dashboard_subcommands(sub)  # dashboards generate, render, queries

    demo = sub.add_parser(
        "demo",
        help="1 P + 1 D tiny fleet, a few requests, a table, then down",
        description="The main job on the embedded default: a tiny fleet serves a few requests, then stops.",
    )
    demo.add_argument("--run-dir", type=Path, default=Path(".kvpilot") / "demo", help="logs, pids and fleet.json")
    demo.add_argument(
        "--disaggregation",
        choices=["conditional", "always"],
        default="always",
        help="always (the demo's default, to show every handoff): every request is prefilled on P; "
        "conditional (the fleet's default): the router decides",
    )
    demo.set_defaults(func=_demo)

    docs = sub.add_parser(
        "docs",
        help="the generated reference pages",
        description="Write (or check) docs/reference/: config keys, CLI, metrics, endpoints, from the code.",
    )
    docs_sub = docs.add_subparsers(dest="docs_command", required=True)
    reference = docs_sub.add_parser(
        "reference",
        help="write docs/reference/*.md from the code",
        description="Write docs/reference/*.md from the code, or with --check only compare.",
    )
    reference.add_argument("--root", type=Path, default=Path("."), help="the repository's root")
    reference.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale page")
    reference.set_defaults(func=_docs_reference)
    return parser


def _docs_reference(args: argparse.Namespace) -> int:
    from kvpilot.deploy.reference import run

    return run(args.root, args.check, build_parser())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
