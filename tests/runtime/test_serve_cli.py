"""The README's path as a new user runs it: `simulate` + `serve` processes, the openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from proxy.store.redis_process import socket_path
from tests.support.config_files import MODEL, write_config
from tests.support.processes import free_port, wait_until_ready


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path, Path]]:
    sim_port, gw_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("GATEWAY_REDIS_URL", None)
    sim = subprocess.Popen(
        [sys.executable, "-m", "proxy", "simulate", "vllm", "--port", str(sim_port),
         "--model", MODEL], env=env)
    data_dir = tmp_path / "data"
    folder = write_config(tmp_path / "config", [{
        "name": "chat-a", "kind": "vllm", "url": f"http://127.0.0.1:{sim_port}",
        "models": [MODEL]}], gateway={"port": gw_port, "data_dir": str(data_dir)})
    gateway = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(folder)], env=env)
    try:
        wait_until_ready(f"http://127.0.0.1:{sim_port}/health", sim)
        wait_until_ready(f"http://127.0.0.1:{gw_port}/readyz", gateway)
        yield f"http://127.0.0.1:{gw_port}", gateway, data_dir, folder
    finally:
        for proc in (gateway, sim):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


def test_openai_client_through_served_gateway_with_embedded_redis(
    stack: tuple[str, subprocess.Popen[bytes], Path, Path]
) -> None:
    base, gateway, data_dir, folder = stack
    # The operator's first step: a key, from the CLI, stored in the gateway's embedded Redis.
    created = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "create", "--account", "demo", "--tier", "basic",
         "--config", str(folder)], capture_output=True, text=True, timeout=30, check=True)
    key = created.stdout.split()[0]
    with openai.OpenAI(base_url=f"{base}/v2/compat/v1", api_key=key, max_retries=0) as client:
        plain = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}])
        assert plain.choices[0].message.content
        streamed = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == plain.choices[0].message.content
        typo = key[:-1] + ("0" if key[-1] != "0" else "1")
        with pytest.raises(openai.AuthenticationError), openai.OpenAI(
                base_url=f"{base}/v2/compat/v1", api_key=typo, max_retries=0) as wrong:
            wrong.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}])

    # The embedded redis-server runs on a unix socket in the data dir, with AOF on ...
    sock = socket_path(data_dir / "redis")
    assert sock.exists()
    assert any(p.name.startswith("appendonly") for p in (data_dir / "redis").iterdir())
    # ... and goes away with the gateway.
    gateway.send_signal(signal.SIGTERM)
    assert gateway.wait(15) == 0
    deadline = time.monotonic() + 5
    while sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sock.exists()


def test_sighup_reloads_policies_and_refuses_a_bad_file(
    stack: tuple[str, subprocess.Popen[bytes], Path, Path]
) -> None:
    base, gateway, _, folder = stack
    created = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "create", "--account", "hup", "--tier", "basic",
         "--config", str(folder)], capture_output=True, text=True, timeout=30, check=True)
    key = created.stdout.split()[0]

    def limit() -> str:
        response = httpx.get(f"{base}/v2/account", headers={"X-API-Key": key}, timeout=5)
        return response.headers["X-RateLimit-Limit"]

    def wait_for(expected: str) -> None:
        deadline = time.monotonic() + 10
        while limit() != expected:
            assert time.monotonic() < deadline, f"limit never became {expected}"
            time.sleep(0.1)

    assert limit() == "20"  # the default basic tier
    tiers = folder / "policies" / "tiers.toml"
    tiers.write_text('[tiers.guest]\nrequests_per_minute = 3\nfamilies = ["chat"]\n'
                     'models = { "*" = ["direct"] }\n[tiers.basic]\nrequests_per_minute = 7\n'
                     'families = ["chat"]\nmodels = { standard = ["direct"] }\n')
    gateway.send_signal(signal.SIGHUP)
    wait_for("7")
    tiers.write_text("[tiers.basic]\nrequests_per_minute = 'many'\n")
    gateway.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert limit() == "7" and gateway.poll() is None  # refused: the old policy stays in force
