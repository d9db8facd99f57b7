"""The master process of `serve`: supervised backends, N HTTP workers, and the order of shutdown.

    serve ──> master event loop
                ├─ SupervisedRedis: the embedded redis-servers (unless Redis is configured),
                │  restarted when they die (proxy.runtime.embedded_redis)
                ├─ Supervisor: starts the `command` backends, publishes their states in Redis
                └─ N workers: `python -m proxy.runtime.worker`, a WorkerSpec in $IGW_WORKER;
                   each binds the port with SO_REUSEPORT, so the kernel spreads connections

A worker that dies is replaced (after 0.1 s, doubling while it keeps dying young). Signals:
  SIGTERM / SIGINT  drain: every worker turns /readyz to 503, refuses new requests and lets open
                    streams finish up to `drain_timeout_s`; then the supervised backends stop
                    (SIGTERM, `grace_s`, SIGKILL); then the embedded Redis. A second signal
                    kills the workers.
  SIGHUP            forwarded to the workers: each reloads policies/.
Workers, backends and the embedded Redis get PR_SET_PDEATHSIG (SIGTERM), so none outlives a
master killed by SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from proxy.blobs import describe_media, media_problem
from proxy.config import Config
from proxy.runtime.embedded_redis import RedisStartError, SupervisedRedis
from proxy.runtime.signal_scraper import SignalScraper
from proxy.runtime.supervisor import Supervisor, terminate, tie_to_parent, wait_event
from proxy.store.background import stop_task
from proxy.store.client import (
    RATE_LIMIT_URL_ENV,
    connect_redis,
    follow_primary,
    rate_limit_redis_url,
    store_kind,
    url_problem,
)
from proxy.store.redis_process import RedisProcess
from proxy.upstream.fleet_state import RestartBackoff, signals_key

log = logging.getLogger("proxy.runtime.master")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it at import
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
                 redis_url: str, embedded: Sequence[SupervisedRedis] = ()) -> None:
        self.config = config
        self.host, self.port = host, port
        self.count = workers
        self.redis_url = redis_url
        self.embedded = list(embedded)
        self.workers: dict[int, asyncio.subprocess.Process] = {}
        self._stop = asyncio.Event()
        self._signals = 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        started: list[SupervisedRedis] = []
        try:
            for server in self.embedded:
                await server.start()
                started.append(server)
            return await self._serve()
        except RedisStartError as exc:
            log.error("%s", exc)
            return 1
        finally:
            # Last: settlements of the draining workers and the backends' states still land.
            await asyncio.gather(*(server.stop() for server in started))

    async def _serve(self) -> int:
        redis = connect_redis(self.redis_url)
        supervisor = Supervisor(self.config, redis)
        follower = asyncio.create_task(follow_primary(redis))
        scraper = asyncio.create_task(SignalScraper(
            self.config.backends, redis, signals_key(self.config.root),
            self.config.health.engine_signals_s).run())
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
            # Cancelled again until it ends: a cancellation that lands in aiohttp's or
            # redis-py's timeout handling can be swallowed (`serve` then hung on SIGTERM).
            await stop_task(scraper)
            await supervisor.stop()
            await stop_task(follower)
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
                _forget_live_metrics(proc.pid)
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
            sys.executable, "-m", "proxy.runtime.worker", env=env, stdin=asyncio.subprocess.DEVNULL,
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


def run_master(config: Config, *, host: str, port: int, workers: int, redis_url: str,
               embedded: Sequence[SupervisedRedis] = ()) -> int:
    # The master's loop is the stock asyncio one: uvloop buys nothing here, and the stock loop
    # runs `preexec_fn` (PR_SET_PDEATHSIG) for its subprocesses.
    master = Master(config, host=host, port=port, workers=workers, redis_url=redis_url,
                    embedded=embedded)
    return asyncio.run(master.run())


def serve(config: Config, *, host: str | None, port: int | None,
          workers: int | None = None) -> int:
    setup_logging("master")
    host = host or config.gateway.host
    port = port or config.gateway.port
    count = workers or config.gateway.workers or os.cpu_count() or 1
    problem = _port_problem(host, port)
    if problem:
        print(f"cannot listen on {host}:{port}: {problem}", file=sys.stderr)
        return 1
    redis_url = os.environ.get("GATEWAY_REDIS_URL") or config.gateway.redis_url
    for name, url in (("redis", redis_url), ("rate-limit redis", rate_limit_redis_url(config, ""))):
        problem = url_problem(url) if url else None
        if problem:
            print(f"cannot use the {name} URL: {problem}", file=sys.stderr)
            return 1
    embedded: list[SupervisedRedis] = []
    if redis_url:
        where = f"external {store_kind(redis_url)}"
    else:  # started, watched and stopped (last) by the master
        ledger = RedisProcess(config.data_dir / "redis", fsync=config.gateway.ledger_fsync)
        embedded.append(SupervisedRedis("ledger", ledger))
        redis_url = ledger.url
        where = f"embedded, {ledger.url}"
        if not rate_limit_redis_url(config, ""):
            # Rate-limit counters live a minute and need no fsync: a second server without
            # persistence keeps them off the ledger's fsync-on-every-write path.
            limits = RedisProcess(config.data_dir / "redis-limits", persistent=False)
            embedded.append(SupervisedRedis("rate-limit", limits))
            os.environ[RATE_LIMIT_URL_ENV] = limits.url  # inherited by the workers
    problem = asyncio.run(media_problem(config.media, str(config.data_dir)))
    if problem:
        print(f"cannot use the media store ([media] in backends.toml): {problem}",
              file=sys.stderr)
        return 1
    _metrics_dir(config)
    models = ", ".join(app_models(config)) or "none"
    supervised = ", ".join(b.name for b in config.backends if b.command) or "none"
    print(f"inference gateway on http://{host}:{port} (redis: {where}; media: "
          f"{describe_media(config.media, str(config.data_dir))}; models: {models}; workers: "
          f"{count}; supervised backends: {supervised})", flush=True)
    return run_master(config, host=host, port=port, workers=count, redis_url=redis_url,
                      embedded=embedded)


def _metrics_dir(config: Config) -> None:
    """A fresh folder for the workers' metric files (prometheus-client's multiprocess mode:
    /metrics sums them), and their exemplars (proxy.observe.exemplars). Emptied at each
    start: counters restart from zero with the gateway, as Prometheus expects of a restarted
    target. Inherited by the workers."""
    folder = Path(os.environ.get(MULTIPROC_ENV) or config.data_dir / "metrics")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.db"), *folder.glob("exemplars_*.json")]:
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(folder.resolve())


def _forget_live_metrics(pid: int) -> None:
    """A dead worker's in-flight gauge must not count any more."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def app_models(config: Config) -> list[str]:
    return sorted({model for backend in config.backends for model in backend.models})


def _port_problem(host: str, port: int) -> str | None:
    """Why the workers should not bind host:port, found before anything starts (else None).

    Without SO_REUSEPORT: the workers share the port with each other, never with another
    process. A second gateway on the same address would otherwise take half the connections,
    silently (its own Redis, its own keys and limits)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT only
            sock.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return ("another process is already listening there (a gateway already running? "
                    "stop it, or choose another --port)")
        return exc.strerror or type(exc).__name__
    return None


def setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s %(message)s",
    )
