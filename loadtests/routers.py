"""Two Rust serving routers from PyPI as child processes, for the routing benchmark (issue 31).

    pip install -e '.[routers]'     # vllm-router and sglang-router, at the versions measured

Each is started as a plain HTTP router in front of a list of OpenAI-compatible workers (the vLLM
simulators), with its cache-aware policy, by the Python module its package ships, under this
interpreter (no PATH needed):

    python -m vllm_router.launch_router --worker-urls URL... --policy cache_aware ...
    python -m sglang_router.launch_router --worker-urls URL... --policy cache_aware ...

Both keep an approximate radix tree of the request *text* per worker (no tokenizer: "HTTP
worker pools do not tokenize in the router"), send a request to the worker with the longest
match when it covers at least `--cache-threshold` (0.3) of the text, else to the worker with
the smallest tree, and switch to the least loaded worker (requests in flight through the
router) while the pool is imbalanced (max - min > `--balance-abs-threshold` 64 and max >
1.5 x min). The policies' own defaults are kept. What they need from a worker: `GET /health`
(both; vllm-router waits for it before it listens), and sglang-router also asks for
`/server_info`, `/get_server_info`, `/model_info`, `/get_model_info` when it registers one
(a 404 only means "unknown model"). Neither calls `/tokenize` in this mode.

Each also opens a Prometheus listener (default port 29000, on 0.0.0.0 for sglang-router):
it is given a free port on 127.0.0.1 so that two can run at once. Readiness: `GET /readiness`
says `{"status": "ready", "healthy_workers": N, "total_workers": N}` once every worker is
registered and healthy (sglang-router registers workers after it starts listening).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests.servers import Server, ServerFailed, free_port

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Router:
    name: str  # the config's name in the benchmark, and the PyPI distribution
    module: str  # the package's launcher module, run with `python -m`
    log_level: str  # warnings and errors only (the level names differ)

    def version(self) -> str | None:
        """The installed distribution's version, or None when it cannot be run here."""
        if importlib.util.find_spec(self.module.split(".")[0]) is None:
            return None
        try:
            return importlib.metadata.version(self.name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def args(self, port: int, prometheus_port: int, workers: Sequence[str]) -> list[str]:
        return [
            sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *workers, "--policy", "cache_aware",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--log-level", self.log_level,
        ]


ROUTERS: dict[str, Router] = {
    "vllm-router": Router("vllm-router", "vllm_router.launch_router", "warning"),
    "sglang-router": Router("sglang-router", "sglang_router.launch_router", "warn"),
}


def installed() -> dict[str, str | None]:
    """Each router's installed version, None for one that is not installed."""
    return {name: router.version() for name, router in ROUTERS.items()}


def start(name: str, workers: Sequence[str], log_path: Path, *,
          timeout: float = 30.0) -> tuple[Server, str]:
    """Start router `name` in front of `workers`; return it and its base URL once every
    worker is registered and healthy. The caller stops the server (Server.stop)."""
    router = ROUTERS[name]
    port = free_port()
    server = Server(name, router.args(port, free_port(), workers), log_path, None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_workers(url, len(workers), server, timeout)
    except BaseException:
        server.stop()
        raise
    return server, url


def wait_workers(url: str, count: int, server: Server, timeout: float) -> None:
    """Poll `/readiness` until the router says `count` workers are healthy."""
    deadline = time.monotonic() + timeout
    while True:
        if server.popen.poll() is not None:
            raise server.failed(f"exited with code {server.popen.returncode}")
        with contextlib.suppress(OSError, ValueError), \
                urllib.request.urlopen(url + "/readiness", timeout=2) as resp:
            doc = json.loads(resp.read())
            if resp.status == 200 and doc.get("healthy_workers") == count:
                return
        if time.monotonic() > deadline:
            raise server.failed(f"had not {count} healthy workers at {url}/readiness "
                                f"after {timeout:.0f} s")
        time.sleep(0.1)


__all__ = ["CHAT_PATH", "ROUTERS", "Router", "ServerFailed", "installed", "start"]
