"""Typed keys for the long-lived objects an application holds (set up in `app.cleanup_ctx`),
and for the values one request carries from step to step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.blobs.media import MediaStore
from proxy.config import Config
from proxy.credits.admission import Admitter
from proxy.credits.idempotency import Keeper
from proxy.credits.ledger import Ledger
from proxy.credits.meter import Metering
from proxy.credits.settler import Settler
from proxy.http.drain import Drain
from proxy.identity.keystore import KeyStore
from proxy.observe.access_log import AccessLog
from proxy.observe.fleet_tally import FleetTally
from proxy.observe.metrics import Metrics
from proxy.policy.live import LivePolicies
from proxy.policy.shadowing import Shadow
from proxy.store.client import Store
from proxy.styles.base import ChatStyle
from proxy.tasks.store import TaskStore
from proxy.upstream.client import Upstreams
from proxy.upstream.fetch import MediaFetcher
from proxy.upstream.kv_events import KvEvents
from proxy.upstream.router import Router

if TYPE_CHECKING:  # imported only when [telemetry] turns tracing on (the SDK is heavy)
    from proxy.observe.tracing import Tracing

CONFIG = web.AppKey("config", Config)
ROUTER = web.AppKey("router", Router)
UPSTREAMS = web.AppKey("upstreams", Upstreams)
KV_EVENTS = web.AppKey("kv_events", KvEvents)  # the engines' KV-cache events, read
REDIS: web.AppKey[Store] = web.AppKey("redis")
# The rate-limit counters' server, for /readyz (the same client as REDIS when they share one).
KEYSTORE = web.AppKey("keystore", KeyStore)
LIVE = web.AppKey("live", LivePolicies)
ADMITTER = web.AppKey("admitter", Admitter)
METERING = web.AppKey("metering", Metering)  # opens each request's meter (admit, settle)
LEDGER = web.AppKey("ledger", Ledger)
SETTLER = web.AppKey("settler", Settler)  # settlements queued, flushed in batches
KEEPER = web.AppKey("keeper", Keeper)  # idempotent results kept for retries
COUNTERS: web.AppKey[Store] = web.AppKey("counters")  # the rate-limit counters' Redis (guests)
OPENAPI: web.AppKey[Callable[[], bytes]] = web.AppKey("openapi")  # built at first use
# Each route's style, by handler: the middleware renders even its own refusals in it.
ROUTE_STYLES: web.AppKey[dict[Handler, ChatStyle]] = web.AppKey("route_styles")
DRAIN = web.AppKey("drain", Drain)
FETCHER = web.AppKey("fetcher", MediaFetcher)  # audio fetched for clients, SSRF rules
TASKS = web.AppKey("tasks", TaskStore)  # async tasks: records, queue
MEDIA = web.AppKey("media", MediaStore)  # their audio, images and video (never in the ledger)
METRICS = web.AppKey("metrics", Metrics)  # this process's Prometheus metrics
ACCESS_LOG = web.AppKey("access_log", AccessLog)
TALLY = web.AppKey("fleet_tally", FleetTally)  # what the console shows of the whole fleet
SHADOW = web.AppKey("shadow", Shadow)  # judges requests by the shadow policies, if any
TRACING: web.AppKey[Tracing | None] = web.AppKey("tracing")  # None: [telemetry] not set

REQUEST_ID = web.RequestKey("request_id", str)  # set by the middleware
STYLE = web.RequestKey("style", ChatStyle)  # the route's API style: errors are rendered in it
RESPONSE_HEADERS = web.RequestKey("response_headers", dict)  # e.g. rate-limit headers
