"""The OpenAPI document says what the gateway does: schemathesis, every check, over every
operation of GET /v2/openapi.json, against a real `serve` process in front of a real simulator,
with a max-tier key that has credits and the admin token.

Bounded and deterministic: a fixed seed and a few examples per operation, about a minute and a half
on two cores (settings in tests/api/schemathesis.toml). What JSON Schema cannot state is handled
in tests/api/schemathesis_hooks.py, each case with its reason; no check is switched off.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.media.wav import wav_bytes
from tests.support.config_files import GENEROUS_TIERS, MODEL, write_config
from tests.support.processes import free_port, wait_until_ready

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SEED = 20260101
EXAMPLES = 30  # per operation and phase: the whole run about 2.5 minutes alone on two cores
CREDITS = "1000000"


class Stack:
    def __init__(self, base: str, folder: Path, env: dict[str, str]) -> None:
        self.base, self.folder, self.env = base, folder, env

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "proxy", *args, "--config", str(self.folder)],
                              capture_output=True, text=True, timeout=60, env=self.env, check=True)
        return done.stdout


# Every family's simulator: kind, backends.toml extras, model.
FAMILIES = (("tts", {}, "acme/csm-1b"), ("whisper", {}, "acme/large-v3"),
            ("image", {"provider": "acme"}, "acme/image-gen"),
            ("video", {"provider": "acme"}, "acme/video-gen"), ("tei", {}, "acme/embed-small"))
AUDIO_HOST = "127.0.0.2"  # serves a WAV for audio_url and custom_voice.url
# How long the stack's processes may take to answer: this test runs first, beside the
# real-engine tier's start (tests/conftest.py), whose vLLM imports take both cores for a minute.
STARTING_S = 120


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    sim_port, gw_port, audio_port = free_port(), free_port(), free_port()
    ports = [free_port() for _ in FAMILIES]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           "GATEWAY_ADMIN_TOKEN": secrets.token_urlsafe(24)}
    env.pop("GATEWAY_REDIS_URL", None)
    media = [{"name": f"{kind}-a", "kind": kind, "url": f"http://127.0.0.1:{port}",
              "models": [model], **extra}
             for (kind, extra, model), port in zip(FAMILIES, ports, strict=True)]
    folder = write_config(
        tmp_path / "config",
        [{"name": "chat-a", "kind": "vllm", "url": f"http://127.0.0.1:{sim_port}",
          "models": [MODEL]}, *media],
        gateway={"port": gw_port, "data_dir": str(tmp_path / "data"), "workers": 1},
        policies={"tiers.toml": GENEROUS_TIERS,  # rate limits must not answer for the schema
                  # Media parts in all a request's messages: no schema can count them.
                  "requests.toml": f'[chat]\nmax_media_parts = 1024\n'
                                   f'[fetch]\nallow_networks = ["{AUDIO_HOST}/32"]\n'
                                   f"ports = [{audio_port}]\n"})
    files = tmp_path / "audio"
    files.mkdir()
    (files / "hello.wav").write_bytes(wav_bytes(b"\x00\x01" * 24000, 24000))
    env["ST_AUDIO_URL"] = f"http://{AUDIO_HOST}:{audio_port}/hello.wav"
    env["ST_AUDIO_FILE"] = str(files / "hello.wav")
    # A context that holds every cap the schema allows: a cap beyond a model's context is the
    # gateway's 422 (documented), which no schema can state.
    procs = [subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "vllm", "--port",
                               str(sim_port), "--model", MODEL, "--max-model-len", "128000"],
                              env=env)]
    procs += [subprocess.Popen([sys.executable, "-m", "proxy", "simulate", kind, "--port",
                                str(port), "--model", model], env=env)
              for (kind, _, model), port in zip(FAMILIES, ports, strict=True)]
    procs.append(subprocess.Popen([sys.executable, "-m", "http.server", "--bind", AUDIO_HOST,
                                   "--directory", str(files), str(audio_port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    gateway = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config", str(folder)],
                               env=env)
    procs.append(gateway)
    try:
        for port, proc in zip([sim_port, *ports], procs, strict=False):
            wait_until_ready(f"http://127.0.0.1:{port}/health", proc, timeout=STARTING_S)
        wait_until_ready(f"http://{AUDIO_HOST}:{audio_port}/hello.wav", procs[-2],
                         timeout=STARTING_S)
        wait_until_ready(f"http://127.0.0.1:{gw_port}/readyz", gateway, timeout=STARTING_S)
        yield Stack(f"http://127.0.0.1:{gw_port}", folder, env)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(15)


def statuses(report: Path) -> Counter[tuple[str, str, int]]:
    """(operation, generation mode, status) of every response in schemathesis' NDJSON events."""
    seen: Counter[tuple[str, str, int]] = Counter()
    for line in report.read_text().splitlines():
        event = json.loads(line)
        recorder = (event.get("ScenarioFinished") or {}).get("recorder") or {}
        interactions = recorder.get("interactions") or {}
        for case_id, node in (recorder.get("cases") or {}).items():
            case = node.get("value", node)
            interaction = interactions.get(case_id) or {}
            response = interaction.get("response")
            mode = ((case.get("meta") or {}).get("generation") or {}).get("mode", "")
            if response is not None:
                seen[(f"{case['method']} {case['path']}", mode, response["status_code"])] += 1
    return seen


def finished_speech_task(base: str, key: str) -> tuple[str, str]:
    """An async TTS task of the run's account, finished: its id and its audio's media key."""
    accepted = httpx.post(f"{base}/v2/audio/tts/engine", headers={"X-API-Key": key},
                          json={"text": "Kept for polling.", "async": True}, timeout=10)
    assert accepted.status_code == 202, accepted.text
    task_id = accepted.json()["task_id"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        record = httpx.get(f"{base}/v2/tasks/{task_id}", headers={"X-API-Key": key},
                           timeout=10).json()
        if record["status"] == "completed":
            return task_id, record["result"]["media_key"]
        time.sleep(0.1)
    raise AssertionError(f"the task did not finish: {record}")


@pytest.mark.timeout(600)
@pytest.mark.long
def test_schemathesis_all_checks_every_operation(stack: Stack, tmp_path: Path) -> None:
    key = stack.cli("keys", "create", "--account", "conformance", "--tier", "max").split()[0]
    stack.cli("credits", "add", "--account", "conformance", "--amount", CREDITS)
    account = httpx.get(f"{stack.base}/v2/account", headers={"X-API-Key": key}, timeout=10)
    assert account.status_code == 200, account.text
    reports = tmp_path / "reports"
    task_id, media_key = finished_speech_task(stack.base, key)
    env = {**stack.env, "ST_API_KEY": key, "ST_KEY_ID": account.json()["key_id"],
           "ST_ADMIN_TOKEN": stack.env["GATEWAY_ADMIN_TOKEN"], "ST_TASK_ID": task_id,
           "ST_MEDIA_KEY": media_key}
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(HERE / "schemathesis.toml"),
         "run", f"{stack.base}/v2/openapi.json", "--checks", "all", "--seed", str(SEED),
         "--max-examples", str(EXAMPLES),
         # Every path: schemathesis leaves out the operation that serves the document unless
         # a filter names it.
         "--include-path-regex", "^/",
         "--no-color", "--report", "ndjson", "--report-dir", str(reports)],
        capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
    if run.returncode != 0:
        pytest.fail(f"schemathesis found differences:\n{run.stdout[-30000:]}\n{run.stderr[-5000:]}")

    # The run must have reached every operation's success path, or "no failures" means little
    # (a revoked key, say, would make every user route a 401 and pass the checks).
    seen = statuses(next(reports.glob("*.ndjson")))
    operations = json.loads(httpx.get(f"{stack.base}/v2/openapi.json", timeout=10).text)["paths"]
    for path, methods in operations.items():
        for method in methods:
            label = f"{method.upper()} {path}"
            ok = sum(n for (op, mode, status), n in seen.items()
                     if op == label and mode == "positive" and 200 <= status < 300)
            assert ok, f"{label}: no schema-valid request succeeded"
    # Whatever schemathesis spent and refunded, the ledger still adds up.
    stack.cli("credits", "reconcile")
