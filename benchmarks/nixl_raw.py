"""Raw NIXL reads between two processes on this box: the link's ceiling for the
connectors' KV transfers, on the same descriptor sizes and counts.

Two processes, each with one NIXL agent configured as vLLM 0.32's NIXL worker
configures its own (UCX, ``num_threads=4``, telemetry on): the holder registers a
DRAM buffer, the reader registers its own and READs ``descriptors`` descriptors of
``descriptor_bytes`` each per transfer, ``transfers`` times. The holder's metadata
reaches the reader over a pipe (vLLM uses a ZMQ side channel). Times are the
reader's wall time from posting a transfer to seeing it done, as vLLM's
``vllm:nixl_xfer_time_seconds`` measures. One untimed read of the same shape goes
first: UCX sets up its endpoint on a pair's first transfer, which the connectors'
numbers exclude too (their handshakes are paid before they are measured).

    python -m benchmarks.nixl_raw --descriptor-bytes 32768 --descriptors 4 --transfers 32
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvpilot.deploy.env import LOCAL_ONLY_ENV, NIXL_CPU_ENV


@dataclass(frozen=True)
class RawResult:
    transfers: int
    nbytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0


def _agent(name: str) -> Any:
    """A ``nixl._api.nixl_agent`` (nixl ships no type information)."""
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-untyped]  # no py.typed

    return nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))


def _holder(conn: Connection, size: int) -> None:
    agent = _agent("raw-holder")
    buffer = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buffer.ctypes.data, size, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), buffer.ctypes.data, int(buffer.sum())))
    conn.recv()  # the reader is done


def _read_all(conn: Connection, descriptor_bytes: int, descriptors: int, transfers: int) -> RawResult:
    agent = _agent("raw-reader")
    metadata, remote_base, checksum = conn.recv()
    remote = agent.add_remote_agent(metadata)
    size = descriptor_bytes * descriptors * transfers
    local = np.zeros(size, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(local.ctypes.data, size, 0, "")], "DRAM"))
    seconds = 0.0
    for step, t in enumerate([0, *range(transfers)]):  # step 0 reads transfer 0's span untimed: the warm-up
        offsets = [(t * descriptors + i) * descriptor_bytes for i in range(descriptors)]
        local_descs = agent.get_xfer_descs([(local.ctypes.data + o, descriptor_bytes, 0) for o in offsets], "DRAM")
        remote_descs = agent.get_xfer_descs([(remote_base + o, descriptor_bytes, 0) for o in offsets], "DRAM")
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
        started = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if step:
            seconds += time.perf_counter() - started
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read {t} ended {state}")
        agent.release_xfer_handle(handle)
    if int(local.sum()) != checksum:
        raise RuntimeError("raw NIXL read returned other bytes than the holder's")
    return RawResult(transfers, size, seconds)


def _reader(holder: Connection, results: Connection, descriptor_bytes: int, descriptors: int, transfers: int) -> None:
    """The reader's process: hands the result (or the error) to the parent, then
    releases the holder."""
    try:
        results.send(_read_all(holder, descriptor_bytes, descriptors, transfers))
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the parent, which raises it
        results.send(exc)
    finally:
        holder.send("done")


def measure(descriptor_bytes: int, descriptors: int, transfers: int) -> RawResult:
    """Raw NIXL READ throughput between two fresh processes (environment as the fleet's)."""
    os.environ.update({**LOCAL_ONLY_ENV, **NIXL_CPU_ENV})
    ctx = mp.get_context("spawn")
    holder_end, reader_end = ctx.Pipe()
    results, results_in = ctx.Pipe(duplex=False)
    holder = ctx.Process(target=_holder, args=(holder_end, descriptor_bytes * descriptors * transfers))
    holder.start()
    reader = ctx.Process(target=_reader, args=(reader_end, results_in, descriptor_bytes, descriptors, transfers))
    reader.start()
    try:
        result: RawResult | BaseException = results.recv()
    finally:
        reader.join(60)
        holder.join(60)
        for proc in (reader, holder):
            if proc.is_alive():
                proc.kill()
    if isinstance(result, BaseException):
        raise result
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--descriptor-bytes", type=int, default=32768)
    parser.add_argument("--descriptors", type=int, default=4, help="descriptors per transfer")
    parser.add_argument("--transfers", type=int, default=32)
    args = parser.parse_args()
    r = measure(args.descriptor_bytes, args.descriptors, args.transfers)
    print(
        f"raw NIXL READ: {r.transfers} transfers, {r.nbytes / 1e6:.2f} MB in {r.seconds:.3f} s: "
        f"{r.bytes_per_s / 1e6:.1f} MB/s"
    )


if __name__ == "__main__":
    main()
