"""Real vLLM replicas for the real-engine tier: install or reuse, build the model, start, stop.

Everything heavy lives outside the clone, under $REAL_ENGINES_DIR (default ~/.cache/real-engines),
and is reused when present: the vLLM venv (3.5 GB, ~2 min to install) and the tiny model. The
same scripts serve docs/real-engine.md's "Try it on a real engine" (scripts/real-engine/).

Each replica is `serve-tiny.sh` exec'ing `vllm serve` in a new session, so its API server,
EngineCore and worker share one process group and are stopped together (SIGTERM, grace,
SIGKILL). A setup that fails raises `EngineSetupError` with the reason and the log's tail.
A chat replica with `traces_to` exports its traces there (OTLP/HTTP: serve-tiny.sh's
OTLP_TRACES_ENDPOINT); the tier sends them to the session's trace backend (trace_backend.py).
The Whisper replica is the same, run by `serve-whisper.sh` (a second venv with vLLM's audio
extras, and a tiny random Whisper). `backend()` and `whisper_backend()` are the backends.toml
entries an operator writes for them. tests/real_engine/conftest.py holds the tier's fixtures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.support.processes import stop_group, tail

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "real-engine"
CACHE = Path(os.environ.get("REAL_ENGINES_DIR") or "~/.cache/real-engines").expanduser()
SERVED = "acme/tiny"
MAX_MODEL_LEN = 1024
# Small queues so that admission control (503) and waiting show up under a light load; prompt
# token details for cached tokens, with blocks small enough (32) for short prompts to hit; a
# KV cache of 256 blocks (8,192 tokens: twice what four requests of the whole context hold),
# so that a test can make the engine evict; tool calls parsed as a Hermes/Qwen model's
# (requests with tools need a parser).
REPLICA_ARGS = ("--max-num-seqs", "4", "--max-num-queued-reqs", "8",
                "--enable-prompt-tokens-details", "--block-size", "32",
                "--num-gpu-blocks-override", "256",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
PREPARE_TIMEOUT_S = 20 * 60  # a first install is ~2 min; a slow mirror gets room
START_TIMEOUT_S = 300  # ~30 s each, two at once on two cores; more while the box is busy
STOP_GRACE_S = 15
CHAT_SCRIPT = "serve-tiny.sh"
# The Whisper replica: vLLM's own max_model_len (448) and limits (25 MB, 600 s of audio).
WHISPER_SCRIPT = "serve-whisper.sh"
WHISPER_SERVED = "acme/whisper-tiny"
WHISPER_ARGS = ("--max-num-seqs", "4")
# The embedding replica (serve-embed.sh): a tiny decoder-based embedder, 256-dim vectors,
# Matryoshka 32/64/128/256, max_model_len 512, served in float32.
EMBED_SCRIPT = "serve-embed.sh"
EMBED_SERVED = "acme/tiny-embed"
EMBED_ARGS = ("--max-num-seqs", "4")


class EngineSetupError(Exception):
    """The tier cannot run: install, model build or start failed (the message says why)."""


def prepare(log: Path, script: str = CHAT_SCRIPT) -> float:
    """Install vLLM and build the model unless cached; returns the seconds it took."""
    started = time.monotonic()
    env = {**os.environ, "REAL_ENGINES_DIR": str(CACHE)}
    with log.open("ab") as out:
        try:
            done = subprocess.run(["bash", str(SCRIPTS / script), "--prepare"],
                                  stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=PREPARE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise EngineSetupError(f"installing vLLM took over {PREPARE_TIMEOUT_S} s; "
                                   f"log {log}:\n{tail(log)}") from None
    if done.returncode != 0:
        raise EngineSetupError(f"installing vLLM or building the tiny model failed (exit "
                               f"{done.returncode}); log {log}:\n{tail(log)}")
    return time.monotonic() - started


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of GET `url`, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


@dataclass
class Replica:
    name: str
    port: int
    core: int | str  # VLLM_CPU_OMP_THREADS_BIND: a core, or a list ("0-1") the server keeps to
    log: Path
    script: str = CHAT_SCRIPT
    args: tuple[str, ...] = REPLICA_ARGS
    traces_to: str | None = None  # an OTLP/HTTP traces URL (serve-tiny.sh's OTLP_TRACES_ENDPOINT)
    events_port: int | None = None  # where it publishes its KV-cache events (ZMQ PUB, bound)
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0  # how long the last start took to /health 200
    starts: int = 0
    _t0: float = field(default=0.0, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "REAL_ENGINES_DIR": str(CACHE),
               "VLLM_CPU_OMP_THREADS_BIND": str(self.core)}
        env.pop("OTLP_TRACES_ENDPOINT", None)
        if self.traces_to is not None:
            env["OTLP_TRACES_ENDPOINT"] = self.traces_to
        # serve-tiny.sh keeps the whole replica on its core: a busy vLLM's EngineCore spins
        # beside its worker, and would take the other core from the other replica and the tests.
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["bash", str(SCRIPTS / self.script), str(self.port), *self.args,
                 *self.events_args()],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._t0 = time.monotonic()
        self.starts += 1

    @property
    def events_url(self) -> str | None:
        """Where the gateway reads its KV-cache events (backends.toml `kv_events`)."""
        return f"tcp://127.0.0.1:{self.events_port}" if self.events_port else None

    def events_args(self) -> list[str]:
        if self.events_port is None:
            return []
        # A wildcard host makes vLLM bind (any other, connect).
        return ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}"})]

    def poll_ready(self) -> bool:
        """True once /health answers 200; EngineSetupError when the process exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise EngineSetupError(f"vLLM replica {self.name} exited during startup (exit "
                                   f"{self.proc.returncode}); log {self.log}:\n{tail(self.log)}")
        if http_status(self.url + "/health") == 200:
            self.started_s = time.monotonic() - self._t0
            return True
        return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the whole process group, then SIGKILL after a grace period."""
        if self.proc is None:
            return
        stop_group(self.proc, STOP_GRACE_S)  # the engine's children too
        self.proc = None

    def engine_core(self) -> psutil.Process:
        """The EngineCore child of this replica's API server (what `kill -9` takes down)."""
        assert self.proc is not None
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "EngineCore" in " ".join(child.cmdline()) or "EngineCor" in child.name():
                    return child
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no EngineCore process under replica {self.name}")

    def kill_core(self) -> None:
        self.engine_core().send_signal(signal.SIGKILL)


class Engines:
    """The tier's replicas: started together, each on its own core, restarted when dead."""

    def __init__(self, replicas: list[Replica], log: Path, script: str = CHAT_SCRIPT) -> None:
        self.replicas = replicas
        self.log = log
        self.script = script  # whose --prepare installs and builds what they need
        self.prepare_s = 0.0
        self._launched: list[Replica] = []  # started by `launch`, not yet seen ready

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def start(self) -> None:
        self.prepare_s = prepare(self.log, self.script)
        self.ensure_up()

    def launch(self) -> None:
        """Install and build what is missing, and start the replicas without waiting for them
        (`ensure_up` waits): their start overlaps another fleet's."""
        self.prepare_s = prepare(self.log, self.script)
        for replica in self.replicas:
            replica.start()
        self._launched = list(self.replicas)

    def ensure_up(self) -> None:
        """Start every replica that is not running (in parallel) and wait for /health 200
        (also for those `launch` started)."""
        down = [r for r in self.replicas if not r.running]
        for replica in down:
            replica.stop()  # reap a dead one's group before reusing its port
            replica.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = self._launched + [r for r in down if r not in self._launched]
        self._launched = []
        try:
            while waiting:
                waiting = [r for r in waiting if not r.poll_ready()]
                if waiting and time.monotonic() > deadline:
                    names = ", ".join(r.name for r in waiting)
                    raise EngineSetupError(
                        f"vLLM replica(s) {names} not ready after {START_TIMEOUT_S} s; log "
                        f"{waiting[0].log}:\n{tail(waiting[0].log)}")
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


def backend(replica: Replica, **extra: object) -> dict[str, object]:
    """backends.toml's entry for a replica (as an operator writes it for a real vLLM)."""
    return {"name": replica.name, "kind": "vllm", "url": replica.url, "models": [SERVED],
            **extra}


def embed_backend(replica: Replica, **extra: object) -> dict[str, object]:
    """backends.toml's entry for the embedding replica: a vLLM serving an embedding model."""
    return {"name": replica.name, "kind": "vllm", "family": "embed", "url": replica.url,
            "models": [EMBED_SERVED], **extra}


def whisper_backend(replica: Replica, **extra: object) -> dict[str, object]:
    """backends.toml's entry for the Whisper replica (vLLM speaks the OpenAI audio wire)."""
    return {"name": replica.name, "kind": "whisper", "api": "openai", "url": replica.url,
            "models": [WHISPER_SERVED], **extra}
