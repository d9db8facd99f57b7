"""Real processes from a test's side: free loopback ports for one to listen on, waiting until a
started process answers 200 (or failing as soon as it exits), stopping one started in a new
session together with its children, and the tail of its log for a failure's message."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports, for a process that listens on several."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def wait_until_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "process exited during startup"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready in {timeout} s")


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the whole process group of `proc` (started with start_new_session=True, so its
    pid is the group id), then SIGKILL to what is left after `grace_s`."""
    group = proc.pid
    _signal_group(group, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    _signal_group(group, signal.SIGKILL)  # its children, if any outlived it
    proc.wait()


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log, or "(no log)"."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
