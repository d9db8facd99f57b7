"""POST /v2/audio/tts/engine and GET /v2/audio/tts/presets through the gateway, against the TTS
simulator (and the whisper one, to hear the speech back)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config import VOICE_PRESETS
from proxy.media.wav import read_wav, wav_bytes
from tests.support.media_stack import (
    PER_1K_CHARS,
    PER_AUDIO_S,
    TTS_MODEL,
    MediaFactory,
    assert_speech_wav,
)

TTS = "/v2/audio/tts/engine"
ASR = "/v2/audio/asr/engine"


async def test_presets_are_listed_to_guests_and_keys(media: MediaFactory) -> None:
    m = await media()
    async with aiohttp.ClientSession() as session:
        for headers in ({}, await m.key("basic", "acct-p")):
            async with session.get(m.gateway.make_url("/v2/audio/tts/presets"),
                                   headers=headers) as r:
                assert r.status == 200 and await r.json() == list(VOICE_PRESETS)
        async with session.get(m.gateway.make_url("/v2/audio/tts/presets"),
                               headers={"X-API-Key": "igw_sk_wrong"}) as r:
            assert r.status == 401


async def test_basic_key_speaks_every_preset_and_hears_it_back(media: MediaFactory) -> None:
    """The issue's "done when": each preset synthesised, transcribed back through the
    simulators, each call charged by its own unit."""
    m = await media()
    headers = await m.key("basic", "acct-basic")
    expected_cost = 0
    for preset in VOICE_PRESETS:
        text = f"Hello from {preset}, the quick brown fox."
        status, got, wav = await m.post(TTS, {"text": text, "preset_voice": preset}, headers)
        assert status == 200, wav
        assert got["Content-Type"] == "audio/wav" and got["X-Voice"] == preset
        seconds = assert_speech_wav(wav)
        assert seconds == pytest.approx(len(text) * 0.06, abs=0.01)  # the simulator's pace
        url = m.serve(f"/{preset}.wav", wav)
        status, _, raw = await m.post(ASR, {"audio_url": url}, headers)
        assert status == 200, raw
        answer = orjson.loads(raw)
        assert answer == {"text": text, "language": "en", "duration": round(seconds, 3)}
        expected_cost += -(-len(text) * PER_1K_CHARS // 1000)
        expected_cost += -(-round(seconds * 1000) * PER_AUDIO_S // 1000)
    charges = await m.charges("acct-basic")
    assert len(charges) == 2 * len(VOICE_PRESETS)
    tts = [c for c in charges if c["model"] == TTS_MODEL]
    assert all(c["characters"] > 0 and "audio_ms" not in c for c in tts)
    assert sum(c["cost"] for c in charges) == expected_cost
    sent = await m.sim_requests("tts")
    assert {r["body"]["voice"] for r in sent} == {p.lower() for p in VOICE_PRESETS}
    assert all(r["body"]["response_format"] == "wav" for r in sent)
    async with aiohttp.ClientSession() as session, session.get(
            m.gateway.make_url("/v2/account/usage"), headers=headers) as r:
        totals = (await r.json())["totals"]
    assert totals["requests"] == 24 and totals["cost"]["micro_credits"] == expected_cost
    assert totals["characters"] == sum(c["characters"] for c in tts)


async def test_no_voice_is_a_random_preset(media: MediaFactory) -> None:
    m = await media()
    voices = set()
    for _ in range(12):
        status, got, wav = await m.post(TTS, {"text": "Hi."})
        assert status == 200 and got["X-Voice"] in VOICE_PRESETS
        voices.add(got["X-Voice"])
        assert_speech_wav(wav)
    assert len(voices) > 1


@pytest.mark.parametrize("sim", [{"sample_rate": 22050}, {"sample_rate": 16000}])
async def test_other_rates_are_converted_to_24_khz(media: MediaFactory, sim: dict[str, Any]
                                                   ) -> None:
    m = await media(sim_options={"tts": sim})
    text = "Converted on the way."
    status, _, wav = await m.post(TTS, {"text": text, "preset_voice": "Emma"})
    assert status == 200
    assert assert_speech_wav(wav) == pytest.approx(len(text) * 0.06, abs=0.01)
    pcm = read_wav(wav)
    assert max(abs(v) for v in memoryview(pcm.data).cast("h")) > 1000  # not silence


async def test_custom_voice_sample_is_fetched_and_sent(media: MediaFactory) -> None:
    m = await media()
    sample = wav_bytes(b"\x10\x20" * 24000, 24000)
    url = m.serve("/me.wav", sample)
    body = {"text": "In my own voice.", "custom_voice": {"url": url, "context_text": "hi"}}
    status, got, wav = await m.post(TTS, body)
    assert status == 200 and got["X-Voice"] == "custom"
    assert_speech_wav(wav)
    [sent] = await m.sim_requests("tts")
    assert sent["body"]["voice_sample"]["context_text"] == "hi"
    assert m.files.seen == ["/me.wav"]


async def test_custom_voice_at_an_internal_address_is_refused(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("basic", "acct-cv")
    for url in (f"http://127.0.0.1:{m.internal.port}/me.wav", m.serve("/page", b"<html>",
                                                                     "text/html")):
        status, _, raw = await m.post(TTS, {"text": "x", "custom_voice": {"url": url}},
                                      headers)
        assert status == 422
        [item] = orjson.loads(raw)["detail"]
        assert item["loc"] == ["body", "custom_voice", "url"]
        assert item["msg"].startswith("the audio could not be fetched from this URL")
    assert m.internal_seen == [] and await m.sim_requests("tts") == []
    assert [c["cost"] for c in await m.charges("acct-cv")] == [0, 0]  # holds released


LONG = "x" * 51


@pytest.mark.parametrize(("body", "loc", "kind"), [
    ({}, ["body", "text"], "missing"),
    ({"text": ""}, ["body", "text"], "string_too_short"),
    ({"text": LONG}, ["body", "text"], "string_too_long"),  # the policy's 50
    ({"text": "x" * 10_001}, ["body", "text"], "string_too_long"),  # the schema's 10,000
    ({"text": 5}, ["body", "text"], "string_type"),
    ({"text": "x", "preset_voice": "Bob"}, ["body", "preset_voice"], "literal_error"),
    ({"text": "x", "preset_voice": "alice"}, ["body", "preset_voice"], "literal_error"),
    ({"text": "x", "preset_voice": "Alice", "custom_voice": {"url": "https://a.example/v.wav"}},
     ["body", "custom_voice"], "value_error"),
    ({"text": "x", "custom_voice": {}}, ["body", "custom_voice", "url"], "missing"),
    ({"text": "x", "custom_voice": {"url": "https://a/v.wav", "x": 1}},
     ["body", "custom_voice", "x"], "extra_forbidden"),
    ({"text": "x", "mode": "fast"}, ["body", "mode"], "literal_error"),
    ({"text": "x", "async": "yes"}, ["body", "async"], "bool_type"),
    ({"text": "x", "voice": "alloy"}, ["body", "voice"], "extra_forbidden"),
])
async def test_every_bound_and_enum_is_422_and_reaches_nothing(
        media: MediaFactory, body: dict[str, Any], loc: list[str], kind: str) -> None:
    m = await media(requests_toml="[tts]\nmax_characters = 50\n")
    status, _, raw = await m.post(TTS, body, await m.key("basic", "acct-v"))
    assert status == 422, raw
    assert any(i["loc"] == loc and i["type"] == kind for i in orjson.loads(raw)["detail"]), raw
    assert await m.sim_requests("tts") == []
    assert await m.charges("acct-v") == []


@pytest.mark.parametrize(("body", "status"), [
    ({"text": "x", "model": "acme/nope"}, 404),
    ({"text": "x", "model": "acme/large-v3"}, 404),  # an ASR model
    ({"text": "x", "mode": "network"}, 404),  # no network pools yet
    ({"text": "x" * 50, "preset_voice": "Matt"}, 200),  # at the policy's bound
])
async def test_models_and_modes(media: MediaFactory, body: dict[str, Any],
                                      status: int) -> None:
    m = await media(requests_toml="[tts]\nmax_characters = 50\n")
    got, _, raw = await m.post(TTS, body)
    assert got == status, raw
    assert len(await m.sim_requests("tts")) == (status == 200)


async def test_a_failed_synthesis_is_free(media: MediaFactory) -> None:
    m = await media()
    headers = {**await m.key("basic", "acct-f"), "x-sim-status": "500"}
    status, _, raw = await m.post(TTS, {"text": "Hello.", "preset_voice": "Ella"}, headers)
    assert status == 502, raw
    [charge] = await m.charges("acct-f")
    assert charge["cost"] == 0 and charge["status"] != "completed"


async def test_not_json_and_too_large(media: MediaFactory) -> None:
    m = await media()
    async with aiohttp.ClientSession() as session:
        async with session.post(m.gateway.make_url(TTS), data=b"{",
                                headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        async with session.post(m.gateway.make_url(TTS), data=b"{" + b" " * 300_000 + b"}",
                                headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413
    assert await m.sim_requests("tts") == []




async def test_long_text_is_spoken_in_pieces_and_joined(media: MediaFactory) -> None:
    """A server that takes 100 characters at once (backends.toml max_input_chars) speaks a
    450-character text in pieces split between sentences; the client gets one WAV."""
    m = await media(tts_backend={"max_input_chars": 100})
    sentence = "The quick brown fox jumps over the lazy dog again. "  # 51 characters
    text = (sentence * 9).strip()
    status, _, wav = await m.post(TTS, {"text": text, "preset_voice": "Kevin"},
                                  await m.key("basic", "acct-long"))
    assert status == 200
    sent = [r["body"]["input"] for r in await m.sim_requests("tts")]
    assert len(sent) == 9 and all(len(piece) <= 100 for piece in sent)
    assert " ".join(sent) == text
    assert assert_speech_wav(wav) == pytest.approx(sum(len(p) for p in sent) * 0.06, abs=0.05)
    [charge] = await m.charges("acct-long")
    assert charge["characters"] == len(text)
