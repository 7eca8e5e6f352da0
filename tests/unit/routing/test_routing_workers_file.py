"""A fleet that grows and shrinks with no restart: the router reads ``server.workers_file`` at
start and again when it changes; engines that join are routed to, engines that leave are not,
and no request fails meanwhile. A file that cannot be read is refused at start and, later,
leaves the fleet as it was."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from kvpilot.routing.config import ConfigError
from kvpilot.routing.config_load import load_config
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ingest.workers_file import WorkersFile
from kvpilot.routing.serve.app import build_server
from tests.fakes.engine import FakeEngine

BS = 4
PROMPT = list(range(3, 3 + 6 * BS))
POLL_S = 0.05


def _entry(name: str, server: TestServer) -> dict[str, str]:
    return {"name": name, "role": "colocated", "url": str(server.make_url("/")).rstrip("/")}


def test_engines_join_and_leave_through_the_file_under_load(model_dir: Path) -> None:
    async def main() -> None:
        engines = {name: FakeEngine(name) for name in ("co-0", "co-1")}
        servers = {name: TestServer(e.app(), host="127.0.0.1") for name, e in engines.items()}
        for server in servers.values():
            await server.start_server()
        listed = model_dir / "workers.yaml"
        listed.write_text(yaml.safe_dump([_entry("co-0", servers["co-0"])]))
        doc = {
            "index": {"block_size": BS},
            "server": {"model_dir": str(model_dir), "workers_file": str(listed), "workers_poll_s": POLL_S},
        }
        path = model_dir / "router-file.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg = load_config(path)
        router = build_server(cfg, fleet_from_config(cfg), feed_index=False)
        served: list[str] = []
        statuses: list[int] = []
        try:
            async with TestClient(TestServer(router.app(), host="127.0.0.1")) as client:

                async def send(n: int) -> None:
                    for i in range(n):
                        body = {"prompt": [*PROMPT, i % 7], "max_tokens": 2}
                        resp = await client.post("/v1/completions", json=body)
                        statuses.append(resp.status)
                        served.append(resp.headers.get("X-KVPilot-Decode-Worker", ""))
                        await asyncio.sleep(0.005)

                async def health() -> list[str]:
                    return list((await (await client.get("/health")).json())["workers"])

                async def until(workers: list[str]) -> None:
                    for _ in range(200):
                        if await health() == workers:
                            return
                        await asyncio.sleep(POLL_S)
                    raise AssertionError(f"the fleet is {await health()}, not {workers}")

                assert await health() == ["co-0"]  # read at start
                load = asyncio.create_task(send(120))
                listed.write_text(yaml.safe_dump([_entry(n, servers[n]) for n in ("co-0", "co-1")]))
                await until(["co-0", "co-1"])  # co-1 joined
                listed.write_text(yaml.safe_dump([_entry("co-1", servers["co-1"])]))
                await until(["co-1"])  # co-0 left
                joined_at = len(served)
                listed.write_text("- {name: broken")  # an edit that does not parse: the fleet stays
                await asyncio.sleep(5 * POLL_S)
                assert await health() == ["co-1"]
                await load
                await send(10)
        finally:
            for server in servers.values():
                await server.close()
        assert set(statuses) == {200}, statuses  # no request failed while the fleet changed
        assert "co-1" in served and set(served[joined_at + 1 :]) == {"co-1"}  # after co-0 left, co-1 alone

    asyncio.run(main())


def test_a_file_that_lists_no_fleet_is_refused_at_start_naming_it(model_dir: Path) -> None:
    bad = model_dir / "bad-workers.yaml"
    bad.write_text(yaml.safe_dump([{"name": "p", "role": "prefill", "url": "http://127.0.0.1:9"}]))
    with pytest.raises(ConfigError, match=r"server\.workers_file"):
        WorkersFile(bad, POLL_S).read()
    bad.write_text(yaml.safe_dump([{"name": "x", "role": "nope", "url": "http://127.0.0.1:9"}]))
    with pytest.raises(ConfigError, match=r"server\.workers_file\[0\]"):
        WorkersFile(bad, POLL_S).read()
    with pytest.raises(ConfigError, match="cannot read"):
        WorkersFile(model_dir / "missing.yaml", POLL_S).read()


def test_workers_and_a_workers_file_together_are_refused(model_dir: Path) -> None:
    path = model_dir / "both.yaml"
    worker = {"name": "co-0", "role": "colocated", "url": "http://127.0.0.1:9"}
    path.write_text(yaml.safe_dump({"server": {"workers_file": "w.yaml"}, "workers": [worker]}))
    with pytest.raises(ConfigError, match="workers_file"):
        fleet_from_config(load_config(path))
