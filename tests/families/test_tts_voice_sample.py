"""Issue 30 #7: a cloned voice's sample is bounded and priced. A 1-character request must not
make the gateway fetch megabytes and post them on: the fetch stops at requests.toml [tts]
max_voice_sample_bytes, a sample longer than max_voice_sample_s is refused, and the TTS server
gets nothing either way; a sample within bounds is charged as characters of text a second."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from tests.support.asr_audio import wav
from tests.support.media_builders import MP3_HEADER, mp3_xing
from tests.support.media_stack import AUDIO_HOST, PER_1K_CHARS, Media, MediaFactory

TTS = "/v2/audio/tts/engine"
# requests.toml [tts]'s defaults: max_voice_sample_bytes, max_voice_sample_s,
# voice_sample_characters_per_s.
MAX_BYTES, MAX_S, PER_S = 2 * 1024 * 1024, 30, 15
TEXT = "Hi."


def _cost(characters: int) -> int:
    return -(-characters * PER_1K_CHARS // 1000)


async def _refused(m: Media, account: str, url: str, kind: str) -> None:
    headers = await m.key("basic", account)
    status, _, raw = await m.post(
        TTS, {"text": TEXT, "custom_voice": {"url": url}}, headers)
    assert status == 422, raw
    [item] = orjson.loads(raw)["detail"]
    assert item["loc"] == ["body", "custom_voice", "url"] and item["type"] == kind, item
    assert await m.sim_requests("tts") == []
    assert [c["cost"] for c in await m.charges(account)] == [0]


async def test_a_sample_over_the_byte_cap_is_not_fetched_past_it(media: MediaFactory) -> None:
    m = await media()
    big = wav(12.0, rate=48000, channels=2)  # 2.3 MB, 12 s: over the byte cap only
    assert len(big) > MAX_BYTES
    await _refused(m, "acct-big", m.serve("/big.wav", big), "url_unusable")
    assert m.files.seen == ["/big.wav"]


async def test_a_streamed_24_mb_sample_is_cut_off_at_the_cap(media: MediaFactory,
                                                             aiohttp_server: Any) -> None:
    """The attack of issue 30 #7: 24 MB sent chunked (no Content-Length) for a 1-character text.
    The gateway stops reading past the cap; most of the 24 MB is never sent."""
    sent = [0]

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "audio/wav"})
        await response.prepare(request)
        chunk = wav(0.5, rate=48000)[:65536]
        try:
            while sent[0] < 24 * 1024 * 1024:
                await response.write(chunk)
                sent[0] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return response

    app = web.Application()
    app.router.add_get("/voice.wav", endless)
    host = await aiohttp_server(app, host=AUDIO_HOST)
    m = await media(extra_ports=[host.port])
    await _refused(m, "acct-stream", f"http://{AUDIO_HOST}:{host.port}/voice.wav",
                   "url_unusable")
    # The cap (2 MB) read, a few MB more in loopback socket buffers (about 6 MB here).
    assert sent[0] < 12 * 1024 * 1024


async def test_a_sample_over_the_duration_cap_is_refused(media: MediaFactory) -> None:
    m = await media()
    long = wav(MAX_S + 1, rate=8000)
    await _refused(m, "acct-long", m.serve("/long.wav", long), "voice_sample_too_long")
    lying = mp3_xing(1)[:384] + (MP3_HEADER + bytes(380)) * 1500  # claims 24 ms, carries 36 s
    await _refused(m, "acct-lying", m.serve("/lying.mp3", lying, "audio/mpeg"),
                   "voice_sample_too_long")


async def test_a_sample_within_bounds_is_charged_by_its_seconds(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("basic", "acct-ok")
    url = m.serve("/voice.wav", wav(2.5, rate=8000))
    status, got, raw = await m.post(TTS, {"text": TEXT, "custom_voice": {"url": url}}, headers)
    assert status == 200 and got["X-Voice"] == "custom", raw
    status, _, raw = await m.post(TTS, {"text": TEXT, "preset_voice": "Alice"}, headers)
    assert status == 200, raw
    cloned, preset = await m.charges("acct-ok")
    sample = -(-25 * PER_S // 10)  # 2.5 s, rounded up to a whole character
    assert cloned["characters"] == len(TEXT) + sample
    assert cloned["cost"] == _cost(len(TEXT) + sample) > preset["cost"] == _cost(len(TEXT))
    assert cloned["held"] == _cost(len(TEXT) + MAX_S * PER_S)
    assert preset["held"] == _cost(len(TEXT))
    [sent, _] = await m.sim_requests("tts")
    assert sent["body"]["voice_sample"]["audio"]
