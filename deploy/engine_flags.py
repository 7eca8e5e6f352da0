"""``kvpilot engine-flags --config router.yaml``: every engine's ``vllm serve`` command and
environment, read from the router's config, so that what the engines run and what the
router expects cannot drift apart.

For each worker of the config (in its order) :func:`engine_commands` gives:

- ``vllm serve MODEL`` with the config's ``server.model_name`` as ``--served-model-name``,
  ``--host``/``--port`` from the worker's ``url``, ``--block-size`` from ``index.block_size``,
  ``--max-model-len`` from ``server.max_model_len`` when set, ``--max-logprobs`` from
  ``server.max_logprobs``;
- ``--kv-events-config`` with the worker's own ``kv_events_endpoint`` (the one the router binds
  for it; a wildcard host is replaced by ``--router-host``), ``replay_endpoint`` and ``topic``;
- ``--kv-transfer-config`` (``deploy/recipes/kv-transfer-config.json`` unless given), with the
  KV buffer on the GPU;
- the hash settings every engine must share: ``PYTHONHASHSEED``, ``--prefix-caching-hash-algo``
  and ``--kv-cache-dtype``;
- NIXL's side channel: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` is the host of the worker's ``url``
  (the address the router reaches it at, written out rather than guessed with ``hostname -i``,
  which is a loopback address on Debian and Ubuntu) and ``VLLM_NIXL_SIDE_CHANNEL_PORT`` is
  ``--side-channel-port`` plus the engine's rank among the workers on that host. The engine
  binds its side channel and its replay socket there: a ``url`` that names the engine by IP
  address binds what peers reach; a host name must resolve to that address on the engine's
  own host too (:func:`named_hosts` lists the workers named so, and the command warns).

Pure: reads the config it is given, starts nothing.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvpilot.deploy.cli_parser import argument_string
from kvpilot.deploy.env import HASH_SEED_ENV
from kvpilot.kvconnectors.hash_contract import HASH_ALGOS
from kvpilot.routing.config import ConfigError, RouterConfig, Worker
from kvpilot.routing.fleet import fleet_from_config, kv_events_config

RECIPES = Path(__file__).resolve().parent / "recipes"
KV_TRANSFER_RECIPE = RECIPES / "kv-transfer-config.json"
SIDE_CHANNEL_PORT = 5600
"""vLLM's default ``VLLM_NIXL_SIDE_CHANNEL_PORT``: the first engine's on each host."""
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})
"""Hosts a router binds every address on: an engine cannot connect to them."""
ENGINE_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--block-size",
        "--max-model-len",
        "--max-logprobs",
        "--prefix-caching-hash-algo",
        "--kv-cache-dtype",
        "--tensor-parallel-size",
        "--kv-transfer-config",
        "--kv-events-config",
    }
)
"""The flags :func:`engine_commands` sets itself; ``engine_args`` may not repeat them."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What the router's config does not say about the engines, the same for all of them."""

    model: str | None = None
    """The model as the engines load it (a path on their hosts, or a hub name); ``None``:
    the config's ``server.model_dir``."""
    kv_transfer_config: Mapping[str, object] | None = None
    """``--kv-transfer-config``; ``None``: :data:`KV_TRANSFER_RECIPE`. ``kv_buffer_device``
    is set to ``cuda`` when it names none."""
    hash_algo: str = "sha256"
    """``--prefix-caching-hash-algo`` (vLLM's default, written out so every engine states it)."""
    kv_cache_dtype: str = "auto"
    """``--kv-cache-dtype``: P and D must hold KV in one dtype for D to read P's blocks."""
    tensor_parallel_size: int | None = None
    """``--tensor-parallel-size``; ``None``: not given (vLLM's 1)."""
    side_channel_port: int = SIDE_CHANNEL_PORT
    router_host: str | None = None
    """Where engines reach the router's event ports when ``kv_events_endpoint`` names a
    wildcard host (the router binds every address); ``None``: such an endpoint is refused."""
    engine_args: tuple[str, ...] = ()
    """More ``vllm serve`` arguments for every engine (a tool-call parser); none of :data:`ENGINE_FLAGS`."""

    def __post_init__(self) -> None:
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}")
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port must be a TCP port, got {self.side_channel_port}")
        repeated = sorted({arg.split("=", 1)[0] for arg in self.engine_args} & ENGINE_FLAGS)
        if repeated:
            raise ValueError(f"engine_args may not set {', '.join(repeated)}: engine-flags sets them itself")


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """One engine's command line and the environment it must run with."""

    worker: Worker
    argv: tuple[str, ...]
    env: Mapping[str, str]

    def shell(self) -> str:
        """One shell line: ``env K=V ... vllm serve ...``, every word quoted as needed."""
        assignments = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(["env", *assignments, *(shlex.quote(a) for a in self.argv)])

    def as_json(self) -> dict[str, object]:
        """The command as data: the worker's ``name`` and ``role``, ``argv`` and ``env``."""
        return {
            "name": self.worker.name,
            "role": self.worker.role.value,
            "argv": list(self.argv),
            "env": dict(self.env),
        }


def _binds_every_address(endpoint: str) -> bool:
    """Whether ``endpoint`` is a ``tcp://`` endpoint on a wildcard host (:data:`WILDCARD_HOSTS`)."""
    parts = urlsplit(endpoint)
    return parts.scheme == "tcp" and parts.netloc.rsplit(":", 1)[0] in WILDCARD_HOSTS


def _events_endpoint(worker: Worker, router_host: str | None) -> str:
    """``worker.kv_events_endpoint`` as the engine connects to it (``ipc://`` and
    ``inproc://`` name the same socket on both sides)."""
    endpoint = worker.kv_events_endpoint
    if endpoint is None:
        raise ConfigError(f"workers.{worker.name}", "has no kv_events_endpoint: the router would hear no KV events")
    if not _binds_every_address(endpoint):
        return endpoint
    if router_host is None:
        raise ConfigError(
            f"workers.{worker.name}.kv_events_endpoint",
            f"{endpoint} binds every address of the router's host: give --router-host, the address engines reach it at",
        )
    return f"tcp://{router_host}:{urlsplit(endpoint).port}"


def _host_port(worker: Worker) -> tuple[str, int]:
    parts = urlsplit(worker.url)
    if parts.hostname is None or parts.port is None:
        raise ConfigError(f"workers.{worker.name}.url", f"must name a host and a port, got {worker.url!r}")
    return parts.hostname, parts.port


def _kv_transfer(settings: EngineSettings) -> dict[str, object]:
    if settings.kv_transfer_config is not None:
        config = dict(settings.kv_transfer_config)
    else:
        config = json.loads(KV_TRANSFER_RECIPE.read_text())
    config.setdefault("kv_buffer_device", "cuda")
    return config


def engine_commands(config: RouterConfig, settings: EngineSettings) -> list[EngineCommand]:
    """Each worker's ``vllm serve`` command, in the config's order. Raises
    :class:`ConfigError` naming the worker for a config whose engines cannot be told what
    to run (no workers, no events endpoint, a wildcard event host without
    ``settings.router_host``, a url without a port), and ``ValueError`` for a
    ``settings.router_host`` that no worker's endpoint needs."""
    workers = fleet_from_config(config).workers
    if not workers:
        raise ConfigError("workers", "is empty (beside Dynamo the workers are Dynamo's, started by Dynamo)")
    model = settings.model or config.server.model_dir
    if not model:
        raise ConfigError("server.model_dir", "is empty: give the engines' model with --model")
    kv_transfer = json.dumps(_kv_transfer(settings), separators=(",", ":"))
    on_host: dict[str, int] = {}
    commands = []
    for worker in workers:
        host, port = _host_port(worker)
        rank = on_host.get(host, 0)
        on_host[host] = rank + 1
        published = Worker(
            name=worker.name,
            role=worker.role,
            url=worker.url,
            kv_events_endpoint=_events_endpoint(worker, settings.router_host),
            replay_endpoint=worker.replay_endpoint,
            topic=worker.topic,
        )
        argv = (
            "vllm",
            "serve",
            model,
            "--served-model-name",
            config.server.model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--block-size",
            str(config.index.block_size),
            *(("--max-model-len", str(config.server.max_model_len)) if config.server.max_model_len else ()),
            "--max-logprobs",
            str(config.server.max_logprobs),
            "--prefix-caching-hash-algo",
            settings.hash_algo,
            "--kv-cache-dtype",
            settings.kv_cache_dtype,
            *(("--tensor-parallel-size", str(settings.tensor_parallel_size)) if settings.tensor_parallel_size else ()),
            "--kv-transfer-config",
            kv_transfer,
            "--kv-events-config",
            kv_events_config(published),
            *settings.engine_args,
        )
        env = {
            **HASH_SEED_ENV,
            SIDE_CHANNEL_HOST_ENV: host,
            SIDE_CHANNEL_PORT_ENV: str(settings.side_channel_port + rank),
        }
        commands.append(EngineCommand(worker, argv, env))
    if settings.router_host is not None and not any(_binds_every_address(w.kv_events_endpoint or "") for w in workers):
        raise ValueError("--router-host changes nothing: no worker's kv_events_endpoint binds a wildcard host")
    return commands


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``engine-flags`` to a ``kvpilot`` subparsers object."""
    parser = subparsers.add_parser(
        "engine-flags",
        help="every engine's `vllm serve` command and environment, from the router's config",
        description="Print, for each worker of a router config, the exact `vllm serve` command and environment "
        "its engine needs: its KV-event endpoint, the hash settings every engine shares, NIXL's side channel.",
    )
    parser.add_argument("--config", metavar="FILE", type=Path, required=True, help="the router's YAML")
    parser.add_argument("--model", help="the model as the engines load it (default: the config's server.model_dir)")
    parser.add_argument(
        "--kv-transfer-config",
        metavar="FILE",
        type=Path,
        help="a JSON file for --kv-transfer-config (default: the package's recipes/kv-transfer-config.json)",
    )
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256", help="--prefix-caching-hash-algo")
    parser.add_argument("--kv-cache-dtype", default="auto", help="--kv-cache-dtype, the same on every engine")
    parser.add_argument("--tensor-parallel-size", type=int, help="--tensor-parallel-size (default: not given)")
    parser.add_argument(
        "--side-channel-port", type=int, default=SIDE_CHANNEL_PORT, help="NIXL's side channel, first engine per host"
    )
    parser.add_argument(
        "--router-host", help="the router's address for engines, when an event endpoint's host is 0.0.0.0 or *"
    )
    parser.add_argument(
        "--engine-args",
        type=argument_string,
        default="",
        help="more `vllm serve` arguments, as one shell-quoted string",
    )
    parser.add_argument("--json", action="store_true", help="one JSON list (name, role, argv, env) instead of shell")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``kvpilot engine-flags``: 0 with every engine's command on stdout; 2 (the reason on
    stderr) for a config or flag that cannot give one."""
    from kvpilot.routing.config_load import load_config

    try:
        kv_transfer = None
        if args.kv_transfer_config is not None:
            kv_transfer = json.loads(args.kv_transfer_config.read_text())
            if not isinstance(kv_transfer, dict):
                raise ValueError(f"--kv-transfer-config {args.kv_transfer_config}: must hold a JSON object")
        settings = EngineSettings(
            model=args.model,
            kv_transfer_config=kv_transfer,
            hash_algo=args.hash_algo,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            side_channel_port=args.side_channel_port,
            router_host=args.router_host,
            engine_args=args.engine_args,
        )
        commands = engine_commands(load_config(args.config), settings)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kvpilot engine-flags: {exc}", file=sys.stderr)
        return 2
    named = named_hosts(commands)
    if named:
        print(
            f"kvpilot engine-flags: {', '.join(named)}: the url names the host, not its address; the engine binds "
            "its NIXL side channel and KV-event replay socket on that name, so it must resolve to the address its "
            "peers reach on the engine's own host too (Debian and Ubuntu map a host's own name to 127.0.x.1)",
            file=sys.stderr,
        )
    print(render(commands, as_json=args.json))
    return 0


def named_hosts(commands: Sequence[EngineCommand]) -> list[str]:
    """The workers whose ``url`` names their host by a name rather than an IP address."""
    named: list[str] = []
    for command in commands:
        host, _ = _host_port(command.worker)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            named.append(command.worker.name)
    return named


def render(commands: Sequence[EngineCommand], *, as_json: bool) -> str:
    """The commands as a JSON list, or as shell: a comment naming each engine, then its line."""
    if as_json:
        return json.dumps([c.as_json() for c in commands], indent=2)
    blocks = [f"# {c.worker.name} ({c.worker.role.value}) at {c.worker.url}\n{c.shell()}" for c in commands]
    return "\n\n".join(blocks)
