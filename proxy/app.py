"""Builds the aiohttp Application: long-lived objects in cleanup_ctx, routes, middleware."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import orjson
from aiohttp import web
from redis.asyncio import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from proxy.account_api import add_account_routes
from proxy.admin_api import add_admin_routes
from proxy.appkeys import (
    CONFIG,
    KEYSTORE,
    LEDGER,
    LIMITER,
    LIVE,
    OPENAPI,
    REDIS,
    ROUTER,
    SETTLEMENTS,
    UPSTREAMS,
)
from proxy.auth import GUEST_TIER
from proxy.config import Config
from proxy.errors import GatewayError
from proxy.fleet import FLEET, setup_fleet
from proxy.keystore import KeyStore
from proxy.ledger import Ledger
from proxy.live import LivePolicies
from proxy.middleware import gateway_middleware
from proxy.models_api import list_models
from proxy.native_discovery import add_ollama_discovery
from proxy.openapi import GATEWAY_OPERATIONS, build_openapi
from proxy.pipeline import chat_route
from proxy.ratelimit import RateLimiter
from proxy.redis_process import rate_limit_redis_url
from proxy.tasks import stop_task
from proxy.translate.anthropic import AnthropicStyle
from proxy.translate.ollama import OllamaStyle
from proxy.translate.openai import OpenAIStyle
from proxy.translate.served import ServedStyle
from proxy.upstream.client import Upstreams
from proxy.upstream.pool import Router

log = logging.getLogger("proxy")

API_VERSION = "2.0.0"  # the interface version (spec, Versioning); every path begins with /v2


def connect_redis(url: str) -> Redis:
    """A pooled client that retries a command once the connection drops (Redis restarted)."""
    return Redis.from_url(
        url, socket_timeout=2.0, socket_connect_timeout=2.0,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


def build_app(config: Config, *, redis_url: str) -> web.Application:
    # Each route reads its own body under its own cap (proxy.request_body); this is a backstop.
    app = web.Application(
        middlewares=[gateway_middleware],
        client_max_size=config.policies.requests.chat.max_body_bytes,
    )
    app[CONFIG] = config
    app[ROUTER] = Router(config.backends, config.health)
    app[OPENAPI] = orjson.dumps(
        build_openapi(GATEWAY_OPERATIONS, title="Inference Gateway", version=API_VERSION)
    )

    async def state_ctx(app: web.Application) -> AsyncIterator[None]:
        app[REDIS] = connect_redis(redis_url)
        app[KEYSTORE] = KeyStore(app[REDIS], config.policies.auth.keys)
        app[LIVE] = LivePolicies(config, app[KEYSTORE])
        app[LIMITER] = RateLimiter(rate_limit_redis_url(config, redis_url))
        app[LEDGER] = Ledger(app[REDIS])
        app[SETTLEMENTS] = set[asyncio.Task[None]]()
        # Revocations are pushed to every worker at once; the cache TTL is only a backstop.
        tasks = [asyncio.create_task(app[KEYSTORE].listen_for_revocations()),
                 asyncio.create_task(sweep_holds(app))]
        yield
        settling: set[asyncio.Task[None]] = app[SETTLEMENTS]
        if settling:  # let in-flight settlements finish before the store goes away
            await asyncio.wait(settling, timeout=10)
        for task in tasks:
            await stop_task(task)
        await app[REDIS].aclose()

    async def upstreams_ctx(app: web.Application) -> AsyncIterator[None]:
        app[UPSTREAMS] = Upstreams(config.upstream)
        yield
        await app[UPSTREAMS].close()

    app.cleanup_ctx.extend([state_ctx, upstreams_ctx])
    setup_fleet(app)  # health probes, passive ejection, /admin/backends
    add_chat_routes(app)
    add_account_routes(app)
    app.router.add_get("/v2/models", list_models)
    app.router.add_get("/v2/openapi.json", openapi_document)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    add_admin_routes(app, KEYSTORE, extra_check=admin_role_jwt,
                     tiers=lambda request: set(request.app[LIVE].current.policies.tiers.tiers)
                     - {GUEST_TIER})
    return app


async def sweep_holds(app: web.Application) -> None:
    """Release holds whose worker died before settling them (they carry an expiry)."""
    while True:
        interval = min(30.0, app[LIVE].current.policies.prices.hold_ttl_s / 2)
        await asyncio.sleep(interval)
        try:
            released = await app[LEDGER].sweep()
        except RedisError:
            continue  # the store is down; the holds wait for the next sweep
        if released:
            log.warning("released %d expired credit hold(s) left by a crashed worker", released)


def add_chat_routes(app: web.Application) -> None:
    """Every chat style, each through the same pipeline (auth, limits, credits, relay)."""
    app.router.add_post("/v2/compat/v1/chat/completions", chat_route(OpenAIStyle()))
    app.router.add_post("/v2/served/v1/chat/completions", chat_route(ServedStyle()))
    messages = chat_route(AnthropicStyle())
    app.router.add_post("/v2/messages/v1/messages", messages)
    native = chat_route(OllamaStyle())
    app.router.add_post("/v2/native/api/chat", native)
    app.router.add_post("/api/native/chat", native)  # the spec's unversioned alias
    add_ollama_discovery(app, "/v2/native")


async def admin_role_jwt(request: web.Request) -> bool:
    """Admin routes also accept a valid JWT whose role claim is `admin`."""
    try:
        principal = await request.app[LIVE].current.auth.principal(request.headers, None)
    except GatewayError:
        return False
    return principal.kind == "jwt" and principal.role == "admin"


async def openapi_document(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    """Alive: the process answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready: not draining, the state store answers, and a backend may take traffic."""
    checks: dict[str, bool] = {"accepting": not request.app[FLEET].draining}
    try:
        checks["redis"] = bool(await request.app[REDIS].ping())
    except Exception:  # any failure to reach the store means not ready; its text is not public
        checks["redis"] = False
    # Supervised and ready (if supervised), probes fine, not ejected: see Backend.healthy.
    checks["backends"] = any(b.healthy for b in request.app[ROUTER].backends)
    ready = all(checks.values())
    body = {"status": "ready" if ready else "not ready", "checks": checks}
    return web.json_response(body, status=200 if ready else 503)
