"""Reading a request body: JSON only, under the route's byte cap, within the body deadline.

Every route that reads a body comes through `read_capped` after its auth check; a request refused
here still counts against the caller's rate limit, and over it the 429 is the answer (DESIGN.md
§6: 401 and 429 come before 400/408/413/415; see pipeline.py). The checks run in this order:
media type (415, nothing read), declared length (413, nothing read), then `100 Continue` for a
client that waits for it, then the bytes as they arrive (413 past the cap, 408 past `[server]
body_timeout_s`), then the JSON itself (400).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import BodyPartReader, StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.errors import ErrorKind, GatewayError

# How long a body may take to arrive once its head has ([server] body_timeout_s).
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)
# The client sent `Expect: 100-continue` and has not had its 100 yet (proxy.http.server)
EXPECTS_CONTINUE = web.RequestKey("expects_continue", bool)


async def read_json(request: web.Request, cap: int) -> dict[str, Any]:
    """The body as a JSON object (415, 413, 408, 400 as `read_capped` and `parse_json_object`)."""
    return parse_json_object(await read_capped(request, cap))


async def read_capped(request: web.Request, cap: int, *, require_json: bool = True) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed `cap` bytes.

    Counted as it arrives: aiohttp's client_max_size does not cover every way a body is read,
    and a declared Content-Length over the cap is refused before anything is read. Every body
    the gateway reads today is JSON; a route reading another kind passes `require_json=False`
    and checks its own media type.
    """
    if require_json:
        _require_json(request)
    declared = request.content_length
    if declared is not None and declared > cap:
        raise _too_large(cap)
    await _continue(request)
    if request.content.is_eof():  # all of it has arrived (the usual small body): no waiting
        return await _read(request.content, cap)
    deadline = request.app[BODY_TIMEOUT_S]
    try:
        async with asyncio.timeout(deadline):
            return await _read(request.content, cap)
    except TimeoutError:
        # The rest of the body is never read: the connection cannot carry another request.
        raise GatewayError(ErrorKind.REQUEST_TIMEOUT,
                           f"the request body did not arrive within {deadline:g} s",
                           headers={"Connection": "close"}) from None


@dataclass(slots=True)
class Form:
    """A multipart/form-data body: text fields (repeatable: `timestamp_granularities[]`) and
    uploaded files."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, Upload] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Upload:
    data: bytes
    filename: str | None
    content_type: str | None


MAX_FORM_FIELDS = 64  # OpenAI's transcription form has about a dozen
FIELD_MAX_BYTES = 64 * 1024  # a text field (e.g. a transcription `prompt`)


async def read_form(request: web.Request, cap: int) -> Form:
    """A multipart body, `cap` bytes at most over all its parts, counted as they arrive (aiohttp's
    client_max_size does not cover multipart reads); 415 when it is not multipart, 413 past the
    cap, 408 past the body deadline, 400 when it is malformed."""
    media = request.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    if media != "multipart/form-data":
        raise GatewayError(ErrorKind.UNSUPPORTED_MEDIA_TYPE,
                           "the request body must be multipart/form-data")
    declared = request.content_length
    if declared is not None and declared > cap:
        raise _too_large(cap)
    await _continue(request)
    deadline = request.app[BODY_TIMEOUT_S]
    try:
        async with asyncio.timeout(deadline):
            return await _read_form(request, cap)
    except TimeoutError:
        raise GatewayError(ErrorKind.REQUEST_TIMEOUT,
                           f"the request body did not arrive within {deadline:g} s",
                           headers={"Connection": "close"}) from None
    # aiohttp's words for a broken body (a part's bad header line is an HttpProcessingError)
    except (ValueError, AssertionError, RuntimeError, HttpProcessingError):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the multipart body is malformed",
                           headers={"Connection": "close"}) from None


async def _read_form(request: web.Request, cap: int) -> Form:
    form = Form()
    size = count = 0
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader) or not part.name:
            raise ValueError("a nested or unnamed part")
        count += 1
        if count > MAX_FORM_FIELDS:
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               f"a form of more than {MAX_FORM_FIELDS} fields")
        limit = cap if part.filename is not None else FIELD_MAX_BYTES
        chunks: list[bytes] = []
        part_size = 0
        while chunk := await part.read_chunk(64 * 1024):
            size += len(chunk)
            part_size += len(chunk)
            if size > cap:
                raise _too_large(cap)
            if part_size > limit:
                raise GatewayError(ErrorKind.PAYLOAD_TOO_LARGE,
                                   f"form field {part.name!r} exceeds {limit} bytes")
            chunks.append(chunk)
        data = b"".join(chunks)
        if part.filename is not None:
            form.files[part.name] = Upload(data, part.filename,
                                           part.headers.get("Content-Type"))
        else:
            try:
                text = data.decode()
            except UnicodeDecodeError:
                raise GatewayError(ErrorKind.INVALID_REQUEST,
                                   f"form field {part.name!r} is not UTF-8 text") from None
            form.fields.setdefault(part.name, []).append(text)
    return form


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


def is_json_media_type(content_type: str) -> bool:
    """`application/json` or any `application/*+json`, with or without parameters (charset)."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json"))


async def _continue(request: web.Request) -> None:
    """A client that sent `Expect: 100-continue` holds its body back until told to send it:
    now, once the checks that need no body have passed."""
    if request.get(EXPECTS_CONTINUE):
        request[EXPECTS_CONTINUE] = False
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp does: the response proper has not begun


def _require_json(request: web.Request) -> None:
    # The raw header: aiohttp's `content_type` reports a missing one as application/octet-stream.
    if not is_json_media_type(request.headers.get("Content-Type", "")):
        # The client's value is not repeated: it is theirs to know, and may carry anything.
        raise GatewayError(ErrorKind.UNSUPPORTED_MEDIA_TYPE,
                           "the request body must be JSON (Content-Type: application/json)")


async def _read(content: StreamReader, cap: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > cap:
            raise _too_large(cap)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_large(cap: int) -> GatewayError:
    return GatewayError(ErrorKind.PAYLOAD_TOO_LARGE, f"request body exceeds {cap} bytes")
