"""The operator console: a read-only page over the admin API (and its one action, reloading the
policies), shipped in the package (`console_assets/`) and served by page_files like the usage
dashboard; and `GET /admin/overview`, the fleet-wide figures only it shows.

    GET /admin/console            the page: the operator types the admin token (or an admin JWT)
    GET /admin/console/app.js     reads /admin/backends, /admin/shadow and /admin/overview with
                                  it every few seconds; POSTs /admin/reload on request
    GET /admin/console/style.css, /admin/console/icon.svg
    GET /admin/overview[?top=N]   top accounts by spend and by refusals (24 h), errors by type
                                  (1 h) and the last 50 errors, over every worker and host
                                  (what observe.fleet_tally gathered)

The page's routes serve the same bytes to everyone and never see the token: the page sends it
only to the /admin JSON routes, which check it as they check any caller's.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Final

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.api.admin import query_count, require_admin
from proxy.api.page_files import asset, doc, serve
from proxy.appkeys import REDIS
from proxy.credits.ledger import as_text
from proxy.credits.pricing import format_credits
from proxy.errors import store_unavailable
from proxy.observe.fleet_tally import (
    ERROR_MINUTES,
    RECENT,
    RECENT_MAX,
    SPEND_HOURS,
    errors_key,
    refused_key,
    spend_key,
)
from proxy.store.client import Store

_FOLDER: Final = "console_assets"
page: Final = serve(asset(_FOLDER, "index.html", "text/html"))
script: Final = serve(asset(_FOLDER, "app.js", "text/javascript"))
style: Final = serve(asset(_FOLDER, "style.css", "text/css"))
icon: Final = serve(asset(_FOLDER, "icon.svg", "image/svg+xml"))

TOP_DEFAULT: Final = 10
TOP_MAX: Final = 100


async def overview(request: web.Request) -> web.Response:
    await require_admin(request)
    top = query_count(request, "top", TOP_DEFAULT, TOP_MAX)
    try:
        body = await read_overview(request.app[REDIS], top, time.time())
    except RedisError:
        raise store_unavailable("state store") from None
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def read_overview(redis: Store, top: int, now: float) -> dict[str, Any]:
    """The fleet's top `top` accounts by spend and by refusals over the last 24 hourly
    buckets, and its errors by type over the last 60 minutes and the last 50 of them."""
    hours = range(int(now // 3600) - SPEND_HOURS + 1, int(now // 3600) + 1)
    minutes = range(int(now // 60) - ERROR_MINUTES + 1, int(now // 60) + 1)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zunion([spend_key(hour) for hour in hours], withscores=True)
        pipe.zunion([refused_key(hour) for hour in hours], withscores=True)
        pipe.lrange(RECENT, 0, RECENT_MAX - 1)
        for minute in minutes:
            pipe.hgetall(errors_key(minute))
        spend, refused, recent, *errors = await pipe.execute()
    return {
        "window_s": SPEND_HOURS * 3600,
        "top_spend": [{"account": account, "credits": format_credits(micro),
                       "micro_credits": micro} for account, micro in _top(spend, top)],
        "top_refused": [{"account": account, "refusals": count}
                        for account, count in _top(refused, top)],
        "errors": {"window_s": ERROR_MINUTES * 60, "by_type": _by_type(errors),
                   "recent": [orjson.loads(entry) for entry in recent]},
    }


def _top(scored: list[tuple[Any, float]], top: int) -> list[tuple[str, int]]:
    """The `top` highest (ties by account), scores as the integers they were summed from."""
    pairs = sorted(((as_text(member), round(score)) for member, score in scored),
                   key=lambda pair: (-pair[1], pair[0]))
    return pairs[:top]


def _by_type(minutes: list[dict[Any, Any]]) -> dict[str, dict[str, int]]:
    """Error answers per type, most first; its status the one it was answered with most."""
    counts: Counter[tuple[str, int]] = Counter()
    for fields in minutes:
        for kind, count in fields.items():
            error, _, answered = as_text(kind).rpartition(" ")
            counts[error, int(answered)] += int(count)
    by_type: dict[str, dict[str, int]] = {}
    for (error, status), count in counts.most_common():
        seen = by_type.setdefault(error, {"count": 0, "status": status})
        seen["count"] += count
    return dict(sorted(by_type.items(), key=lambda item: (-item[1]["count"], item[0])))


# ---- what the OpenAPI document says of them --------------------------------------------------

PAGE_DOC: Final = doc("The operator console (reads the /admin routes with the admin token "
                      "typed into it)", "text/html", "admin")
SCRIPT_DOC: Final = doc("The operator console's script", "text/javascript", "admin")
STYLE_DOC: Final = doc("The operator console's styles", "text/css", "admin")
ICON_DOC: Final = doc("The operator console's icon", "image/svg+xml", "admin")
