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
    # Only a body with that many brackets can nest that deep: most never pay for the walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and too_deep(value, MAX_DEPTH):
        raise GatewayError(ErrorKind.INVALID_JSON,
                           f"request body nests deeper than {MAX_DEPTH} levels")
    return value


# Nothing a model server takes nests this deep; deeper bodies would break what re-encodes them
# (orjson writes at most 254 levels) and what walks them recursively.
MAX_DEPTH = 64


def too_deep(value: object, limit: int) -> bool:
    """Whether `value` nests objects and arrays more than `limit` levels (iterative)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _too_large(cap: int) -> GatewayError:
    return GatewayError(ErrorKind.PAYLOAD_TOO_LARGE, f"request body exceeds {cap} bytes")
