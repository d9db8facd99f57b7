"""The files of a browser page the gateway ships (its HTML, script and styles, each page in a
folder of `proxy.api`), read once at import and served to everyone alike under one strict
policy, with an ETag; and what the OpenAPI document says of them. The usage dashboard
(dashboard.py) and the operator console (console.py) are two such pages.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Final, NamedTuple

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.api.openapi import Doc, Header, Response

# A page holds a key or a token: it runs only what it was shipped with (no inline or foreign
# script or style), talks only to this gateway, cannot be framed, and no form of it ever
# submits (a key in a query string would end up in logs and history).
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


def asset(folder: str, name: str, content_type: str) -> Asset:
    """`name` in the package folder `folder` of proxy.api (listed in pyproject's package-data)."""
    body = (resources.files("proxy.api") / folder / name).read_bytes()
    return Asset(body, content_type, f'"{hashlib.sha256(body).hexdigest()[:20]}"')


def serve(file: Asset) -> Handler:
    """The route handler of one file: its bytes, or a 304 when the client holds them."""
    async def handler(request: web.Request) -> web.Response:
        headers = {**HEADERS, "ETag": file.etag}
        if _matches(request.headers.get("If-None-Match"), file.etag):
            return web.Response(status=304, headers=headers)
        return web.Response(body=file.body, content_type=file.content_type, charset="utf-8",
                            headers=headers)

    return handler


def _matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 If-None-Match: `*`, or a list of tags compared weakly (a `W/` prefix ignored)."""
    if if_none_match is None:
        return False
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags


# ---- what the OpenAPI document says of them --------------------------------------------------

_HEADER_DOCS: Final = {
    "Content-Security-Policy": Header("Only this gateway's own script, styles and API",
                                      required=True),
    "Cache-Control": Header("`no-cache`: revalidated by ETag on every load", required=True),
    "ETag": Header("Of this file's bytes", required=True),
    "X-Content-Type-Options": Header("`nosniff`", required=True),
    "Referrer-Policy": Header("`no-referrer`", required=True),
}


def doc(summary: str, content_type: str, tag: str) -> Doc:
    """A page file's route: no credentials, the file or a 304."""
    return Doc(summary=summary, tags=(tag,), security=(),
               responses={200: Response(summary, None, content_type, _HEADER_DOCS),
                          304: Response("Not modified: If-None-Match named this ETag", None, (),
                                        _HEADER_DOCS)})
