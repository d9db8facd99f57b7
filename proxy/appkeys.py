"""Typed keys for the long-lived objects an application holds (set up in `app.cleanup_ctx`),
and for the values one request carries from step to step."""

from __future__ import annotations

import asyncio

from aiohttp import web
from redis.asyncio import Redis

from proxy.config import Config
from proxy.credits.ledger import Ledger
from proxy.identity.keystore import KeyStore
from proxy.policy.admission import RateLimiter
from proxy.reload import LivePolicies
from proxy.runtime.drain import Drain
from proxy.styles.base import ChatStyle
from proxy.upstream.client import Upstreams
from proxy.upstream.pool import Router

CONFIG = web.AppKey("config", Config)
ROUTER = web.AppKey("router", Router)
UPSTREAMS = web.AppKey("upstreams", Upstreams)
REDIS = web.AppKey("redis", Redis)
# The rate-limit counters' server, for /readyz (the same client as REDIS when they share one).
RATE_LIMIT_REDIS = web.AppKey("rate_limit_redis", Redis)
KEYSTORE = web.AppKey("keystore", KeyStore)
LIVE = web.AppKey("live", LivePolicies)
LIMITER = web.AppKey("limiter", RateLimiter)
LEDGER = web.AppKey("ledger", Ledger)
# Settlements in flight, drained on shutdown.
SETTLEMENTS: web.AppKey[set[asyncio.Task[None]]] = web.AppKey("settlements")
OPENAPI = web.AppKey("openapi", bytes)
DRAIN = web.AppKey("drain", Drain)

REQUEST_ID = web.RequestKey("request_id", str)  # set by the middleware
STYLE = web.RequestKey("style", ChatStyle)  # the route's API style: errors are rendered in it
RESPONSE_HEADERS = web.RequestKey("response_headers", dict)  # e.g. rate-limit headers
