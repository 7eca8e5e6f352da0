"""``kvpilot engine-flags``: every engine's ``vllm serve`` command from the router's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.deploy.cli import main
from kvpilot.deploy.engine_flags import EngineSettings, engine_commands, named_hosts
from kvpilot.deploy.env import HASH_SEED_ENV
from kvpilot.routing.config import ConfigError
from kvpilot.routing.config_load import load_config

RECIPES = Path(__file__).resolve().parents[3] / "deploy" / "recipes"


def _config(tmp_path: Path, workers: str, extra: str = "") -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(f"server: {{model_dir: /models/m, model_name: m{extra}}}\nindex: {{block_size: 16}}\n{workers}")
    return path


TWO_ON_ONE_HOST = """workers:
  - {name: prefill-0, role: prefill, url: "http://10.0.0.11:8100", kv_events_endpoint: "tcp://10.0.0.10:5700",
     replay_endpoint: "tcp://10.0.0.11:5800"}
  - {name: decode-0, role: decode, url: "http://10.0.0.11:8101", kv_events_endpoint: "tcp://10.0.0.10:5701",
     replay_endpoint: "tcp://10.0.0.11:5801", topic: d0}
  - {name: decode-1, role: decode, url: "http://10.0.0.12:8100", kv_events_endpoint: "tcp://*:5702"}
"""


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_engine_publishes_to_the_endpoint_the_router_binds_for_it(tmp_path: Path) -> None:
    config = load_config(_config(tmp_path, TWO_ON_ONE_HOST))
    commands = engine_commands(config, EngineSettings(router_host="10.0.0.10"))
    events = [json.loads(_flag(c.argv, "--kv-events-config")) for c in commands]
    assert [e["endpoint"] for e in events] == ["tcp://10.0.0.10:5700", "tcp://10.0.0.10:5701", "tcp://10.0.0.10:5702"]
    assert [e.get("replay_endpoint") for e in events] == ["tcp://10.0.0.11:5800", "tcp://10.0.0.11:5801", None]
    assert [e["topic"] for e in events] == ["kv", "d0", "kv"]
    assert all(e["enable_kv_cache_events"] and e["publisher"] == "zmq" for e in events)


def test_every_engine_shares_the_hash_settings_and_gets_its_own_side_channel(tmp_path: Path) -> None:
    config = load_config(_config(tmp_path, TWO_ON_ONE_HOST))
    commands = engine_commands(config, EngineSettings(router_host="10.0.0.10", kv_cache_dtype="fp8"))
    for command in commands:
        assert command.argv[:3] == ("vllm", "serve", "/models/m")
        assert _flag(command.argv, "--block-size") == "16"
        assert _flag(command.argv, "--prefix-caching-hash-algo") == "sha256"
        assert _flag(command.argv, "--kv-cache-dtype") == "fp8"
        assert command.env["PYTHONHASHSEED"] == HASH_SEED_ENV["PYTHONHASHSEED"]
        assert json.loads(_flag(command.argv, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
    sides = [(c.env["VLLM_NIXL_SIDE_CHANNEL_HOST"], c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for c in commands]
    assert sides == [("10.0.0.11", "5600"), ("10.0.0.11", "5601"), ("10.0.0.12", "5600")]  # two on one host
    assert [(_flag(c.argv, "--host"), _flag(c.argv, "--port")) for c in commands] == [
        ("10.0.0.11", "8100"),
        ("10.0.0.11", "8101"),
        ("10.0.0.12", "8100"),
    ]


def test_the_config_s_limits_reach_the_engines(tmp_path: Path) -> None:
    config = load_config(_config(tmp_path, TWO_ON_ONE_HOST, ", max_model_len: 4096, max_logprobs: 5"))
    argv = engine_commands(config, EngineSettings(router_host="r", tensor_parallel_size=2))[0].argv
    assert _flag(argv, "--max-model-len") == "4096" and _flag(argv, "--max-logprobs") == "5"
    assert _flag(argv, "--tensor-parallel-size") == "2"


def test_vllm_s_own_parser_takes_every_flag(tmp_path: Path) -> None:
    """What vLLM's ``vllm serve`` parses: a flag it lacks or a JSON it refuses fails here."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    config = load_config(_config(tmp_path, TWO_ON_ONE_HOST, ", max_model_len: 4096"))
    settings = EngineSettings(router_host="10.0.0.10", tensor_parallel_size=2, engine_args=("--enforce-eager",))
    for command in engine_commands(config, settings):
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(command.argv[2:]))
        assert args.model_tag == "/models/m" and args.block_size == 16
        assert args.kv_events_config.endpoint.startswith("tcp://10.0.0.10:570")
        assert args.kv_transfer_config.kv_connector == "KVPilotConnector"


@pytest.mark.parametrize(
    ("workers", "settings", "named"),
    [
        (TWO_ON_ONE_HOST, EngineSettings(), "workers.decode-1.kv_events_endpoint"),  # tcp://* and no router host
        (
            'workers:\n  - {name: d, role: decode, url: "http://h:8100"}\n',
            EngineSettings(),
            "workers.d: has no kv_events_endpoint",
        ),
        ('workers:\n  - {name: d, role: decode, url: "http://h"}\n', EngineSettings(), "workers.d.url"),
        ("workers: []\n", EngineSettings(), "workers"),
    ],
)
def test_a_config_engines_cannot_follow_is_refused_by_name(
    tmp_path: Path, workers: str, settings: EngineSettings, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        engine_commands(load_config(_config(tmp_path, workers)), settings)


def test_a_router_host_no_endpoint_needs_is_refused(tmp_path: Path) -> None:
    only_addresses = TWO_ON_ONE_HOST.replace('"tcp://*:5702"', '"tcp://10.0.0.10:5702"')
    with pytest.raises(ValueError, match="--router-host changes nothing"):
        engine_commands(load_config(_config(tmp_path, only_addresses)), EngineSettings(router_host="10.0.0.10"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hash_algo": "md5"}, "hash_algo must be one of"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"engine_args": ("--block-size=32",)}, "engine_args may not set --block-size"),
        ({"side_channel_port": 70000}, "side_channel_port"),
    ],
)
def test_settings_that_cannot_work_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineSettings(**kwargs)  # type: ignore[arg-type]


def test_the_command_prints_the_recipe_s_engines_as_shell_or_json(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(RECIPES / "router-vllm.yaml")
    assert main(["engine-flags", "--config", recipe, "--json"]) == 0
    out, err = capsys.readouterr()
    engines = json.loads(out)
    assert [e["name"] for e in engines] == ["prefill-0", "decode-0"]
    assert err == ""  # the recipe names its engines by address
    ends = [json.loads(_flag(tuple(e["argv"]), "--kv-events-config"))["endpoint"] for e in engines]
    assert ends == ["tcp://10.0.0.10:5700", "tcp://10.0.0.10:5701"]
    assert main(["engine-flags", "--config", recipe, "--engine-args", "--enable-auto-tool-choice"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# prefill-0 (prefill) at http://10.0.0.11:8100\nenv PYTHONHASHSEED=0 ")
    assert out.count("vllm serve ") == 2 and "--enable-auto-tool-choice" in out


def test_a_host_name_in_a_url_is_warned_of_and_a_missing_config_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    named = 'workers:\n  - {name: d0, role: decode, url: "http://d0.example.internal:8100", kv_events_endpoint: "tcp://r:1"}\n'
    config = _config(tmp_path, named)
    assert named_hosts(engine_commands(load_config(config), EngineSettings())) == ["d0"]
    assert main(["engine-flags", "--config", str(config)]) == 0
    assert "d0: the url names the host, not its address" in capsys.readouterr().err
    assert main(["engine-flags", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err
