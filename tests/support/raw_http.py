"""Raw-socket HTTP for tests that must send what no client library would (or would not read)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp.test_utils import TestServer


async def connect(server: TestServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert server.host is not None and server.port is not None
    return await asyncio.open_connection(server.host, server.port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response by its Content-Length: status, lower-cased headers, body."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (a reset after the data counts as closed)."""
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """A whole response read off a closed connection."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def error_type(body: bytes) -> Any:
    """`error.type` of a documented error body (which also carries `detail`)."""
    document = orjson.loads(body)
    assert document["detail"] and document["error"]["message"]
    return document["error"]["type"]
