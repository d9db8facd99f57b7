"""Media parts of chat requests (issue 30 #5): a part that names a URL for the model server to
fetch (cloud metadata, the gateway's own admin routes, file:) is refused before anything is held
or sent; media go upstream inline only, bounded in count and bytes, and priced into the hold."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.credits.ledger import Ledger
from proxy.credits.pricing import IMAGE_PROMPT_TOKENS, VIDEO_PROMPT_TOKENS, prompt_upper_bound
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import SimulatorFactory, sim_requests

COMPAT = "/v2/compat/v1/chat/completions"
SERVED = "/v2/served/v1/chat/completions"
MESSAGES = "/v2/messages/v1/messages"
OLLAMA = "/v2/native/api/chat"
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode()
DATA_URL = f"data:image/png;base64,{PNG}"
# 1 micro-credit per prompt token, 10 per completion token.
PRICES = f"""
version = "test-v1"
default_max_tokens = 100
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
[models."{MODEL}"]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""


def targets(gw: TestServer) -> list[str]:
    return ["http://169.254.169.254/latest/meta-data/iam/security-credentials/",
            f"http://127.0.0.1:{gw.port}/admin/keys", "file:///etc/passwd"]


async def send(gw: TestServer, path: str, body: Any, key: str | None = None
               ) -> tuple[int, dict[str, Any]]:
    key = key or gw.api_key  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(path), data=orjson.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                     "x-api-key": key}) as response:
        return response.status, orjson.loads(await response.read())


def openai_body(part: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}


def openai_parts(url: str) -> list[tuple[dict[str, Any], list[str | int]]]:
    """Each way an OpenAI/vLLM content part names a URL, and where its fault points."""
    at: list[str | int] = ["body", "messages", 0, "content", 1]
    return [
        ({"type": "image_url", "image_url": {"url": url}}, [*at, "image_url", "url"]),
        ({"type": "image_url", "image_url": url}, [*at, "image_url"]),  # vLLM's short form
        ({"image_url": {"url": url}}, [*at, "image_url", "url"]),  # no type: vLLM reads it too
        ({"type": "video_url", "video_url": {"url": url}}, [*at, "video_url", "url"]),
        ({"type": "audio_url", "audio_url": {"url": url}}, [*at, "audio_url", "url"]),
        ({"type": "file", "file": {"url": url}}, [*at, "file", "url"]),
    ]


@pytest.mark.parametrize("path", [COMPAT, SERVED])
async def test_openai_parts_naming_urls_are_refused_and_nothing_is_sent(
        path: str, simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    for url in targets(gw):
        for part, loc in openai_parts(url):
            status, body = await send(gw, path, openai_body(part))
            assert status == 422, (url, part, body)
            [fault] = body["detail"]
            assert fault["loc"] == loc and fault["type"] == "url_not_allowed", fault
    for part in ({"type": "file", "file": {"file_id": "file-abc"}},
                 {"type": "image_embeds", "image_embeds": PNG},
                 {"type": "video_embeds", "video_embeds": PNG},
                 {"type": "prompt_embeds", "data": PNG}):
        status, body = await send(gw, path, openai_body(part))
        assert status == 422 and body["detail"][0]["type"] == "url_not_allowed", body
    assert await sim_requests(sim) == []


async def test_anthropic_image_url_sources_are_refused_and_nothing_is_sent(
        simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    for url in targets(gw):
        image = {"type": "image", "source": {"type": "url", "url": url}}
        status, body = await send(gw, MESSAGES, {
            "model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}]})
        assert status == 422 and body["error"]["type"] == "invalid_request_error", body
        [fault] = body["detail"]
        assert fault["loc"] == ["body", "messages", 0, "content", 0, "source", "url"], fault
        assert fault["type"] == "url_not_allowed"
        # Inside a tool result too.
        status, body = await send(gw, MESSAGES, {"model": MODEL, "max_tokens": 8, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]}]})
        assert status == 422, body
        assert body["detail"][0]["loc"] == ["body", "messages", 2, "content", 0, "content", 0,
                                            "source", "url"]
    assert await sim_requests(sim) == []


@pytest.mark.parametrize("path", [COMPAT, SERVED])
async def test_inline_media_go_upstream_as_sent(
        path: str, simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    part = {"type": "image_url", "image_url": {"url": DATA_URL}}
    status, body = await send(gw, path, openai_body(part))
    assert status == 200, body
    [seen] = await sim_requests(sim)
    assert seen["body"]["messages"][0]["content"][1] == part


async def test_media_parts_are_bounded_in_count_and_bytes(
        simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, policies={"requests.toml": """
[chat]
max_media_parts = 2
max_media_part_bytes = 4096
max_media_bytes = 6144
"""})
    image = {"type": "image_url", "image_url": {"url": DATA_URL}}
    status, body = await send(gw, COMPAT, {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [image, image, image]}]})
    assert status == 422, body
    assert body["detail"][0]["type"] == "too_many_media_parts"
    # Ollama's images count alike (its route answers in Ollama's shape).
    status, body = await send(gw, OLLAMA, {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "?", "images": [PNG, PNG, PNG]}]})
    assert status == 422, body
    big = base64.b64encode(bytes(5000)).decode()
    status, body = await send(gw, COMPAT, openai_body(
        {"type": "input_audio", "input_audio": {"data": big, "format": "wav"}}))
    assert status == 413, body
    mid = f"data:image/png;base64,{base64.b64encode(bytes(3500)).decode()}"
    two = {"type": "image_url", "image_url": {"url": mid}}
    status, body = await send(gw, COMPAT, {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [two, two]}]})
    assert status == 413, body  # each within its cap, both past the total
    assert await sim_requests(sim) == []
    status, body = await send(gw, COMPAT, {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [image, image]}]})
    assert status == 200, body


def test_prompt_bound_prices_media() -> None:
    def bound(*parts: dict[str, Any]) -> int:
        return prompt_upper_bound({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, *parts]}]})

    text = bound()
    assert bound({"type": "image_url", "image_url": {"url": DATA_URL}}) \
        == text + IMAGE_PROMPT_TOKENS
    assert bound({"image_url": DATA_URL}, {"image_url": DATA_URL}) \
        == text + 2 * IMAGE_PROMPT_TOKENS
    assert bound({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}) \
        == text + VIDEO_PROMPT_TOKENS
    audio = base64.b64encode(bytes(3000)).decode()
    assert bound({"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}) \
        >= text + 3000


async def test_the_hold_of_a_request_with_images_covers_them(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """With 5,000 micro-credits a text request's hold fits (prompt bound + 100 completion
    tokens x 10), one with an image does not: its hold counts the image's allowance."""
    sim = await simulator("vllm")
    gw = await gateway(sim, policies={"prices.toml": PRICES})
    key = await new_key(clean_redis.url, "max", account="acme")
    redis = Redis.from_url(clean_redis.url)
    try:
        await Ledger(redis).credit("acme", 5_000, {"reason": "test"})
        text = {"model": MODEL, "messages": [{"role": "user", "content": "What is this?"}]}
        image = {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": DATA_URL}}]}]}
        status, body = await send(gw, COMPAT, image, key)
        assert status == 402 and body["error"]["type"] == "insufficient_credits", body
        status, body = await send(gw, OLLAMA, {"model": MODEL, "stream": False, "messages": [
            {"role": "user", "content": "What is this?", "images": [PNG]}]}, key)
        assert status == 402, body
        status, body = await send(gw, MESSAGES, {"model": MODEL, "max_tokens": 100, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": PNG}}]}]}, key)
        assert status == 402, body
        assert await sim_requests(sim) == []
        status, body = await send(gw, COMPAT, text, key)
        assert status == 200, body
    finally:
        await redis.aclose()
