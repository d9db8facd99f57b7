"""The OpenAI-style chat route from a client's side: its path, a greeting to send, the official
openai client for a test gateway, a raw POST, and the payloads of an SSE body."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import orjson
from aiohttp.test_utils import TestServer

from proxy.http.sse import SSEDecoder

CHAT = "/v2/compat/v1/chat/completions"
HELLO = [{"role": "user", "content": "Say hello to the world."}]


def client_for(gateway: TestServer, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=str(gateway.make_url("/v2/compat/v1")), api_key=gateway.api_key,  # type: ignore[attr-defined]
        max_retries=0, **options,
    )


async def post(gateway: TestServer, body: Any, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session, session.post(
        gateway.make_url(CHAT), data=raw if raw is not None else orjson.dumps(body),
        headers={"Content-Type": "application/json", **(headers or {})},
    ) as response:
        return response.status, dict(response.headers), await response.read()


def sse_payloads(raw: bytes) -> list[bytes]:
    decoder = SSEDecoder()
    return [event.data for event in decoder.feed(raw) + decoder.finish()]
