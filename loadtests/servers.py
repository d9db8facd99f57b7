"""The servers under test: a simulator and a gateway in front of it, as pinned child processes.

Each child gets its own session (a terminal's Ctrl-C reaches only the driver, which then stops
them in order) and, on Linux, a parent-death signal, so even a SIGKILLed driver leaves no
servers behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# The children run `python -m proxy` from this working tree, whatever the caller's directory.
ROOT = Path(__file__).resolve().parent.parent


class ServerFailed(RuntimeError):
    """A server exited early or never became ready; the message ends with its log tail."""


@dataclass(frozen=True)
class Pinning:
    server_core: int
    load_core: int


def plan_pinning() -> Pinning | None:
    """Servers on the first usable core, the load generator on the second (DESIGN §7)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return Pinning(cores[0], cores[1]) if len(cores) >= 2 else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """One child process, its output in a log file."""

    def __init__(self, name: str, args: Sequence[str], log_path: Path, core: int | None) -> None:
        self.name = name
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=ROOT, start_new_session=True, preexec_fn=_child_setup(core),
            )

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM (the gateway then stops its own redis-server), then SIGKILL the group."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
                return
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def cpu_seconds(self) -> float | None:
        """CPU time of the process and its direct children (the gateway's redis-server)."""
        pids = [self.popen.pid]
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children")
            pids += [int(pid) for pid in children.read_text().split()]
        total = 0.0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                return None
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def failed(self, why: str) -> ServerFailed:
        return ServerFailed(f"{self.name} {why}; its last output:\n{self.log_tail()}")


def wait_ready(url: str, *, timeout: float = 30.0, server: Server | None = None) -> None:
    """Poll `url` until it answers 200; fail fast when the server has already exited."""
    deadline = time.monotonic() + timeout
    while True:
        if server is not None and server.popen.poll() is not None:
            raise server.failed(f"exited with code {server.popen.returncode}")
        # URLError (refused, or HTTPError for a 503 while not ready yet) is an OSError.
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            if server is not None:
                raise server.failed(f"not ready at {url} after {timeout:.0f} s")
            raise ServerFailed(f"not ready at {url} after {timeout:.0f} s")
        time.sleep(0.1)


def simulator_args(
    kind: str, port: int, model: str, *, completion_tokens: int, concurrency: int
) -> list[str]:
    return [
        sys.executable, "-m", "proxy", "simulate", kind, "--host", "127.0.0.1",
        "--port", str(port), "--model", model, "--tokens-per-s", "0", "--ttft-ms", "0",
        "--completion-tokens", str(completion_tokens),
        # The TGI simulator answers 429 above its cap, which would count as gateway errors.
        "--max-concurrency", str(max(128, concurrency)),
    ]


def gateway_args(config_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "proxy", "serve", "--config", str(config_dir),
            "--port", str(port), "--workers", "1"]  # DESIGN §7 measures one worker


def write_gateway_config(
    folder: Path, *, port: int, upstream_url: str, kind: str, model: str
) -> Path:
    """A one-backend config whose embedded redis-server lives in `folder` (JSON strings are
    valid TOML basic strings, which quotes paths and URLs safely)."""
    q = json.dumps
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "backends.toml").write_text(
        "[gateway]\n"
        f'host = "127.0.0.1"\nport = {port}\ndata_dir = {q(str(folder / "data"))}\n\n'
        "[[backends]]\n"
        f'name = "bench"\nkind = {q(kind)}\nurl = {q(upstream_url)}\nmodels = [{q(model)}]\n'
        "max_concurrency = 100000\n"
    )
    # A tier fast enough never to limit the benchmark, so the full policy path (key lookup, the
    # Redis rate-limit hit) runs on every request without rejecting any.
    (folder / "policies").mkdir(exist_ok=True)
    (folder / "policies" / "tiers.toml").write_text(
        '[tiers.guest]\nrequests_per_minute = 3\nfamilies = ["chat"]\n'
        'models = { "*" = ["direct"] }\n\n'
        '[tiers.bench]\nrequests_per_minute = 1000000\nfamilies = ["chat"]\n'
        'models = { "*" = ["direct", "network"] }\n'
    )
    return folder


def create_key(config_dir: Path) -> str:
    """A bench-tier key, created through the CLI like an operator would."""
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "keys", "create", "--account", "bench", "--tier",
         "bench", "--config", str(config_dir)],
        capture_output=True, text=True, timeout=30, check=True,
    )
    return done.stdout.split()[0]


def _child_setup(core: int | None) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        if core is not None:
            os.sched_setaffinity(0, {core})  # inherited by the gateway's redis-server too
        if sys.platform == "linux":
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup
