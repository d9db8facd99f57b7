"""The HTTP worker process `serve` starts (`python -m proxy.runtime.worker`).

A worker runs the aiohttp application on the shared port (SO_REUSEPORT), behind the connection
deadlines and cap of proxy.http.server, until SIGTERM, then
drains (`Drain.drain`: /readyz 503, new requests 503, open streams finish up to
`drain_timeout_s`) and exits. SIGHUP reloads policies/ in place.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys

import msgspec
from aiohttp import web

from proxy.runtime.master import WORKER_ENV, WorkerSpec, setup_logging

_SHUTDOWN_TIMEOUT_S = 2.0  # after the drain: closing idle keep-alive connections
# The whole cleanup after the drain (connections, then the app's cleanup_ctx); the master allows
# drain_timeout_s + 6 s in all.
_CLEANUP_S = 2.5


def worker_main() -> int:
    spec = msgspec.json.decode(os.environ.pop(WORKER_ENV), type=WorkerSpec)
    setup_logging(f"worker-{spec.index}")
    _install_uvloop()
    asyncio.run(_run_worker(spec))
    return 0


async def _run_worker(spec: WorkerSpec) -> None:
    from proxy.app import build_app  # the master never needs the HTTP stack
    from proxy.appkeys import DRAIN
    from proxy.http.server import GatewayRunner, raise_fd_limit
    from proxy.runtime.memory import trim_forever
    from proxy.store.background import stop_task

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before setup: a stop during it is kept
        loop.add_signal_handler(sig, stop.set)
    app = build_app(spec.config, redis_url=spec.redis_url)
    app.on_startup.append(_reload_on_sighup)
    raise_fd_limit()  # before the runner fits max_connections under the limit
    # [server] deadlines and connection cap, JSON answers to malformed requests.
    runner = GatewayRunner(app, spec.config, access_log=None, handler_cancellation=True,
                           shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    # What startup built lives as long as the process: keep it out of the collector's way,
    # and collect the young generation less often (requests make many short-lived objects).
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 50)
    trimmer = asyncio.create_task(trim_forever())  # RSS back to what is held after a burst
    try:
        site = web.TCPSite(runner, spec.host, spec.port, reuse_port=True, backlog=1024)
        await site.start()
        await stop.wait()
        await app[DRAIN].drain(spec.config.gateway.drain_timeout_s)
    finally:
        await stop_task(trimmer)
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
