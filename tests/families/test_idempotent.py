"""`Idempotency-Key` on every POST that runs a model, not only chat: one run and one charge, the
stored answer (binary media included) replayed, another body under the same key refused, and the
same body written otherwise (keys reordered) taken as the same request; a large answer kept in
the media store, never in the ledger."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from proxy.credits import idempotency
from tests.support.media_stack import PER_1K_CHARS, PER_IMAGE, MediaFactory

IMAGE = "/v2/image/acme/generate"
TTS = "/v2/audio/tts/engine"


async def _post_raw(m: Any, path: str, raw: bytes, headers: dict[str, str]
                    ) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            m.gateway.make_url(path), data=raw,
            headers={"Content-Type": "application/json", **headers}) as response:
        return response.status, response.headers, await response.read()


async def test_an_image_retried_runs_once_and_replays(media: MediaFactory) -> None:
    m = await media()
    headers = {**await m.key("pro", "acct-idem"), "Idempotency-Key": "render-1"}
    first = await _post_raw(m, IMAGE, b'{"prompt": "a lighthouse", "n": 2}', headers)
    assert first[0] == 200, first[2]
    # The same request, its keys in another order and spaced otherwise: a replay.
    again = await _post_raw(m, IMAGE, b'{"n":2,"prompt":"a lighthouse"}', headers)
    assert again[0] == 200 and again[2] == first[2]
    assert again[1]["Idempotent-Replayed"] == "true"
    assert len(await m.sim_requests("image")) == 1
    charges = await m.charges("acct-idem")
    assert [c["cost"] for c in charges] == [2 * PER_IMAGE]  # one run, one charge
    # Another body under the same key: refused, nothing run.
    other = await _post_raw(m, IMAGE, b'{"prompt": "a cat", "n": 2}', headers)
    assert other[0] == 422 and orjson.loads(other[2])["detail"][0]["loc"] == [
        "header", "Idempotency-Key"]
    assert len(await m.sim_requests("image")) == 1


async def test_speech_retried_replays_the_same_audio(media: MediaFactory) -> None:
    m = await media()
    headers = {**await m.key("basic", "acct-voice"), "Idempotency-Key": "say-1"}
    body = orjson.dumps({"text": "Hello there.", "preset_voice": "Alice"})
    first = await _post_raw(m, TTS, body, headers)
    assert first[0] == 200 and first[1]["Content-Type"] == "audio/wav"
    again = await _post_raw(m, TTS, body, headers)
    assert (again[0], again[1]["Content-Type"], again[2]) == (200, "audio/wav", first[2])
    assert len(await m.sim_requests("tts")) == 1
    charges = await m.charges("acct-voice")
    assert [c["cost"] for c in charges] == [-(-len("Hello there.") * PER_1K_CHARS // 1000)]


async def test_a_large_answer_is_replayed_from_the_media_store(media: MediaFactory) -> None:
    """Past 64 KiB an answer kept for retries goes to the media store, not into the ledger's
    Redis (its record names the blob), and counts under the account's media cap."""
    m = await media()
    headers = {**await m.key("basic", "acct-big"), "Idempotency-Key": "long-1"}
    body = orjson.dumps({"text": "A long answer, kept as a blob. " * 4})
    first = await _post_raw(m, TTS, body, headers)
    assert first[0] == 200 and len(first[2]) > idempotency.INLINE_BYTES
    async with asyncio.timeout(5):  # kept once the request has ended
        while True:
            if await m.redis.get("igw:{acct-big}:media_bytes"):
                break
            await asyncio.sleep(0.02)
    again = await _post_raw(m, TTS, body, headers)
    assert again[0] == 200 and again[2] == first[2]
    assert again[1]["Idempotent-Replayed"] == "true" and again[1]["Content-Type"] == "audio/wav"
    assert again[1]["X-Request-Id"] and again[1]["Content-Length"] == str(len(first[2]))
    assert len(await m.sim_requests("tts")) == 1
    assert int(await m.redis.get("igw:{acct-big}:media_bytes")) == len(first[2])
    sizes = [await m.redis.memory_usage(k) or 0 async for k in m.redis.scan_iter("*")]
    assert max(sizes) < 10_000, "an answer was written into the ledger's Redis"
    assert [c["cost"] > 0 for c in await m.charges("acct-big")] == [True]


async def test_an_answer_over_the_media_cap_is_not_kept_nor_run_again(
        media: MediaFactory) -> None:
    m = await media(requests_toml="[tasks]\nmax_media_bytes_per_account = 70000\n")
    headers = {**await m.key("basic", "acct-full"), "Idempotency-Key": "long-2"}
    body = orjson.dumps({"text": "Too much to keep for this account. " * 4})
    first = await _post_raw(m, TTS, body, headers)
    assert first[0] == 200 and len(first[2]) > 70_000
    async with asyncio.timeout(5):
        while True:
            again = await _post_raw(m, TTS, body, headers)
            if again[0] != 409 or b"still running" not in again[2]:
                break
            await asyncio.sleep(0.05)
    assert again[0] == 409 and b"too large to keep" in again[2]
    assert len(await m.sim_requests("tts")) == 1
    assert [c["cost"] > 0 for c in await m.charges("acct-full")] == [True]
    assert await m.redis.get("igw:{acct-full}:media_bytes") is None
