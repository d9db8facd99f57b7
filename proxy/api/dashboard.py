"""The account holder's usage dashboard (spec: "usage is shown in a dashboard"): a page, its
script and its styles, shipped in the package (`dashboard_assets/`) and read once at import.

    GET /dashboard            the page: the holder types an API key
    GET /dashboard/app.js     reads GET /v2/account and /v2/account/usage with it; tables, and
                              charts drawn as inline SVG
    GET /dashboard/style.css

These routes serve the same bytes to everyone and never see a key: the page sends it only to the
account routes, which check it as they check any caller's.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Final, NamedTuple

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.api.openapi import Doc, Header, Response

# The page holds a key: it runs only what it was shipped with (no inline or foreign script or
# style), talks only to this gateway, cannot be framed, and no form of it ever submits (a key
# in a query string would end up in logs and history).
CSP: Final = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
              "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
              "frame-ancestors 'none'")
HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Revalidated on every load (a 304 when unchanged), so an upgraded gateway never pairs its
    # new page with a cached old script.
    "Cache-Control": "no-cache",
}


class Asset(NamedTuple):
    body: bytes
    content_type: str
    etag: str


def _asset(name: str, content_type: str) -> Asset:
    body = (resources.files("proxy.api") / "dashboard_assets" / name).read_bytes()
    return Asset(body, content_type, f'"{hashlib.sha256(body).hexdigest()[:20]}"')


PAGE: Final = _asset("index.html", "text/html")
SCRIPT: Final = _asset("app.js", "text/javascript")
STYLE: Final = _asset("style.css", "text/css")


def _serve(asset: Asset) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        headers = {**HEADERS, "ETag": asset.etag}
        if _matches(request.headers.get("If-None-Match"), asset.etag):
            return web.Response(status=304, headers=headers)
        return web.Response(body=asset.body, content_type=asset.content_type, charset="utf-8",
                            headers=headers)

    return handler


def _matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 If-None-Match: `*`, or a list of tags compared weakly (a `W/` prefix ignored)."""
    if if_none_match is None:
        return False
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags


page: Final = _serve(PAGE)
script: Final = _serve(SCRIPT)
style: Final = _serve(STYLE)

# ---- what the OpenAPI document says of them --------------------------------------------------

_HEADER_DOCS: Final = {
    "Content-Security-Policy": Header("Only this gateway's own script, styles and API",
                                      required=True),
    "Cache-Control": Header("`no-cache`: revalidated by ETag on every load", required=True),
    "ETag": Header("Of this file's bytes", required=True),
    "X-Content-Type-Options": Header("`nosniff`", required=True),
    "Referrer-Policy": Header("`no-referrer`", required=True),
}


def _doc(summary: str, content_type: str) -> Doc:
    return Doc(summary=summary, tags=("dashboard",), security=(),
               responses={200: Response(summary, None, content_type, _HEADER_DOCS),
                          304: Response("Not modified: If-None-Match named this ETag", None, (),
                                        _HEADER_DOCS)})


PAGE_DOC: Final = _doc("The usage dashboard for account holders (reads /v2/account and "
                       "/v2/account/usage with the key typed into it)", "text/html")
SCRIPT_DOC: Final = _doc("The usage dashboard's script", "text/javascript")
STYLE_DOC: Final = _doc("The usage dashboard's styles", "text/css")
