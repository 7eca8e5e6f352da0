"""What a local CPU fleet is made of: pure planning, no processes.

:func:`plan_fleet` turns a :class:`FleetSpec` into the exact argv, environment and
ports of every engine and of the router, so that launching is a loop and tests can
check the plan without starting anything.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from deploy.env import HASH_SEED_ENV, NIXL_CPU_ENV

HOST = "127.0.0.1"


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """A one-machine fleet. Ports are bases: engine i gets ``engine_port + i``."""

    model_dir: Path
    run_dir: Path
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    served_model_name: str = "tiny"
    block_size: int = 32
    max_model_len: int = 8192
    kv_cache_gib: int = 1
    engine_port: int = 8100
    side_channel_port: int = 5600
    router_port: int = 8000
    connector: str = "KVPilotConnector"
    connector_extra_config: dict[str, object] = field(default_factory=dict)
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("engine counts must be >= 0")
        if self.prefill and not self.decode:
            raise ValueError("a fleet with prefill engines needs at least one decode engine")
        if not (self.decode or self.colocated):
            raise ValueError("a fleet needs at least one decode or co-located engine")
        if self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 on CPU, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class ProcessPlan:
    """One process to start: its name, role, argv, extra environment and HTTP port."""

    name: str
    role: Role | None
    argv: tuple[str, ...]
    env: dict[str, str]
    port: int
    side_ports: tuple[int, ...] = ()
    """Other ports it listens on (NIXL's side channel)."""

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def _engine_plan(spec: FleetSpec, role: Role, index: int, ordinal: int) -> ProcessPlan:
    kv_transfer = {
        "kv_connector": spec.connector,
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": spec.connector_extra_config,
    }
    argv = (
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model_dir),
        "--served-model-name", spec.served_model_name,
        "--host", HOST,
        "--port", str(spec.engine_port + ordinal),
        "--enforce-eager",
        "--block-size", str(spec.block_size),
        "--max-model-len", str(spec.max_model_len),
        "--kv-transfer-config", json.dumps(kv_transfer),
    )  # fmt: skip
    env = {
        **NIXL_CPU_ENV,
        **HASH_SEED_ENV,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port + ordinal),
        "VLLM_CPU_OMP_THREADS_BIND": str(ordinal % spec.cores),
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
    }
    side_port = spec.side_channel_port + ordinal
    return ProcessPlan(f"{role.value}-{index}", role, argv, env, spec.engine_port + ordinal, (side_port,))


def plan_fleet(spec: FleetSpec) -> tuple[list[ProcessPlan], ProcessPlan]:
    """The engines (prefill, then decode, then co-located) and the router."""
    engines: list[ProcessPlan] = []
    for role, count in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode), (Role.COLOCATED, spec.colocated)):
        engines += [_engine_plan(spec, role, i, len(engines) + i) for i in range(count)]
    argv = [sys.executable, "-m", "routing.pd_proxy", "--model-dir", str(spec.model_dir),
            "--model-name", spec.served_model_name, "--host", HOST, "--port", str(spec.router_port)]  # fmt: skip
    for engine in engines:
        argv += ["--prefill" if engine.role is Role.PREFILL else "--decode", engine.url]
    router = ProcessPlan("router", None, tuple(argv), {}, spec.router_port)
    return engines, router
