"""Request and response bodies: JSON objects in (with typed optional fields) and out, and form
bodies (multipart uploads or urlencoded pairs) read into fields in order."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import BodyPartReader, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.simulators.errors import BadRequest, HttpError

T = TypeVar("T")


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(str(exc), "syntax") from None
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object", "type")
    return body


def opt(body: Mapping[str, Any], key: str, kind: type[T]) -> T | None:
    """`body[key]` if present and of type `kind` (null counts as absent); bools are not ints."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise BadRequest(f"{key}: invalid type, expected {kind.__name__}", "type")


def json_response(
    data: object, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(data), content_type="application/json", headers=headers
    )


@dataclass(frozen=True, slots=True)
class FormField:
    """One field of a form body; repeated names (`timestamp_granularities[]`) stay separate."""

    name: str
    value: str | bytes
    filename: str | None = None
    content_type: str | None = None

    @property
    def is_file(self) -> bool:
        # As Starlette decides: a part with a filename is an upload, and so is a part whose
        # bytes are not text (aiohttp keeps those as bytes).
        return self.filename is not None or isinstance(self.value, bytes)


def form_summary(fields: Sequence[FormField]) -> dict[str, object]:
    """What `/_sim/requests` shows of a form: text fields, and each file's name, type and size.

    A name ending in `[]` always maps to a list; other repeated names become lists too.
    """
    out: dict[str, object] = {}
    for field in fields:
        value: object = field.value
        if field.is_file:
            value = {"filename": field.filename, "content_type": field.content_type,
                     "size": len(field.value)}
        if field.name in out:
            seen = out[field.name]
            out[field.name] = [*seen, value] if isinstance(seen, list) else [seen, value]
        else:
            out[field.name] = [value] if field.name.endswith("[]") else value
    return out


class Form:
    """A form's fields by name: the first of a name, or all of a repeated one, as text."""

    def __init__(self, fields: Sequence[FormField]) -> None:
        self.fields = fields

    def get(self, name: str) -> FormField | None:
        return next((f for f in self.fields if f.name == name), None)

    def text(self, name: str) -> str | None:
        field = self.get(name)
        if field is None:
            return None
        value = field.value
        return value if isinstance(value, str) else value.decode("utf-8", "replace")

    def texts(self, name: str) -> list[str]:
        return [f.value if isinstance(f.value, str) else f.value.decode("utf-8", "replace")
                for f in self.fields if f.name == name]


async def read_form(request: web.Request) -> list[FormField]:
    """The body's form fields in order: multipart parts or urlencoded pairs; none otherwise.

    Multipart parts are read into memory under the app's `client_max_size`, as
    `request.post()` would cap them, but without its temporary files.
    """
    limit = request.client_max_size
    if request.content_type == "application/x-www-form-urlencoded":
        text = (await request.read()).decode("utf-8", "replace")
        return [FormField(k, v) for k, v in urllib.parse.parse_qsl(text, keep_blank_values=True)]
    if request.content_type != "multipart/form-data":
        await request.read()  # e.g. a JSON body: no form fields, but drain it
        return []
    try:
        return await _read_multipart(request, limit)
    except (ValueError, KeyError, HttpProcessingError):
        # Starlette's words for a body its multipart parser rejects.
        raise HttpError(400, "There was an error parsing the body") from None


async def _read_multipart(request: web.Request, limit: int) -> list[FormField]:
    fields: list[FormField] = []
    total = 0
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue  # a nested multipart: no server we imitate reads those
        chunks = []
        while chunk := await part.read_chunk():
            total += len(chunk)
            if total > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=total)
            chunks.append(chunk)
        data = b"".join(chunks)
        ctype = part.headers.get(hdrs.CONTENT_TYPE)
        value: str | bytes = data
        if part.filename is None and (ctype is None or ctype.startswith("text/")):
            value = data.decode(part.get_charset("utf-8"), "replace")
        fields.append(FormField(part.name or "", value, part.filename, ctype))
    return fields
