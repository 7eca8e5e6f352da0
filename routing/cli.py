"""``kvpilot router --config FILE``: load the config, bind the KV-event endpoints, serve HTTP
(and, with ``gateway.picker_port``, Envoy's endpoint picker: :mod:`kvpilot.routing.gateway`).

:func:`add_subcommands` registers ``router`` on a ``kvpilot`` subparsers object;
``python -m kvpilot.routing.cli router --config FILE`` works standalone (what the launchers run). Every scalar
of the config's mapping sections has a flag that overrides the YAML (``--port``,
``--server-host``, ``--server-model-dir``, ``--cost-overlap-score-credit``...). Binds 127.0.0.1
unless ``server.host`` says otherwise, and then warns (louder without an API key).
Exit codes: 0 after a clean shutdown, 2 for a bad config.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence

from kvpilot.routing.config import ConfigError
from kvpilot.routing.config_load import add_cli_flags, load_config
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.serve.loopback import beyond_loopback

log = logging.getLogger("kvpilot.routing.cli")


def run_router(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit code."""
    import uvloop
    from aiohttp import web

    from kvpilot.routing.serve.app import build_server

    try:
        config = load_config(args.config, args)
        fleet = fleet_from_config(config)
        if not config.server.model_dir:
            raise ConfigError("server.model_dir", "required (the tokenizer lives there)")
        server = build_server(config, fleet)
        app = server.app()
        if config.gateway.picker_port:
            from kvpilot.routing.gateway.service import attach

            attach(app, server.core)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kvpilot router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if beyond_loopback(config.server.host):
        log.warning(
            "binding %s: the router is reachable beyond this machine%s",
            config.server.host,
            "" if config.server.api_key_env else ", with no API key (set server.api_key_env)",
        )
    # uvloop's event loop (libuv), as vLLM's API server runs under uvicorn: the router's one
    # loop relays every streamed token of every request.
    loop = uvloop.new_event_loop()
    app.on_startup.append(_settle_gc)
    try:
        web.run_app(app, host=config.server.host, port=config.server.port, print=None, loop=loop)
    except ConfigError as exc:  # found at start: the engines' limits against the config
        print(f"kvpilot router: {exc}", file=sys.stderr)
        return 2
    return 0


GC_YOUNG_THRESHOLD = 50_000
"""Python's youngest-generation threshold in the router (700 by default). Each decision makes
a few short-lived tuples per worker, so on a large fleet the default runs the collector on
every request, and its full collections, which walk every live container (the prompts in
flight, the sessions' chains), fall on a decision and set the decision's tail latency. This
threshold, with :func:`gc.freeze` after startup (:func:`_settle_gc`), keeps them off it."""


async def _settle_gc(_: object) -> None:
    """Once the router has started (its index caught up): what exists now is never collected
    (:func:`gc.freeze`), and young objects are collected every :data:`GC_YOUNG_THRESHOLD`
    allocations, not every 700."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``router`` to a ``kvpilot`` subparsers object."""
    parser = subparsers.add_parser(
        "router",
        help="the KV-aware router (OpenAI-compatible HTTP)",
        description="Serve the router from a YAML config; every flag below overrides the key it names.",
    )
    parser.add_argument("--config", metavar="FILE", help="router YAML (workers, cost, server, ...)")
    add_cli_flags(parser)
    parser.set_defaults(func=run_router)


def main(argv: Sequence[str] | None = None) -> int:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="python -m kvpilot.routing.cli")
    parser.add_argument(
        "--version", action="version", version=f"kvpilot {version('kvpilot')}", help="print the version and exit"
    )
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
