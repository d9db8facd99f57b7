"""Builds the aiohttp Application: long-lived objects in cleanup_ctx, the route table, middleware.

    cleanup_ctx, in order:  state (Redis, key store, policies, limiter, ledger, background loops)
                            -> upstreams (the pooled client, drain) -> health (probes, fleet sync)
    routes:                 ROUTES below, the only place a route is registered; the OpenAPI
                            document is rendered from the same table
    middleware:             proxy.api.middleware (request id, drain gate, error rendering)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import orjson
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from proxy.api import (
    account,
    admin,
    console,
    dashboard,
    models,
    ollama_discovery,
    openapi,
    probes,
    shadow_view,
    tasks,
)
from proxy.api import route_docs as docs
from proxy.api.middleware import gateway_middleware
from proxy.api.scrape import metrics
from proxy.appkeys import (
    ACCESS_LOG,
    ADMITTER,
    CONFIG,
    COUNTERS,
    DRAIN,
    FETCHER,
    KEEPER,
    KEYSTORE,
    KV_EVENTS,
    LEDGER,
    LIVE,
    MEDIA,
    METERING,
    METRICS,
    OPENAPI,
    REDIS,
    ROUTE_STYLES,
    ROUTER,
    SETTLER,
    SHADOW,
    TALLY,
    TASKS,
    TRACING,
    UPSTREAMS,
)
from proxy.blobs import open_blobs
from proxy.blobs.media import MediaStore
from proxy.config import Config
from proxy.credits.admission import Admitter
from proxy.credits.idempotency import Keeper
from proxy.credits.ledger import Ledger
from proxy.credits.meter import Metering
from proxy.credits.settler import Settler
from proxy.credits.shadow_windows import ShadowWindows
from proxy.credits.webhooks import Sender
from proxy.families.embeddings import EMBEDDINGS
from proxy.families.providers import IMAGE, VIDEO
from proxy.families.speech import OPENAI_SPEECH, TTS
from proxy.families.transcription import ASR, OPENAI_TRANSCRIPTIONS, OPENAI_TRANSLATIONS
from proxy.http.body import BODY_TIMEOUT_S
from proxy.http.drain import Drain
from proxy.identity.keystore import KeyStore
from proxy.observe.access_log import AccessLog
from proxy.observe.fleet_tally import FleetTally
from proxy.observe.metrics import Labels, Metrics, flush_metrics
from proxy.pipeline import chat_route, queued, task_route
from proxy.policy.live import RELOADS, LivePolicies
from proxy.policy.shadowing import Shadow
from proxy.store.background import stop_task
from proxy.store.client import Store, connect_redis, follow_primary, rate_limit_redis_url
from proxy.store.lease import Lease
from proxy.styles.anthropic import AnthropicStyle
from proxy.styles.base import ChatStyle
from proxy.styles.ollama import OllamaStyle
from proxy.styles.openai import OpenAIStyle
from proxy.styles.responses import ResponsesStyle
from proxy.styles.served import ServedStyle
from proxy.tasks.run import Runnable
from proxy.tasks.runner import TaskRunner
from proxy.tasks.store import TaskStore
from proxy.upstream.client import Upstreams
from proxy.upstream.dispatch import Dispatcher
from proxy.upstream.fetch import MediaFetcher, rules_from
from proxy.upstream.fleet_state import fleet_key, signals_key
from proxy.upstream.kv_events import KvEvents
from proxy.upstream.prefix_share import PrefixShare
from proxy.upstream.prober import FleetSync, Prober, probe_session
from proxy.upstream.router import Router
from proxy.upstream.slots import SlotLedger

log = logging.getLogger("proxy")

API_VERSION = "2.0.0"  # the interface version (spec, Versioning); every path begins with /v2


class Route(NamedTuple):
    method: str
    path: str
    handler: Handler
    doc: openapi.Doc
    style: ChatStyle | None = None  # whose shape its errors take (None: the gateway's own)


_NATIVE = "/v2/native"  # where Ollama clients point `host`
_OPENAI, _SERVED = OpenAIStyle(), ServedStyle()
_ANTHROPIC, _OLLAMA = AnthropicStyle(), OllamaStyle()
_RESPONSES = ResponsesStyle()
_native_chat = chat_route(_OLLAMA)

ROUTES: tuple[Route, ...] = (
    # The request path (proxy.pipeline): every chat style on the same pipeline.
    Route("POST", "/v2/compat/v1/chat/completions", chat_route(_OPENAI), docs.COMPAT_CHAT,
          _OPENAI),
    Route("POST", "/v2/served/v1/chat/completions", chat_route(_SERVED), docs.SERVED_CHAT,
          _SERVED),
    Route("POST", "/v2/compat/v1/responses", chat_route(_RESPONSES), docs.RESPONSES_CHAT,
          _RESPONSES),
    Route("POST", "/v2/messages/v1/messages", chat_route(_ANTHROPIC), docs.MESSAGES_CHAT,
          _ANTHROPIC),
    Route("POST", f"{_NATIVE}/api/chat", _native_chat, docs.NATIVE_CHAT, _OLLAMA),
    Route("POST", "/api/native/chat", _native_chat, docs.NATIVE_CHAT, _OLLAMA),  # spec's alias
    # The other task families, on the same path (proxy.pipeline.task).
    Route("POST", "/v2/audio/tts/engine", task_route(TTS), docs.TTS),
    Route("POST", "/v2/audio/asr/engine", task_route(ASR), docs.ASR),
    Route("POST", "/v2/image/{provider}/generate", task_route(IMAGE), docs.IMAGE),
    Route("POST", "/v2/video/{provider}/t2v", task_route(VIDEO), docs.VIDEO),
    # The same, in OpenAI's spelling (for the `openai` client's audio calls).
    Route("POST", "/v2/compat/v1/audio/speech", task_route(OPENAI_SPEECH), docs.OPENAI_SPEECH),
    Route("POST", "/v2/compat/v1/audio/transcriptions", task_route(OPENAI_TRANSCRIPTIONS),
          docs.OPENAI_TRANSCRIPTIONS),
    Route("POST", "/v2/compat/v1/audio/translations", task_route(OPENAI_TRANSLATIONS),
          docs.OPENAI_TRANSLATIONS),
    Route("POST", "/v2/compat/v1/embeddings", task_route(EMBEDDINGS), docs.EMBEDDINGS),
    # Beside it.
    Route("GET", "/v2/models", models.list_models, docs.MODELS),
    # The same list where the OpenAI client's models.list() looks (base_url .../v2/compat/v1).
    Route("GET", "/v2/compat/v1/models", models.list_models, docs.COMPAT_MODELS),
    Route("GET", "/v2/audio/tts/presets", models.tts_presets, docs.TTS_PRESETS),
    Route("GET", "/v2/tasks/{task_id}", tasks.poll, docs.TASK),
    Route("GET", "/v2/audio/media/{media_key}", tasks.media, docs.MEDIA),
    Route("GET", "/v2/account", account.account, docs.ACCOUNT),
    Route("GET", "/v2/account/usage", account.usage, docs.ACCOUNT_USAGE),
    # The account holder's usage page (and its two files): it reads the two routes above.
    Route("GET", "/dashboard", dashboard.page, dashboard.PAGE_DOC),
    Route("GET", "/dashboard/app.js", dashboard.script, dashboard.SCRIPT_DOC),
    Route("GET", "/dashboard/style.css", dashboard.style, dashboard.STYLE_DOC),
    Route("GET", f"{_NATIVE}/api/tags", ollama_discovery.tags, docs.OLLAMA_TAGS,
          _OLLAMA),
    Route("POST", f"{_NATIVE}/api/show", ollama_discovery.show, docs.OLLAMA_SHOW,
          _OLLAMA),
    Route("GET", f"{_NATIVE}/api/version", ollama_discovery.version, docs.OLLAMA_VERSION,
          _OLLAMA),
    Route("GET", f"{_NATIVE}/api/ps", ollama_discovery.ps, docs.OLLAMA_PS,
          _OLLAMA),
    Route("GET", f"{_NATIVE}/", ollama_discovery.root, docs.OLLAMA_ROOT, _OLLAMA),
    Route("GET", _NATIVE, ollama_discovery.root, docs.OLLAMA_ROOT, _OLLAMA),
    Route("GET", "/v2/openapi.json", openapi.document, docs.OPENAPI),
    Route("GET", "/healthz", probes.healthz, docs.HEALTHZ),
    Route("GET", "/metrics", metrics, docs.METRICS),
    Route("GET", "/readyz", probes.readyz, docs.READYZ),
    # Operators.
    Route("POST", "/admin/keys", admin.create_key, docs.ADMIN_CREATE_KEY),
    Route("GET", "/admin/keys", admin.list_keys, docs.ADMIN_LIST_KEYS),
    Route("DELETE", "/admin/keys/{key_id}", admin.revoke_key, docs.ADMIN_REVOKE_KEY),
    Route("GET", "/admin/accounts/{account}", admin.show_account, docs.ADMIN_ACCOUNT),
    Route("POST", "/admin/accounts/{account}/credits", admin.add_credits, docs.ADMIN_CREDITS),
    Route("POST", "/admin/accounts/{account}/budgets", admin.set_budget, docs.ADMIN_BUDGETS),
    Route("POST", "/admin/accounts/{account}/alerts", admin.set_alert, docs.ADMIN_ALERT),
    Route("GET", "/admin/accounts/{account}/alerts", admin.list_alerts, docs.ADMIN_ALERTS),
    Route("POST", "/admin/webhooks", admin.add_webhook, docs.ADMIN_ADD_WEBHOOK),
    Route("GET", "/admin/webhooks", admin.list_webhooks, docs.ADMIN_LIST_WEBHOOKS),
    Route("DELETE", "/admin/webhooks/{endpoint_id}", admin.remove_webhook,
          docs.ADMIN_REMOVE_WEBHOOK),
    Route("POST", "/admin/reload", admin.reload_policies, docs.ADMIN_RELOAD),
    Route("GET", "/admin/backends", admin.list_backends, docs.ADMIN_BACKENDS),
    Route("GET", "/admin/shadow", shadow_view.show_shadow, docs.ADMIN_SHADOW),
    Route("GET", "/admin/overview", console.overview, docs.ADMIN_OVERVIEW),
    # The operators' console (and its files): it reads the admin routes above.
    Route("GET", "/admin/console", console.page, console.PAGE_DOC),
    Route("GET", "/admin/console/app.js", console.script, console.SCRIPT_DOC),
    Route("GET", "/admin/console/style.css", console.style, console.STYLE_DOC),
    Route("GET", "/admin/console/icon.svg", console.icon, console.ICON_DOC),
)

def openapi_document() -> dict[str, Any]:
    """The route table's OpenAPI document."""
    return openapi.build_openapi(
        ((r.method, r.path, r.doc, r.style.error_family if r.style else "gateway")
         for r in ROUTES), title="Inference Gateway", version=API_VERSION)


# The document as served before this deployment's facts are filled in; built at the first
# request for it, so a worker keeps ~0.2 MB of bytes rather than ~0.8 MB of dicts.
openapi_base: Callable[[], bytes] = functools.cache(lambda: orjson.dumps(openapi_document()))


def build_app(config: Config, *, redis_url: str, resolver: AbstractResolver | None = None
              ) -> web.Application:
    """`resolver`: the DNS resolver behind the audio fetcher's address checks (default: the
    system's; tests pass a stub to play DNS rebinding)."""
    # Each route reads its own body under its own cap (proxy.http.body); this is a backstop.
    caps = config.policies.requests
    app = web.Application(
        middlewares=[gateway_middleware],
        client_max_size=max(caps.chat.max_body_bytes, caps.tts.max_body_bytes,
                            caps.asr.max_body_bytes, caps.generation.max_body_bytes,
                            caps.fetch.max_bytes),
    )
    app[CONFIG] = config
    app[BODY_TIMEOUT_S] = config.server.body_timeout_s
    app[ROUTER] = Router(config.backends, config.health, config.routing)
    app[OPENAPI] = openapi_base
    app[METRICS] = Metrics(Labels(
        (model for backend in config.backends for model in backend.models),
        lambda: app[LIVE].current.policies.tiers.tiers,
        (backend.name for backend in config.backends)), CollectorRegistry())
    app.cleanup_ctx.extend([_observe_ctx, _state_ctx(redis_url), _upstreams_ctx(resolver),
                            _health_ctx, _tasks_ctx])
    app[ROUTE_STYLES] = {r.handler: r.style for r in ROUTES if r.style is not None}
    for route in ROUTES:
        # Any account segment reaches its handler, which answers a bad one 422 as documented
        # (aiohttp's default variable refuses braces: a 404 "no such route" otherwise).
        path = route.path.replace("{account}", "{account:[^/]+}")
        if route.method == "GET":
            app.router.add_get(path, route.handler)  # also answers HEAD
        else:
            app.router.add_route(route.method, path, route.handler)
    return app


async def _observe_ctx(app: web.Application) -> AsyncIterator[None]:
    """The access log's writer, the metrics' flusher and the trace exporter: first up, last
    down, so requests answered while the rest shuts down are still logged, counted and traced."""
    config = app[CONFIG]
    app[ACCESS_LOG] = AccessLog(config.gateway.access_log, config.root, app[METRICS])
    app[ACCESS_LOG].start()
    app[TRACING] = None
    if config.telemetry is not None:
        from proxy.observe.tracing import Tracing  # the SDK only when tracing is on

        app[TRACING] = Tracing(config.telemetry, app[METRICS])
    flusher = asyncio.create_task(flush_metrics(app[METRICS]))
    try:
        yield
    finally:
        await stop_task(flusher)
        app[METRICS].flush()
        app[ACCESS_LOG].stop()
        tracing = app[TRACING]
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)  # what is queued is sent


def _state_ctx(redis_url: str) -> Callable[[web.Application], AsyncIterator[None]]:
    async def state_ctx(app: web.Application) -> AsyncIterator[None]:
        config = app[CONFIG]
        app[REDIS] = connect_redis(redis_url)
        counters_url = rate_limit_redis_url(config, redis_url)
        app[COUNTERS] = connect_redis(counters_url, timeout_s=1.0) \
            if counters_url != redis_url else app[REDIS]
        app[TALLY] = FleetTally(app[REDIS], app[METRICS])  # the console's figures, fleet-wide
        app[KEYSTORE] = KeyStore(app[REDIS], config.policies.auth.keys)
        with contextlib.suppress(RedisError):  # else read at the first sealed key's lookup
            await app[KEYSTORE].read_seal()
        app[TASKS] = TaskStore(app[REDIS])
        app[MEDIA] = MediaStore(open_blobs(config.media, str(config.data_dir)), app[REDIS])
        app[LIVE] = LivePolicies(config, app[KEYSTORE])
        acks = config.gateway.ledger_ack_replicas
        app[LEDGER] = Ledger(app[REDIS], ack_replicas=acks)
        app[ADMITTER] = Admitter(app[LEDGER], app[COUNTERS])
        app[SETTLER] = Settler(app[LEDGER].primaries, [app[LEDGER].settle_script],
                               app[METRICS], ack_replicas=acks)
        app[KEEPER] = Keeper(app[SETTLER], app[MEDIA])
        app[METERING] = Metering(app[ADMITTER], app[SETTLER], app[LEDGER].settle_script,
                                 app[METRICS])
        app[SHADOW] = Shadow(ShadowWindows(app[LEDGER], app[COUNTERS]), app[REDIS],
                             app[METRICS], app[ACCESS_LOG])
        # Revocations are pushed to every worker at once; the cache TTL is only a backstop.
        # Policy reloads asked of any worker reach every worker over the same connection.
        notices = {RELOADS: app[LIVE].on_notice}
        tasks = [asyncio.create_task(app[KEYSTORE].listen_for_revocations(notices)),
                 asyncio.create_task(sweep_holds(app)),
                 asyncio.create_task(app[SETTLER].run()),
                 asyncio.create_task(sweep_media(app[MEDIA], app[REDIS])),
                 asyncio.create_task(app[SHADOW].run()),
                 asyncio.create_task(app[TALLY].run()),
                 *(asyncio.create_task(follow_primary(store))  # Sentinels: the primary moved?
                   for store in {app[REDIS], app[COUNTERS]})]
        alerts = Sender(app[REDIS], config.alerts)  # delivers alerts where it holds the lease
        tasks.append(asyncio.create_task(alerts.run()))
        yield
        for task in tasks:
            await stop_task(task)
        await alerts.close()
        await app[SHADOW].close()
        await app[ADMITTER].close()
        await app[KEEPER].close(timeout_s=5)
        await app[SETTLER].drain(timeout_s=5)  # what is queued lands before the store goes
        await app[LEDGER].close()
        await app[MEDIA].close()
        await app[TALLY].flush()  # what the last second noted
        await app[REDIS].aclose()
        if app[COUNTERS] is not app[REDIS]:
            await app[COUNTERS].aclose()

    return state_ctx


def _upstreams_ctx(resolver: AbstractResolver | None
                   ) -> Callable[[web.Application], AsyncIterator[None]]:
    async def upstreams_ctx(app: web.Application) -> AsyncIterator[None]:
        config = app[CONFIG]
        ledger = SlotLedger(app[COUNTERS]) if config.routing.dispatch else None
        app[UPSTREAMS] = Upstreams(config.upstream, app[METRICS],
                                   Dispatcher(ledger, app[METRICS]))
        heartbeat = asyncio.create_task(app[UPSTREAMS].dispatcher.run())
        # Each worker's prefix placements, shared with the others (upstream.prefix_share).
        share = PrefixShare(app[COUNTERS], app[ROUTER].by_key)
        for pool in app[ROUTER].prefix_pools:
            pool.on_placed = share.placed
        following = asyncio.create_task(share.run()) if app[ROUTER].prefix_pools else None
        # What the engines that publish it say their KV caches hold (upstream.kv_events).
        app[KV_EVENTS] = KvEvents(list({b.name: b for pool in app[ROUTER].prefix_pools
                                         for b in pool.backends}.values()))
        app[KV_EVENTS].start()
        app[DRAIN] = Drain(app[UPSTREAMS].abort_open)
        # Each fetch follows the live policy (MediaFetcher.follow); this is the first.
        app[FETCHER] = MediaFetcher(rules_from(app[CONFIG].policies.requests.fetch),
                                    resolver=resolver)
        yield
        await app[FETCHER].close()
        await stop_task(heartbeat)
        if following is not None:
            await stop_task(following)
        await share.close()
        await app[KV_EVENTS].close()
        await app[UPSTREAMS].dispatcher.close()
        await app[UPSTREAMS].close()

    return upstreams_ctx


async def _health_ctx(app: web.Application) -> AsyncIterator[None]:
    """Before the worker serves: the supervisor's records (supervised backends are routable only
    when ready), then one round of probes; then both keep running (upstream.prober)."""
    config = app[CONFIG]
    router = app[ROUTER]
    session = probe_session(config.health.timeout_s)
    prober = Prober(router.backends, config.health, session)
    signals = signals_key(config.root) if config.health.engine_signals_s > 0 else None
    sync = FleetSync(router.backends, app[REDIS], fleet_key(config.root), signals,
                     config.health.engine_signals_s)
    tasks: list[asyncio.Task[None]] = []
    try:
        if sync.needed:
            await sync.read_once()
            tasks.append(asyncio.create_task(sync.run(prober)))
        await prober.first_round()
        tasks.append(asyncio.create_task(prober.run()))
        yield
    finally:
        for task in tasks:
            await stop_task(task)
        await session.close()


# What a queued task's `route` names: the request paths a task can run (proxy.tasks.run).
RUNNABLE: dict[str, Runnable] = {
    **{family.name: family for family in (TTS, ASR, IMAGE, VIDEO)},
    **{f"chat:{style.name}": style
       for style in (_OPENAI, _SERVED, _ANTHROPIC, _OLLAMA, _RESPONSES)},
}


async def _tasks_ctx(app: web.Application) -> AsyncIterator[None]:
    """Every worker runs queued tasks (once upstreams exist); stopping leaves its unfinished
    ones pending, for another worker to claim."""
    policy = app[CONFIG].policies.requests.tasks
    runner = TaskRunner(app[REDIS], app[TASKS],
                        lambda account, task_id: queued(app, RUNNABLE, account, task_id),
                        concurrency=policy.runners_per_worker, claim_idle_s=policy.claim_idle_s)
    loop = asyncio.create_task(runner.run())
    yield
    await stop_task(loop)
    await runner.close()


async def sweep_holds(app: web.Application) -> None:
    """Release holds whose worker died before settling them (they carry an expiry). One worker
    of the whole fleet sweeps each time: the holder of the sweeper's lease."""
    lease = Lease(app[REDIS], "sweeper")
    while True:
        interval = min(30.0, app[LIVE].current.policies.prices.hold_ttl_s / 2)
        await asyncio.sleep(interval)
        if not await lease.hold(ttl_s=3 * interval):
            continue  # another worker sweeps (or the store is down)
        try:
            released = await app[LEDGER].sweep()
        except RedisError:
            continue  # the store is down; the holds wait for the next sweep
        if released:
            log.warning("released %d expired credit hold(s) left by a crashed worker", released)


async def sweep_media(media: MediaStore, redis: Store, every_s: float = 60.0) -> None:
    """Delete expired media (whole hours of it). One worker per store sweeps each time: the
    holder of that store's lease (a folder: each host its own; a bucket: the whole fleet)."""
    lease = Lease(redis, f"media-sweeper:{media.blobs.scope}")
    while True:
        await asyncio.sleep(every_s)
        if not await lease.hold(ttl_s=3 * every_s):
            continue
        try:
            swept = await media.sweep()
        except Exception:  # the store is unreachable or refused: the next sweep tries again
            log.warning("the media sweep failed; trying again in %.0f s", every_s, exc_info=True)
            continue
        if swept:
            log.info("deleted %d hour(s) of expired media", swept)
