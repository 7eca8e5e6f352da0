"""Environment every kvpilot launcher and test fixture gives the processes it starts.

Nothing leaves this machine: usage statistics and telemetry are off, the hub is
offline, NIXL's side channel and UCX stay on the loopback device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LOCAL_ONLY_ENV: Mapping[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_HOST_IP": "127.0.0.1",
}

# NIXL over UCX on one CPU box: TCP and shared memory on the loopback device.
NIXL_CPU_ENV: Mapping[str, str] = {
    "UCX_TLS": "tcp,sm,self",
    "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}

# vLLM compiles its logprob-rank helper with inductor on an engine's first logprobs
# request (vllm/v1/sample/ops/logprobs.py): g++ in the engine's worker, on the cores
# the worker is bound to. On a plain-NixlConnector engine vLLM has bound it to the box's
# last core, beside the spinning NIXL progress threads, where that compile ran past
# 4 minutes (2026-12-02, AMD EPYC, tests/e2e/test_positive_control.py) and P's answer
# past the client's 300 s. Eager computes the same integer ranks.
CPU_EAGER_ENV: Mapping[str, str] = {"TORCH_COMPILE_DISABLE": "1"}

# Block hashes must agree across engines: vLLM seeds its hash chain from
# PYTHONHASHSEED, and an unset seed gives every engine a random one.
HASH_SEED_ENV: Mapping[str, str] = {"PYTHONHASHSEED": "0"}


def child_env(*layers: Mapping[str, str]) -> dict[str, str]:
    """``os.environ`` overlaid with :data:`LOCAL_ONLY_ENV`, then ``layers`` in order."""
    env = dict(os.environ)
    env.update(LOCAL_ONLY_ENV)
    for layer in layers:
        env.update(layer)
    return env


# Dynamo's processes advertise and connect on loopback only: without these, workers put
# the machine's external address in discovery and the frontend connects to it.
DYNAMO_LOOPBACK_ENV: Mapping[str, str] = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
}
