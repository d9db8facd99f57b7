"""The fleet as an operator runs it, from a test's side: `Stack` is one `serve` process tree
(master, workers, what its supervisor starts) on a config folder of its own, killed whole at the
end; `simulator()` is a backend entry the supervisor starts itself; and the admin view of a
backend once every worker agrees."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil

from tests.support.config_files import GENEROUS_TIERS, MODEL, toml_value
from tests.support.processes import free_port, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
CHAT = "/v2/compat/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
ADMIN = {"Authorization": "Bearer fleet-test-admin"}


def simulator(name: str, *flags: str) -> dict[str, Any]:
    """A backend the gateway starts itself: a simulator on a free port."""
    port = free_port()
    return {
        "name": name, "kind": "vllm", "url": f"http://127.0.0.1:{port}", "models": [MODEL],
        "forward_headers": ["x-sim-*"],
        "command": [sys.executable, "-m", "proxy", "simulate", "vllm", "--port", str(port),
                    "--model", MODEL, *flags],
        "env": {"PYTHONPATH": str(REPO)},  # the package is importable from the repo
    }


def backends_toml(backends: list[dict[str, Any]], sections: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for section, values in sections.items():
        lines += [f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()] + [""]
    for backend in backends:
        lines.append("[[backends]]")
        for key, value in backend.items():
            if isinstance(value, dict):
                pairs = ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {pairs} }}")
            else:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


class Stack:
    """One `serve` process tree; everything it started is killed at the end, whatever happens."""

    def __init__(self, tmp: Path, backends: list[dict[str, Any]], *, workers: int,
                 redis_url: str | None, drain_s: float = 5.0,
                 policies: dict[str, str] | None = None,
                 gateway_extra: dict[str, Any] | None = None,
                 **sections: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder = tmp / "config"
        self.data = tmp / "data"
        (self.folder / "policies").mkdir(parents=True)
        for backend in backends:
            if "cwd" in backend:
                (self.folder / backend["cwd"]).mkdir(exist_ok=True)
        for name, text in {"tiers.toml": GENEROUS_TIERS, **(policies or {})}.items():
            (self.folder / "policies" / name).write_text(text)
        config: dict[str, dict[str, Any]] = {
            "gateway": {"port": self.port, "data_dir": str(self.data),
                        "drain_timeout_s": drain_s, **(gateway_extra or {})},
            "health": {"interval_s": 0.5, "timeout_s": 0.5},
            "supervisor": {"backoff_base_s": 0.2, "grace_s": 2.0, "startup_timeout_s": 20.0},
            **sections,
        }
        (self.folder / "backends.toml").write_text(backends_toml(backends, config))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GATEWAY_ADMIN_TOKEN": ADMIN[
            "Authorization"].split()[1]}
        env.pop("GATEWAY_REDIS_URL", None)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the master makes its own under data_dir
        if redis_url:
            env["GATEWAY_REDIS_URL"] = redis_url
        self.log = tmp / "gateway.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(self.folder),
                 "--workers", str(workers)], env=env, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO)
        self.seen: dict[int, psutil.Process] = {}

    def ready(self, timeout: float = 30) -> Stack:
        """Every worker ready: each has its own view and the kernel picks one per connection,
        so ask on fresh connections until enough say yes in a row."""
        wait_until_ready(f"{self.url}/readyz", self.proc, timeout)
        deadline = time.monotonic() + 10
        in_a_row = 0
        while in_a_row < 12:
            assert time.monotonic() < deadline, "not every worker became ready"
            ok = httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            in_a_row = in_a_row + 1 if ok else 0
            time.sleep(0.02 if ok else 0.1)
        self.tree()
        return self

    def tree(self) -> list[psutil.Process]:
        """The master's live descendants (remembered, to be sure they are gone at the end)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.update((p.pid, p) for p in children)
        return children

    def workers(self) -> list[int]:
        return [p.pid for p in self.tree() if "proxy.runtime.worker" in cmdline(p)]

    def errors(self, limit: int = 200) -> str:
        """The log's ERROR records with their tracebacks (at most `limit` lines): printed when a
        test ends, so a failure in CI shows what the gateway said."""
        lines: list[str] = []
        keep = False
        for line in self.log.read_text(errors="replace").splitlines():
            if " ERROR " in line or line.startswith("Traceback"):
                keep = True
            elif line[:4].isdigit():  # the next record
                keep = False
            if keep:
                lines.append(line)
        return "\n".join(lines[-limit:])

    def close(self) -> None:
        self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for proc in self.seen.values():
            if proc.is_running():
                proc.kill()


def cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def admin_backends(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with session.get(url + "/admin/backends", headers=ADMIN) as response:
        assert response.status == 200, await response.text()
        return {b["name"]: b for b in (await response.json())["data"]}


async def settled_view(url: str, name: str, check: Callable[[dict[str, Any]], bool]
                       ) -> dict[str, Any]:
    """Backend `name` as seen by whichever worker answers, once `check` holds (each worker
    follows the supervisor on its own, within a poll interval)."""
    deadline = time.monotonic() + 10
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        while True:
            view = (await admin_backends(session, url))[name]
            if check(view):
                return view
            assert time.monotonic() < deadline, view
            await asyncio.sleep(0.1)
