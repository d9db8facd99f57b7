"""`inference-gateway serve`: the embedded Redis when none is configured, then the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from aiohttp import web

from proxy.app import build_app
from proxy.appkeys import LIVE
from proxy.config import Config
from proxy.redis_process import RedisProcess

log = logging.getLogger("proxy")


def serve(config: Config, *, host: str | None, port: int | None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    host = host or config.gateway.host
    port = port or config.gateway.port
    redis_url = os.environ.get("GATEWAY_REDIS_URL") or config.gateway.redis_url
    with contextlib.ExitStack() as stack:
        if redis_url:
            where = "external"
        else:
            embedded = RedisProcess(config.data_dir / "redis")
            redis_url = embedded.start()
            stack.callback(embedded.stop)
            where = f"embedded, {embedded.url}"
        _install_uvloop()
        app = build_app(config, redis_url=redis_url)
        app.on_startup.append(_reload_on_sighup)
        models = ", ".join(app_models(config)) or "none"
        print(f"inference gateway on http://{host}:{port} (redis: {where}; chat models: {models})",
              flush=True)
        web.run_app(app, host=host, port=port, access_log=None, handler_cancellation=True,
                    print=None, reuse_port=True)
    return 0


async def _reload_on_sighup(app: web.Application) -> None:
    """SIGHUP reloads policies/ in place: no restart, no dropped connection."""
    live = app[LIVE]
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, live.reload)


def app_models(config: Config) -> list[str]:
    return sorted({model for backend in config.backends for model in backend.models})


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # optional speed-up; asyncio's loop works the same
        return
    uvloop.install()
