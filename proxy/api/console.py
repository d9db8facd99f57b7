"""The operator console: a read-only page over the admin API (and its one action, reloading the
policies), shipped in the package (`console_assets/`) and served by page_files like the usage
dashboard; and `GET /admin/overview`, the fleet-wide figures only it shows.

    GET /admin/console            the page: the operator types the admin token (or an admin JWT)
    GET /admin/console/app.js     reads /admin/backends, /admin/shadow and /admin/overview with
                                  it every few seconds; POSTs /admin/reload on request
    GET /admin/console/style.css, /admin/console/icon.svg
    GET /admin/overview[?top=N]   top accounts by spend and by refusals (24 h), errors by type
                                  (1 h) and the last 50 errors, over every worker and host
                                  (api.fleet_tally)

The page's routes serve the same bytes to everyone and never see the token: the page sends it
only to the /admin JSON routes, which check it as they check any caller's.
"""

from __future__ import annotations

import time
from typing import Final

import orjson
from aiohttp import web
from redis.exceptions import RedisClusterException, RedisError

from proxy.api.admin import query_count, require_admin
from proxy.api.fleet_tally import overview as read_overview
from proxy.api.page_files import asset, doc, serve
from proxy.appkeys import REDIS
from proxy.errors import store_unavailable

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
    except (RedisError, RedisClusterException):
        raise store_unavailable("state store") from None
    return web.Response(body=orjson.dumps(body), content_type="application/json")


# ---- what the OpenAPI document says of them --------------------------------------------------

PAGE_DOC: Final = doc("The operator console (reads the /admin routes with the admin token "
                      "typed into it)", "text/html", "admin")
SCRIPT_DOC: Final = doc("The operator console's script", "text/javascript", "admin")
STYLE_DOC: Final = doc("The operator console's styles", "text/css", "admin")
ICON_DOC: Final = doc("The operator console's icon", "image/svg+xml", "admin")
