"""Config loading: strict, every error named by file and key, shipped files valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent

MINIMAL = """
[gateway]
host = "127.0.0.1"
port = 8080

[[backends]]
name = "chat-a"
kind = "tgi"
url = "http://127.0.0.1:8081"
models = ["acme/small-chat"]
"""


def write(folder: Path, backends: str, **policies: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "backends.toml").write_text(backends)
    if policies:
        (folder / "policies").mkdir(exist_ok=True)
        for name, text in policies.items():
            (folder / "policies" / f"{name}.toml").write_text(text)
    return folder


def test_design_minimal_backends_toml_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    assert config.gateway.port == 8080
    assert config.backends[0].kind == "tgi"
    assert config.backends[0].models == ["acme/small-chat"]
    assert config.upstream.idle_timeout_s == 60.0
    assert config.policies.requests.chat.max_body_bytes == 1024 * 1024


def test_shipped_config_is_valid() -> None:
    config = load_config(ROOT)
    assert config.backends, "the shipped backends.toml must declare a backend"


def test_every_error_is_reported_with_file_and_key(tmp_path: Path) -> None:
    bad = MINIMAL.replace('models = ["acme/small-chat"]', 'modles = ["x"]\nweight = 0') + """
[[backends]]
name = "chat-a"
kind = "gpu"
url = "ftp://somewhere"
models = ["m"]
forward_headers = ["Authorization"]
"""
    folder = write(tmp_path, bad, requests="[chat]\nmax_body_bytes = 'big'\n", nonsense="x = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(folder)
    problems = caught.value.problems
    text = "\n".join(problems)
    assert "backends.toml: backends[0].modles: Extra inputs are not permitted" in text
    assert "backends.toml: backends[0].models: Field required" in text
    assert "backends.toml: backends[0].weight: Input should be greater than or equal to 1" in text
    assert "backends.toml: backends[1].kind: Input should be" in text
    assert "policies/requests.toml: chat.max_body_bytes: Input should be a valid integer" in text
    assert "policies/nonsense.toml: unknown policy file" in text


def test_semantic_errors(tmp_path: Path) -> None:
    bad = MINIMAL + """
[[backends]]
name = "chat-a"
kind = "vllm"
url = "ftp://somewhere"
models = ["m"]
forward_headers = ["Authorization", "x-sim-*"]
"""
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, bad))
    text = "\n".join(caught.value.problems)
    assert "backends[1].name: duplicate backend name 'chat-a'" in text
    assert "backends[1].url: must be an http:// or https:// URL" in text
    assert "backends[1].forward_headers: 'Authorization' may never be forwarded" in text


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"backends\.toml: file not found"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"backends\.toml: not valid TOML"):
        load_config(write(tmp_path, "[gateway\n"))


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path / "good", MINIMAL)
    assert main(["check-config", "--config", str(good)]) == 0
    assert "ok: 1 backend(s)" in capsys.readouterr().out
    bad = write(tmp_path / "bad", MINIMAL + "\n[surprise]\nx = 1\n")
    assert main(["check-config", "--config", str(bad)]) == 1
    assert "config error: backends.toml: surprise: Extra inputs are not permitted" in (
        capsys.readouterr().err)


def test_server_section_defaults_and_strictness(tmp_path: Path) -> None:
    server = load_config(write(tmp_path / "defaults", MINIMAL)).server
    assert (server.keepalive_timeout_s, server.header_timeout_s, server.body_timeout_s,
            server.write_timeout_s, server.max_connections) == (15.0, 10.0, 30.0, 30.0, 4096)

    tuned = MINIMAL + "\n[server]\nheader_timeout_s = 2.5\nmax_connections = 100\n"
    server = load_config(write(tmp_path / "tuned", tuned)).server
    assert (server.header_timeout_s, server.max_connections) == (2.5, 100)

    bad = MINIMAL + ("\n[server]\nkeepalive_s = 5\nheader_timeout_s = 0\n"
                     "max_connections = 'many'\n")
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path / "bad", bad))
    text = "\n".join(caught.value.problems)
    assert "backends.toml: server.keepalive_s: Extra inputs are not permitted" in text
    assert "backends.toml: server.header_timeout_s: Input should be greater than 0" in text
    assert "backends.toml: server.max_connections: Input should be a valid integer" in text


NETWORK = """
[[backends]]
name = "big-a"
kind = "vllm"
url = "http://127.0.0.1:8086"
models = ["acme/gpt-oss-120b"]
modes = ["direct", "network"]

[[backends]]
name = "big-b"
kind = "vllm"
url = "http://127.0.0.1:8087"
models = ["acme/gpt-oss-120b"]
modes = ["network"]
"""


def problems_of(folder: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(folder)
    return "\n".join(caught.value.problems)


def test_backend_modes_and_network_policy(tmp_path: Path) -> None:
    config = load_config(write(tmp_path / "ok", MINIMAL + NETWORK))
    assert [b.modes for b in config.backends] == [["direct"], ["direct", "network"], ["network"]]
    network = config.policies.requests.network
    assert (network.replicas, network.quorum, network.seed, network.needed) == (2, None, 0, 2)
    tuned = load_config(write(tmp_path / "tuned", MINIMAL + NETWORK,
                              requests="[network]\nreplicas = 2\nquorum = 1\nseed = 42\n"))
    assert tuned.policies.requests.network.needed == 1
    assert tuned.policies.requests.network.seed == 42
    third = NETWORK.split("[[backends]]")[2].replace("big-b", "big-c").replace("8087", "8088")
    three = load_config(write(tmp_path / "three", MINIMAL + NETWORK + "[[backends]]" + third,
                              requests="[network]\nreplicas = 3\n"))
    assert three.policies.requests.network.needed == 2  # a majority of 3


def test_backend_modes_are_checked(tmp_path: Path) -> None:
    schema = MINIMAL.replace('models = ["acme/small-chat"]',
                             'models = ["acme/small-chat"]\nmodes = []') + """
[[backends]]
name = "odd"
kind = "vllm"
url = "http://127.0.0.1:9002"
models = ["m"]
modes = ["broadcast"]
"""
    text = problems_of(write(tmp_path / "schema", schema))
    assert "backends.toml: backends[0].modes: List should have at least 1 item" in text
    assert "backends.toml: backends[1].modes[0]: Input should be 'direct' or 'network'" in text
    rules = MINIMAL + """
[[backends]]
name = "dup"
kind = "vllm"
url = "http://127.0.0.1:9001"
models = ["m"]
modes = ["direct", "direct"]

[[backends]]
name = "asr"
kind = "whisper"
url = "http://127.0.0.1:9003"
models = ["w"]
modes = ["direct", "network"]
"""
    text = problems_of(write(tmp_path / "rules", rules))
    assert "backends.toml: backends[1].modes: lists a mode twice" in text
    assert "backends.toml: backends[2].modes: speech recognition is direct-only" in text
    families = MINIMAL + """
[[backends]]
name = "e1"
kind = "vllm"
family = "embed"
url = "http://127.0.0.1:9004"
models = ["e"]
modes = ["network"]

[[backends]]
name = "e2"
kind = "tgi"
family = "embed"
url = "http://127.0.0.1:9005"
models = ["t"]

[[backends]]
name = "e3"
kind = "tei"
family = "chat"
url = "http://127.0.0.1:9006"
models = ["t2"]
"""
    text = problems_of(write(tmp_path / "families", families))
    assert "backends.toml: backends[1].modes: embeddings are direct-only" in text
    problems = text.splitlines()
    assert "backends.toml: backends[2].family: a 'tgi' backend serves 'chat'" in problems
    assert "backends.toml: backends[3].family: a 'tei' backend serves 'embed'" in problems
    assert not any("backends[1].family" in p for p in problems)  # vllm may serve embed


def test_network_policy_is_checked(tmp_path: Path) -> None:
    text = problems_of(write(tmp_path / "quorum", MINIMAL + NETWORK,
                             requests="[network]\nquorum = 3\n"))
    assert "policies/requests.toml: network.quorum: must not exceed network.replicas (3 > 2)" \
        in text
    text = problems_of(write(tmp_path / "range", MINIMAL,
                             requests="[network]\nreplicas = 1\nseed = -1\ncount = 2\n"))
    assert "policies/requests.toml: network.replicas: Input should be greater than or equal " \
        "to 2" in text
    assert "policies/requests.toml: network.seed: Input should be greater than or equal" in text
    assert "policies/requests.toml: network.count: Extra inputs are not permitted" in text
    # A network pool smaller than `replicas` could never run a request.
    text = problems_of(write(tmp_path / "small", MINIMAL + NETWORK,
                             requests="[network]\nreplicas = 3\n"))
    assert ("backends.toml: model 'acme/gpt-oss-120b' is offered in network mode by 2 "
            "backend(s) (big-a, big-b), fewer than policies/requests.toml network.replicas (3)"
            ) in text


def test_shipped_config_offers_network_mode() -> None:
    config = load_config(ROOT)
    network = [b for b in config.backends if "network" in b.modes]
    assert len({b.name for b in network}) >= config.policies.requests.network.replicas
    assert all(b.command for b in network) and {m for b in network for m in b.models} == {
        "acme/gpt-oss-120b"}


def test_routing_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path / "default", MINIMAL))
    assert (config.routing.pick, config.routing.prefill_ms_per_1k_tokens) == ("prefix", 60)
    tuned = load_config(write(tmp_path / "tuned", MINIMAL + '\n[routing]\npick = "engine"\n'
                              'models = { "acme/small-chat" = "p2c" }\ncache_tokens = 4096\n'))
    assert tuned.routing.pick == "engine" and tuned.routing.models == {"acme/small-chat": "p2c"}
    assert tuned.routing.cache_tokens == 4096
    text = problems_of(write(tmp_path / "bad", MINIMAL + '\n[routing]\npick = "random"\n'
                             'prefill_ms_per_1k_tokens = -1\n'))
    assert "backends.toml: routing.pick: Input should be 'prefix', 'engine' or 'p2c'" in text
    assert ("backends.toml: routing.prefill_ms_per_1k_tokens: Input should be greater than or "
            "equal to 0") in text
    text = problems_of(write(tmp_path / "typo", MINIMAL + '\n[routing]\n'
                             'models = { "acme/nope" = "engine" }\n'))
    assert "backends.toml: routing.models: 'acme/nope' is not a chat model of any backend" \
        in text


def test_the_shipped_config_forwards_no_client_header() -> None:
    """The file an operator copies passes nothing a client sends upstream; the simulators' fault
    headers are forwarded only by the example made for trying failures."""
    assert [b.forward_headers for b in load_config(ROOT).backends if b.forward_headers] == []
    faults = load_config(ROOT / "deploy" / "sim-faults")
    assert [b.forward_headers for b in faults.backends] == [["x-sim-*"]]


def test_group_token_limits_name_known_groups(tmp_path: Path) -> None:
    tiers = """
[groups]
large = ["acme/big"]
[tiers.guest]
requests_per_minute = 3
families = ["chat"]
models = { "*" = ["direct"] }
[tiers.pro]
requests_per_minute = 60
families = ["chat"]
models = { "*" = ["direct"] }
output_tokens_per_minute = 5000
[tiers.pro.group_tokens.large]
tokens_per_minute = 20000
input_tokens_per_day = 100000
[tiers.pro.group_tokens.nonesuch]
tokens_per_minute = 1
"""
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, MINIMAL, tiers=tiers))
    assert caught.value.problems == [
        "policies/tiers.toml: tiers.pro.group_tokens.nonesuch: unknown model group (the tier's "
        "own limits count every model)"]
    valid = tiers.split("[tiers.pro.group_tokens.n")[0]
    config = load_config(write(tmp_path, MINIMAL, tiers=valid))
    pro = config.policies.tiers.tiers["pro"]
    assert pro.group_tokens["large"].input_tokens_per_day == 100000
    assert pro.output_tokens_per_minute == 5000
