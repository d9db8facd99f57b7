"""Typed keys for the long-lived objects an application holds (set up in `app.cleanup_ctx`)."""

from __future__ import annotations

from aiohttp import web
from redis.asyncio import Redis

from proxy.config import Config
from proxy.upstream.client import Upstreams
from proxy.upstream.pool import Router

CONFIG = web.AppKey("config", Config)
ROUTER = web.AppKey("router", Router)
UPSTREAMS = web.AppKey("upstreams", Upstreams)
REDIS = web.AppKey("redis", Redis)
OPENAPI = web.AppKey("openapi", bytes)

# Per-request values (request[...]).
REQUEST_ID = web.RequestKey("request_id", str)  # set by the middleware
