"""backends.toml rules for supervised backends and the fleet sections; the shipped file starts
its backends itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import ConfigError, load_config
from proxy.upstream.pool import health_path
from proxy.upstream.router import Router

ROOT = Path(__file__).resolve().parents[2]

SUPERVISED = """
[[backends]]
name = "a"
kind = "vllm"
url = "http://127.0.0.1:9001"
models = ["m"]
command = ["python", "-m", "proxy", "simulate", "vllm", "--port", "9001"]
env = { VLLM_LOGGING_LEVEL = "DEBUG" }
cwd = "models"
"""


def problems(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "backends.toml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    return caught.value.problems


def test_supervised_backend_loads(tmp_path: Path) -> None:
    (tmp_path / "backends.toml").write_text(SUPERVISED)
    spec = load_config(tmp_path).backends[0]
    assert spec.command and spec.command[0] == "python" and spec.cwd == "models"
    assert spec.env == {"VLLM_LOGGING_LEVEL": "DEBUG"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SUPERVISED.replace('command = ["python", "-m", "proxy", "simulate", "vllm", "--port", '
                            '"9001"]', "command = []"),
         "backends[0].command: must name the program to run"),
        (SUPERVISED + SUPERVISED.replace('name = "a"', 'name = "b"'),
         "backends[1].url: the same address as 'a', also started by the gateway"),
        (SUPERVISED.replace("[[backends]]", '[[backends]]\nhealth_path = "health"'),
         "backends[0].health_path: must start with '/'"),
        (SUPERVISED.replace("command = [", "commandz = ["), "backends[0].commandz"),
        ("[health]\nejection_base_s = 600\n" + SUPERVISED,
         "health.ejection_base_s: must not exceed ejection_max_s"),
        ("[supervisor]\nbackoff_base_s = 120\n" + SUPERVISED,
         "supervisor.backoff_base_s: must not exceed backoff_max_s"),
        ("[gateway]\nworkers = 0\n" + SUPERVISED, "gateway.workers"),
        ('[[backends]]\nname = "x"\nkind = "tgi"\nurl = "http://h:1"\nmodels = ["m"]\n'
         'cwd = "x"\n', "backends[0]: env and cwd apply only to a backend with a command"),
        ('[[backends]]\nname = "x"\nkind = "tgi"\nurl = "http://h:1"\nmodels = ["m"]\n'
         'kv_events = "tcp://h:5557"\n', "backends[0].kv_events: only vLLM publishes"),
        (SUPERVISED.replace("[[backends]]", '[[backends]]\nkv_events = "tcp://*:5557"'),
         "backends[0].kv_events: name the engine's host"),
        (SUPERVISED.replace("[[backends]]", '[[backends]]\nkv_events = "http://h:5557"'),
         "backends[0].kv_events"),
    ],
)
def test_fleet_config_problems_are_named(tmp_path: Path, text: str, expected: str) -> None:
    found = problems(tmp_path, text)
    assert any(expected in p for p in found), found


def test_shipped_backends_toml_starts_its_simulator() -> None:
    config = load_config(ROOT)
    supervised = [b for b in config.backends if b.command]
    assert supervised, "`inference-gateway serve` alone must bring up a working stack"
    for spec in supervised:
        assert spec.command is not None and spec.command[:3] == ["python", "-m", "proxy"]
        assert health_path(spec) == "/health"
    assert all(b.supervised for b in Router(config.backends).backends if b.spec.command)
