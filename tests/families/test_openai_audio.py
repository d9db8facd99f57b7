"""The OpenAI-style audio routes with the official `openai` client: speech, transcriptions and
translations on the same path (limits, holds, charges) as the spec's TTS and ASR routes."""

from __future__ import annotations

import math

import aiohttp
import openai
import orjson
import pytest

from proxy.media.wav import wav_bytes
from tests.support.media_stack import (
    ASR_MODEL,
    PER_AUDIO_S,
    TTS_MODEL,
    Media,
    MediaFactory,
    assert_speech_wav,
)


def client(m: Media, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(m.gateway.make_url("/v2/compat/v1")), api_key=key,
                              max_retries=0)


async def test_speech_with_the_openai_client(media: MediaFactory) -> None:
    m = await media()
    key = (await m.key("basic", "acct-o"))["X-API-Key"]
    async with client(m, key) as ai:
        speech = await ai.audio.speech.create(model=TTS_MODEL, voice="alice",
                                              input="Hello from the SDK.",
                                              response_format="wav")
        wav = speech.content
        seconds = assert_speech_wav(wav)
        assert seconds == pytest.approx(len("Hello from the SDK.") * 0.06, abs=0.01)
        raw = "Raw samples, twice as fast."
        pcm = await ai.audio.speech.create(model=TTS_MODEL, voice="Emma", input=raw,
                                           response_format="pcm", speed=2.0)
        assert pcm.response.headers["Content-Type"] == "audio/pcm"
        assert len(pcm.content) == round(len(raw) * 0.06 / 2.0 * 24000) * 2
        with pytest.raises(openai.UnprocessableEntityError):
            await ai.audio.speech.create(model=TTS_MODEL, voice="alloy", input="x")
        with pytest.raises(openai.UnprocessableEntityError):
            await ai.audio.speech.create(model=TTS_MODEL, voice="alice", input="x",
                                         response_format="mp3")
    sent = await m.sim_requests("tts")
    assert [r["body"]["voice"] for r in sent] == ["alice", "emma"]
    assert sent[1]["body"]["speed"] == 2.0
    charges = await m.charges("acct-o")
    assert [c["characters"] for c in charges] == [len("Hello from the SDK."), len(raw)]


async def test_transcriptions_with_the_openai_client(media: MediaFactory) -> None:
    m = await media()
    key = (await m.key("basic", "acct-t"))["X-API-Key"]
    async with client(m, key) as ai:
        wav = (await ai.audio.speech.create(model=TTS_MODEL, voice="grace",
                                            input="Round trip through the SDK.")).content
        seconds = assert_speech_wav(wav)
        plain = await ai.audio.transcriptions.create(model=ASR_MODEL, file=("a.wav", wav))
        assert plain.text == "Round trip through the SDK."
        verbose = await ai.audio.transcriptions.create(
            model=ASR_MODEL, file=("a.wav", wav), response_format="verbose_json",
            timestamp_granularities=["word", "segment"], language="en", prompt="SDK")
        assert verbose.language == "english" and verbose.duration == round(seconds, 3)
        assert verbose.segments and verbose.words
        assert [w.word for w in verbose.words] == plain.text.split()
        text = await ai.audio.transcriptions.create(model=ASR_MODEL, file=("a.wav", wav),
                                                    response_format="text")
        assert text.strip() == plain.text
        with pytest.raises(openai.UnprocessableEntityError):  # not audio
            await ai.audio.transcriptions.create(model=ASR_MODEL, file=("a.wav", b"<html>"))
        with pytest.raises(openai.NotFoundError):
            await ai.audio.transcriptions.create(model="acme/nope", file=("a.wav", wav))
    # Translations: the SDK's call is deprecated (a warning), so the form goes by hand.
    form = aiohttp.FormData()
    form.add_field("model", ASR_MODEL)
    form.add_field("file", wav, filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as session, session.post(
            m.gateway.make_url("/v2/compat/v1/audio/translations"), data=form,
            headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200 and (await r.json())["text"] == plain.text
    sent = await m.sim_requests("whisper")
    assert [r["path"] for r in sent] == ["/v1/audio/transcriptions"] * 3 + [
        "/v1/audio/translations"]
    assert sent[1]["body"]["prompt"] == "SDK"
    assert sent[1]["body"]["timestamp_granularities[]"] == ["segment", "word"]
    charges = await m.charges("acct-t")
    asr = [c for c in charges if c["model"] == ASR_MODEL]
    assert len(asr) == 5 and [c["cost"] for c in asr if c["status"] == "completed"] == [
        math.ceil(round(seconds * 1000) * PER_AUDIO_S / 1000)] * 4


async def test_uploads_are_counted_and_checked(media: MediaFactory) -> None:
    """I1: the upload counts against [fetch] max_bytes as it arrives; not multipart is 415,
    a body without a boundary or a missing file is refused; nothing reaches the server."""
    m = await media(fetch={"max_bytes": 40_000})
    url = m.gateway.make_url("/v2/compat/v1/audio/transcriptions")
    big = wav_bytes(b"\x00\x01" * 200_000, 16000)  # 400 KB
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("model", ASR_MODEL)
        form.add_field("file", big, filename="big.wav", content_type="audio/wav")
        async with session.post(url, data=form) as r:
            assert r.status == 413
        async with session.post(url, json={"model": ASR_MODEL}) as r:
            assert r.status == 415
        async with session.post(url, data=b"--x\r\n" + b"a" * 1000,
                                headers={"Content-Type": "multipart/form-data"}) as r:
            assert r.status == 400
        # A part whose header line is not a header (found by fuzzing: was a 500).
        bad_header = (b'--b\r\nContent-Disposition: form-data; name="\x0c\x7f"\r\n\r\nx\r\n'
                      b"--b--\r\n")
        async with session.post(url, data=bad_header,
                                headers={"Content-Type": "multipart/form-data; boundary=b"}) as r:
            assert r.status == 400, await r.text()
        form = aiohttp.FormData()
        form.add_field("model", ASR_MODEL)
        form.add_field("other", b"RIFF", filename="a.wav")
        async with session.post(url, data=form) as r:
            assert r.status == 422
            assert orjson.loads(await r.read())["detail"][0]["loc"] == ["body", "file"]
        form = aiohttp.FormData()
        form.add_field("model", ASR_MODEL)
        form.add_field("response_format", "srt")
        form.add_field("file", wav_bytes(b"\x00\x00" * 100, 16000), filename="a.wav")
        async with session.post(url, data=form) as r:
            assert r.status == 422
    assert await m.sim_requests("whisper") == []


