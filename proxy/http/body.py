"""Reading a request body under the route's byte cap, and parsing it as a JSON object."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.errors import ErrorKind, GatewayError


async def read_capped(request: web.Request, cap: int) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed `cap` bytes.

    Counted as it arrives: aiohttp's client_max_size does not cover every way a body is read,
    and a declared Content-Length over the cap is refused before anything is read.
    """
    declared = request.content_length
    if declared is not None and declared > cap:
        raise _too_large(cap)
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > cap:
            raise _too_large(cap)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise GatewayError(ErrorKind.INVALID_JSON, "request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise GatewayError(ErrorKind.INVALID_JSON, "request body must be a JSON object")
    return value


def _too_large(cap: int) -> GatewayError:
    return GatewayError(ErrorKind.PAYLOAD_TOO_LARGE, f"request body exceeds {cap} bytes")
