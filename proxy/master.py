"""The master process of `serve`: supervised backends, N HTTP workers, and the order of shutdown.

    serve ──> embedded redis-server (unless one is configured)          [proxy.serve]
          └─> master event loop
                ├─ Supervisor: starts the `command` backends, publishes their states in Redis
                └─ N workers: `python -m proxy.serve` with a WorkerSpec in $IGW_WORKER; each
                   binds the port with SO_REUSEPORT, so the kernel spreads connections

A worker that dies is replaced (after 0.1 s, doubling while it keeps dying young). Signals:
  SIGTERM / SIGINT  drain: every worker turns /readyz to 503, refuses new requests and lets open
                    streams finish up to `drain_timeout_s`; then the supervised backends stop
                    (SIGTERM, `grace_s`, SIGKILL); then Redis. A second signal kills the workers.
  SIGHUP            forwarded to the workers: each reloads policies/.
Workers and backends get PR_SET_PDEATHSIG (SIGTERM), so none outlives a master killed by SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

import msgspec

from proxy.config import Config
from proxy.upstream.fleet_state import RestartBackoff
from proxy.upstream.supervisor import Supervisor, terminate, tie_to_parent, wait_event

log = logging.getLogger("proxy.master")

WORKER_ENV = "IGW_WORKER"
_EXIT_SLACK_S = 6.0  # beyond the drain: cutting the last streams (2 s), cleanup (2.5 s), exit


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker needs, so it serves exactly the config the master checked."""

    config: Config
    host: str
    port: int
    redis_url: str
    index: int


class Master:
    def __init__(self, config: Config, *, host: str, port: int, workers: int,
                 redis_url: str) -> None:
        self.config = config
        self.host, self.port = host, port
        self.count = workers
        self.redis_url = redis_url
        self.workers: dict[int, asyncio.subprocess.Process] = {}
        self._stop = asyncio.Event()
        self._signals = 0

    async def run(self) -> int:
        from proxy.app import connect_redis  # the HTTP stack is the workers' business

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        redis = connect_redis(self.redis_url)
        supervisor = Supervisor(self.config, redis)
        try:
            await supervisor.start()
            slots = [asyncio.create_task(self._keep_worker(i)) for i in range(self.count)]
            await self._stop.wait()
            log.info("stopping: draining %d worker(s) for up to %.0f s", len(self.workers),
                     self.config.gateway.drain_timeout_s)
            await self._stop_workers(slots)
            log.info("workers stopped; stopping %d supervised backend(s)",
                     len(supervisor.backends))
        finally:
            await supervisor.stop()
            await redis.aclose()
        return 0

    def _on_stop_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            self._stop.set()
        else:  # asked twice: no more waiting for streams
            log.warning("second stop signal: killing the workers")
            self._forward(signal.SIGKILL)

    def _forward(self, sig: int) -> None:
        for proc in list(self.workers.values()):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    async def _keep_worker(self, index: int) -> None:
        """Run worker `index`, and replace it whenever it dies, until the master stops."""
        backoff = RestartBackoff(0.1, 10.0, stable_s=10.0)
        while not self._stop.is_set():
            try:
                proc = await self._spawn(index)
            except OSError as exc:
                log.error("cannot start worker %d: %s", index, exc.strerror)
                code: int | None = None
            else:
                self.workers[index] = proc
                backoff.ready(time.monotonic())  # a worker that lived 10 s counts as stable
                code = await proc.wait()
                del self.workers[index]
            if self._stop.is_set():
                return
            delay = backoff.exited(time.monotonic())
            log.warning("worker %d exited (code %s); starting a replacement in %.1f s",
                        index, code, delay)
            await wait_event(self._stop, delay)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        spec = WorkerSpec(config=self.config, host=self.host, port=self.port,
                          redis_url=self.redis_url, index=index)
        env = {**os.environ, WORKER_ENV: msgspec.json.encode(spec).decode()}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.serve", env=env, stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=tie_to_parent(signal.SIGTERM), start_new_session=True,
        )
        log.info("worker %d started (pid %d)", index, proc.pid)
        return proc

    async def _stop_workers(self, slots: list[asyncio.Task[None]]) -> None:
        self._forward(signal.SIGTERM)
        deadline = self.config.gateway.drain_timeout_s + _EXIT_SLACK_S
        _, late = await asyncio.wait(slots, timeout=deadline)
        if late:
            log.warning("%d worker(s) still running after %.0f s; killing them",
                        len(self.workers), deadline)
            await asyncio.gather(*(terminate(p, 0) for p in list(self.workers.values())))
            await asyncio.wait(late)


def run_master(config: Config, *, host: str, port: int, workers: int, redis_url: str) -> int:
    # The master's loop is the stock asyncio one: uvloop buys nothing here, and the stock loop
    # runs `preexec_fn` (PR_SET_PDEATHSIG) for its subprocesses.
    master = Master(config, host=host, port=port, workers=workers, redis_url=redis_url)
    return asyncio.run(master.run())
