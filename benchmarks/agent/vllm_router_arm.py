"""vllm-router 0.1.17 (PyPI ``vllm-router``) in vLLM P/D mode: a baseline arm.

Mode: ``--vllm-pd-disaggregation`` with the NIXL connector. For every request the
router sends P a copy with ``max_tokens=1``, ``stream=false`` and
``kv_transfer_params={"do_remote_decode": true, remote_*: null}`` (any
``kv_transfer_params`` from the client are overwritten), then sends D the original
request with P's returned ``kv_transfer_params``; D's answer is returned.
It keeps no session state: D's end-of-turn params (vLLM's bidirectional offer) are
never given to P, so there is no D->P transfer; P recomputes what it has not cached.

With ``kv_event_endpoints`` (one per prefill URL) the prefill policy is
``kv_aware``, fed by each P's vLLM KV events (``--pd-kv-events``; the static
``--kv-event-source`` is refused in P/D mode). Its SUB socket *connects*, so each P
must bind its publisher (``ipc://PATH`` stays local; kvpilot fleets instead have the
engines connect to the kvpilot router's port). On vLLM-CPU it credits no prefix:
``--pd-kv-events`` assumes 16-token blocks, CPU attention needs multiples of 32, and
requests with ``cache_salt`` skip it anyway (fallback ``cache_salt``).

Contract of :func:`running_vllm_router`: starts the router on ``127.0.0.1:port``
(Prometheus on ``port + 1``), logging to ``log_path``; yields its base URL once
``/health`` answers 200 (the router answers only after it has seen every worker
healthy); stops its process group on exit. Raises ``RuntimeError`` with the log
tail if the router exits or is not healthy within ``timeout`` seconds, or if it is
found dead on exit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpilot.deploy.env import child_env
from kvpilot.deploy.fleet import is_healthy, log_tail, stop_group
from kvpilot.deploy.fleet_spec import HOST

VLLM_ROUTER = str(Path(sys.executable).with_name("vllm-router"))

VLLM_ROUTER_FLAGS: tuple[str, ...] = (
    # vLLM's two-stage P->D protocol (P: max_tokens=1 + do_remote_decode; D: P's params).
    "--vllm-pd-disaggregation",
    # NixlConnector's pull protocol (the default; stated so the mode is explicit).
    "--kv-connector",
    "nixl",
    # The router's default: an approximate prefix tree over the request text per
    # worker, so a session keeps landing on the P and D that saw its prefix.
    "--policy",
    "cache_aware",
    # A failed request is reported, not replayed on P/D (kvpilot's router does not retry).
    "--disable-retries",
    # One failure must not take the only P or D out of rotation for the rest of a run.
    "--disable-circuit-breaker",
    # Workers are already up; poll them every second rather than every 30 s.
    "--worker-startup-check-interval",
    "1",
)


def vllm_router_argv(
    prefill_urls: list[str], decode_urls: list[str], port: int, kv_event_endpoints: list[str] | None = None
) -> list[str]:
    """The full command line (see :data:`VLLM_ROUTER_FLAGS`)."""
    argv = [
        VLLM_ROUTER,
        *VLLM_ROUTER_FLAGS,
        "--host",
        HOST,
        "--port",
        str(port),
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(port + 1),
    ]
    for url in prefill_urls:
        argv += ["--prefill", url]  # no bootstrap port: NIXL handshakes on its own side channel
    for url in decode_urls:
        argv += ["--decode", url]
    if kv_event_endpoints is not None:
        if len(kv_event_endpoints) != len(prefill_urls):
            raise ValueError("kv_event_endpoints needs one endpoint per prefill URL")
        argv += ["--prefill-policy", "kv_aware"]
        for url, endpoint in zip(prefill_urls, kv_event_endpoints, strict=True):
            argv += ["--pd-kv-events", f"{url}={endpoint}"]
    return argv


@contextmanager
def running_vllm_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    port: int,
    log_path: Path,
    kv_event_endpoints: list[str] | None = None,
    timeout: float = 120.0,
) -> Iterator[str]:
    """vllm-router in P/D mode in front of the given engines; yields its base URL."""
    url = f"http://{HOST}:{port}"
    argv = vllm_router_argv(prefill_urls, decode_urls, port, kv_event_endpoints)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv,
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while not is_healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with code {proc.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router not healthy after {timeout:.0f} s:\n{log_tail(log_path)}")
            time.sleep(0.5)
        yield url
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router died with code {proc.returncode}:\n{log_tail(log_path)}")
    finally:
        stop_group(proc.pid)
