"""`Idempotency-Key` on every POST that runs a model, not only chat: one run and one charge, the
stored answer (binary media included) replayed, another body under the same key refused, and the
same body written otherwise (keys reordered) taken as the same request."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

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
