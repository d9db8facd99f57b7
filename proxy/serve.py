"""`inference-gateway serve`, and the HTTP worker process it starts (`python -m proxy.serve`).

`serve` checks that the port is free, starts the embedded Redis when none is configured, and runs
the master (`proxy.master`), which starts the supervised backends and the workers. Redis stops
last, after the master has stopped the workers and the backends.

A worker runs the aiohttp application on the shared port (SO_REUSEPORT) until SIGTERM, then
drains (`Fleet.drain`: /readyz 503, new requests 503, open streams finish up to
`drain_timeout_s`) and exits. SIGHUP reloads policies/ in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

import msgspec
from aiohttp import web

from proxy.config import Config
from proxy.master import WORKER_ENV, WorkerSpec, run_master
from proxy.redis_process import RATE_LIMIT_URL_ENV, RedisProcess, rate_limit_redis_url

_SHUTDOWN_TIMEOUT_S = 2.0  # after the drain: closing idle keep-alive connections
# The whole cleanup after the drain (connections, then the app's cleanup_ctx); the master allows
# drain_timeout_s + 6 s in all.
_CLEANUP_S = 2.5


def serve(config: Config, *, host: str | None, port: int | None,
          workers: int | None = None) -> int:
    _setup_logging("master")
    host = host or config.gateway.host
    port = port or config.gateway.port
    count = workers or config.gateway.workers or os.cpu_count() or 1
    problem = _port_problem(host, port)
    if problem:
        print(f"cannot listen on {host}:{port}: {problem}", file=sys.stderr)
        return 1
    redis_url = os.environ.get("GATEWAY_REDIS_URL") or config.gateway.redis_url
    with contextlib.ExitStack() as stack:
        if redis_url:
            where = "external"
        else:
            embedded = RedisProcess(config.data_dir / "redis")
            redis_url = embedded.start()
            stack.callback(embedded.stop)  # after the master: workers and backends are gone
            where = f"embedded, {embedded.url}"
            if not rate_limit_redis_url(config, ""):
                # Rate-limit counters live a minute and need no fsync: a second server without
                # persistence keeps them off the ledger's fsync-on-every-write path.
                limits = RedisProcess(config.data_dir / "redis-limits", persistent=False)
                os.environ[RATE_LIMIT_URL_ENV] = limits.start()  # inherited by the workers
                stack.callback(limits.stop)
        models = ", ".join(app_models(config)) or "none"
        supervised = ", ".join(b.name for b in config.backends if b.command) or "none"
        print(f"inference gateway on http://{host}:{port} (redis: {where}; chat models: "
              f"{models}; workers: {count}; supervised backends: {supervised})", flush=True)
        return run_master(config, host=host, port=port, workers=count, redis_url=redis_url)


def app_models(config: Config) -> list[str]:
    return sorted({model for backend in config.backends for model in backend.models})


def _port_problem(host: str, port: int) -> str | None:
    """Why the workers could not bind host:port, found before anything starts (else None)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s %(message)s",
    )


# -- the worker process ------------------------------------------------------------------------


def worker_main() -> int:
    spec = msgspec.json.decode(os.environ.pop(WORKER_ENV), type=WorkerSpec)
    _setup_logging(f"worker-{spec.index}")
    _install_uvloop()
    asyncio.run(_run_worker(spec))
    return 0


async def _run_worker(spec: WorkerSpec) -> None:
    from proxy.app import build_app  # the master never needs the HTTP stack
    from proxy.fleet import FLEET

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before setup: a stop during it is kept
        loop.add_signal_handler(sig, stop.set)
    app = build_app(spec.config, redis_url=spec.redis_url)
    app.on_startup.append(_reload_on_sighup)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, spec.host, spec.port, reuse_port=True, backlog=1024)
        await site.start()
        await stop.wait()
        await app[FLEET].drain(spec.config.gateway.drain_timeout_s)
    finally:
        # A task, waited for without cancelling it: a library that swallows a cancellation
        # (redis-py can) must not keep the worker alive.
        cleanup = asyncio.create_task(runner.cleanup())
        done, _ = await asyncio.wait({cleanup}, timeout=_CLEANUP_S)
        if not done:
            logging.getLogger("proxy").error("cleanup did not finish in %.1f s; exiting anyway",
                                             _CLEANUP_S)
            logging.shutdown()
            os._exit(1)
        cleanup.result()


async def _reload_on_sighup(app: web.Application) -> None:
    """SIGHUP reloads policies/ in place: no restart, no dropped connection."""
    from proxy.appkeys import LIVE

    live = app[LIVE]
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, live.reload)


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # optional speed-up; asyncio's loop works the same
        return
    uvloop.install()


if __name__ == "__main__":
    sys.exit(worker_main())
