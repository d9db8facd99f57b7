"""POST /v2/audio/asr/engine through the gateway, in front of a REAL vLLM serving a tiny random
Whisper (serve-whisper.sh): the gateway fetches the audio from a loopback "audio host" (127.0.0.2,
allowed by `[fetch]`, as in tests/families), sends it to vLLM's /v1/audio/transcriptions (or
/translations) as multipart, and normalises vLLM's verbose_json. The text is random BPE pieces,
but the decoding, durations, segments, language handling and limits are vLLM's own."""

from __future__ import annotations

import asyncio
import itertools
import math
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from redis.asyncio import Redis

from proxy.appkeys import ROUTER
from proxy.credits.ledger import Ledger
from proxy.families.languages import LANGUAGES
from proxy.simulators.speech import VLLM_LANGUAGES
from proxy.store.redis_process import RedisProcess
from tests.support.asr_audio import encoded, wav, wav_of_size
from tests.support.config_files import toml_value
from tests.support.gateway import GatewayFactory
from tests.support.media_stack import AUDIO_HOST, Files, Media, audio_app, internal_app
from tests.support.real_engines import WHISPER_SERVED, Replica, whisper_backend
from tests.support.vllm_metrics import scrape

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

ASR = "/v2/audio/asr/engine"
PER_AUDIO_S = 7  # per second, charged per started millisecond: ceil(ms * 7 / 1000)
FETCH_MAX_BYTES = 25 * 1024 * 1024  # the shipped [fetch] max_bytes, and vLLM's 25 MB
MAX_AUDIO_S = 600  # the shipped [asr] max_audio_s, and vLLM's decode limit
PRICES = f"""
version = "real-asr-v1"
[models."{WHISPER_SERVED}"]
per_audio_second = {PER_AUDIO_S}
"""
UNFETCHABLE = "the audio could not be fetched from this URL"


def cost(audio_ms: int) -> int:
    return -(-audio_ms * PER_AUDIO_S // 1000)


async def audio_calls(replica: Replica) -> dict[str, float]:
    """vLLM's own count of the audio requests it answered, by route."""
    out: dict[str, float] = {}
    pattern = r'^http_requests_total\{handler="/v1/audio/(\w+)"[^}]*\} (\S+)$'
    for route, value in re.findall(pattern, await scrape(replica.url), re.M):
        out[route] = out.get(route, 0.0) + float(value)
    return out


@pytest.fixture
async def asr(whisper: Replica, gateway: GatewayFactory, aiohttp_server: Any,
              clean_redis: RedisProcess) -> AsyncIterator[Media]:
    """A gateway whose only ASR backend is the real Whisper replica (and its default model),
    the audio host it may fetch from, and an internal server it must never reach."""
    files = Files()
    audio = await aiohttp_server(audio_app(files), host=AUDIO_HOST)
    internal_seen: list[str] = []
    internal = await aiohttp_server(internal_app(internal_seen), host="127.0.0.1")
    fetch = {"allow_networks": [f"{AUDIO_HOST}/32"], "ports": [80, 443, audio.port]}
    requests_toml = (f'[asr]\ndefault_model = "{WHISPER_SERVED}"\n\n[fetch]\n'
                     + "".join(f"{k} = {toml_value(v)}\n" for k, v in fetch.items()))
    gw = await gateway(whisper_backend(whisper),
                       policies={"prices.toml": PRICES, "requests.toml": requests_toml})
    redis = Redis.from_url(clean_redis.url)
    try:
        yield Media(gw, {}, audio, files, internal, internal_seen, Ledger(redis), redis,
                    clean_redis.url)
    finally:
        await redis.aclose()


async def transcribe(m: Media, body: dict[str, Any], headers: dict[str, str]
                     ) -> dict[str, Any]:
    status, _, raw = await m.post(ASR, body, headers)
    assert status == 200, raw
    answer: dict[str, Any] = orjson.loads(raw)
    return answer


async def test_a_wav_is_transcribed_and_charged_per_second(asr: Media) -> None:
    m = asr
    headers = await m.key("max", "acct-wav")
    url = m.serve("/tone.wav", wav(3.0), "audio/x-wav")
    status, got, raw = await m.post(ASR, {"audio_url": url}, headers)
    assert status == 200, raw
    answer = orjson.loads(raw)
    assert set(answer) == {"text", "language", "duration"}
    assert answer["duration"] == 3.0 and answer["language"] == "en"  # vLLM's detection
    assert isinstance(answer["text"], str) and answer["text"] == answer["text"].strip() != ""
    assert got["X-Task-Id"].startswith("direct:") and got["X-Request-Id"]
    [charge] = await m.charges("acct-wav")
    assert (charge["audio_ms"], charge["cost"]) == (3000, cost(3000)) == (3000, 21)
    assert charge["held"] == cost(MAX_AUDIO_S * 1000)  # the policy's longest audio, until measured


async def test_segments_lie_within_the_audio(asr: Media, whisper: Replica) -> None:
    """3 s: vLLM's two segments; 45 s: two 30 s windows (vLLM restarts segment ids in each
    window; the gateway numbers them through)."""
    m = asr
    headers = await m.key("max", "acct-seg")
    for seconds in (3.0, 45.0):
        url = m.serve(f"/tone-{seconds:g}.wav", wav(seconds))
        answer = await transcribe(m, {"audio_url": url, "return_timestamps": True}, headers)
        assert set(answer) == {"text", "language", "duration", "segments"}
        segments = answer["segments"]
        assert answer["duration"] == seconds and segments
        assert [s["id"] for s in segments] == list(range(len(segments)))
        assert all(set(s) == {"id", "start", "end", "text"} for s in segments)
        assert all(0 <= s["start"] <= s["end"] <= seconds for s in segments), segments
        assert all(a["start"] <= b["start"] for a, b in itertools.pairwise(segments))
        assert " ".join(s["text"] for s in segments).split() == answer["text"].split()
        if seconds > 30:  # a segment from the second window
            assert segments[-1]["start"] > 25, segments
    assert [c["audio_ms"] for c in await m.charges("acct-seg")] == [3000, 45000]


async def test_words_are_estimated_over_the_segments(asr: Media) -> None:
    m = asr
    url = m.serve("/tone.wav", wav(3.0))
    answer = await transcribe(m, {"audio_url": url, "return_timestamps": "word"},
                              await m.key("max", "acct-words"))
    assert set(answer) == {"text", "language", "duration", "words", "words_estimated"}
    assert answer["words_estimated"] is True  # vLLM sends `"words": null`
    words = answer["words"]
    assert [w["word"] for w in words] == answer["text"].split()
    assert all(0 <= w["start"] <= w["end"] <= answer["duration"] for w in words)
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in itertools.pairwise(words))


async def test_translate_goes_to_vllms_translations_route(asr: Media, whisper: Replica
                                                          ) -> None:
    m = asr
    before = await audio_calls(whisper)
    url = m.serve("/tone.wav", wav(3.0))
    answer = await transcribe(m, {"audio_url": url, "task": "translate", "language": "de",
                                  "return_timestamps": True, "temperature": 0.0},
                              await m.key("max", "acct-tr"))
    assert answer["duration"] == 3.0 and answer["segments"]
    # The hint is not sent with a translation (Whisper translates into English), so vLLM
    # detects the language itself.
    assert answer["language"] == "en"
    after = await audio_calls(whisper)
    assert after.get("translations", 0) == before.get("translations", 0) + 1
    assert after.get("transcriptions", 0) == before.get("transcriptions", 0)


@pytest.mark.parametrize(("fmt", "longest"), [
    ("flac", 3.0), ("mp3", 3.0),
    # The longer of the two measures is charged. Ogg Opus as FFmpeg (PyAV) muxes it: the last
    # granule minus the pre-skip says 144,312 samples at 48 kHz (the gateway's reading, RFC
    # 7845), while decoders (vLLM's, PyAV's) give the 144,000 that were encoded.
    ("ogg", 144_312 / 48_000),
    ("m4a", 3.072),  # AAC's priming and padding: vLLM decodes 3.072 s (the gateway reads 3.064)
])
async def test_encoded_audio_is_decoded_by_vllm_and_charged_for_its_length(
        asr: Media, fmt: str, longest: float) -> None:
    m = asr
    headers = await m.key("max", f"acct-{fmt}")
    url = m.serve(f"/tone.{fmt}", encoded(fmt), "application/octet-stream")  # type ignored
    answer = await transcribe(m, {"audio_url": url}, headers)
    assert answer["language"] == "en" and answer["text"]
    assert answer["duration"] == round(longest, 3)
    [charge] = await m.charges(f"acct-{fmt}")
    assert charge["audio_ms"] == math.ceil(longest * 1000)
    assert charge["cost"] == cost(charge["audio_ms"])


async def test_a_44k_stereo_wav_is_resampled_by_vllm(asr: Media) -> None:
    m = asr
    url = m.serve("/stereo.wav", wav(3.0, rate=44100, channels=2, freq=300))
    answer = await transcribe(m, {"audio_url": url, "return_timestamps": True},
                              await m.key("max", "acct-st"))
    assert answer["duration"] == 3.0 and answer["language"] == "en" and answer["segments"]
    assert [(c["audio_ms"], c["cost"]) for c in await m.charges("acct-st")] == [(3000, 21)]


async def test_every_field_the_gateway_sends_is_accepted_by_vllm(asr: Media) -> None:
    """chunk_length_s and batch_size are not OpenAI's: vLLM takes them without complaint."""
    m = asr
    url = m.serve("/tone.wav", wav(2.0))
    body = {"audio_url": url, "task": "transcribe", "language": "en", "temperature": 1,
            "return_timestamps": "word", "chunk_length_s": 10, "batch_size": 4}
    answer = await transcribe(m, body, await m.key("max", "acct-all"))
    assert answer["duration"] == 2.0 and answer["language"] == "en" and answer["words"]


async def test_distinct_clips_keep_their_own_transcripts_under_concurrency(
        asr: Media, whisper: Replica) -> None:
    """Six tones at once through the gateway: each answer is the one vLLM gives that clip."""
    m = asr
    headers = await m.key("max", "acct-conc")
    clips = {f"/tone-{freq}.wav": wav(2.0, freq=freq) for freq in (200, 330, 440, 660, 880, 1200)}
    urls = [m.serve(path, data) for path, data in clips.items()]
    answers = await asyncio.gather(*(transcribe(m, {"audio_url": url, "language": "en"},
                                                headers) for url in urls))
    direct = [await vllm_text(whisper, data) for data in clips.values()]
    assert [a["text"] for a in answers] == direct
    assert len(set(direct)) > 1  # the clips are told apart (the model's text follows the audio)


async def vllm_text(replica: Replica, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("file", data, filename="a.wav")
    for name, value in (("response_format", "verbose_json"), ("language", "en")):
        form.add_field(name, value)
    async with aiohttp.ClientSession() as session, session.post(
            replica.url + "/v1/audio/transcriptions", data=form) as response:
        assert response.status == 200
        text: str = (await response.json())["text"]
        return text.strip()


async def test_languages(asr: Media, whisper: Replica) -> None:
    """The hint takes Whisper's ISO 639-1 codes; vLLM knows 57 of them natively and takes the
    other Whisper codes with a warning in its log: every code the gateway accepts is answered
    200 in that language. Anything else (Whisper's three-letter haw and yue, names, junk) is
    the gateway's 422 and never reaches vLLM."""
    m = asr
    headers = await m.key("max", "acct-lang")
    url = m.serve("/tone.wav", wav(1.0))
    before = await audio_calls(whisper)
    for language in ("haw", "yue", "xx", "english", "EN"):
        status, _, raw = await m.post(ASR, {"audio_url": url, "language": language}, headers)
        assert status == 422, raw
        [item] = orjson.loads(raw)["detail"]
        assert item["loc"] == ["body", "language"] and item["type"] == "string_pattern_mismatch"
    assert await audio_calls(whisper) == before and m.files.seen == []
    not_native = sorted(set(LANGUAGES) - set(VLLM_LANGUAGES))
    assert "sn" in not_native and "en" not in not_native
    answers = await asyncio.gather(*(transcribe(m, {"audio_url": url, "language": code},
                                                headers) for code in not_native))
    assert [a["language"] for a in answers] == not_native
    assert all(a["duration"] == 1.0 for a in answers)


async def test_the_25_mb_limit_is_the_gateways_and_matches_vllms(asr: Media,
                                                                  whisper: Replica) -> None:
    """[fetch] max_bytes (25 MB) and vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25 MB) agree:
    a file of exactly 25 MB is fetched and transcribed; one byte more is the gateway's one
    "cannot fetch" 422, free, and vLLM never sees it (its own 400 is never needed)."""
    m = asr
    headers = await m.key("max", "acct-25")
    limit = wav_of_size(FETCH_MAX_BYTES)  # 44.1 kHz stereo: 148.6 s
    seconds = (FETCH_MAX_BYTES - 44) / 4 / 44100
    before = await audio_calls(whisper)
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/over.wav", limit + b"\0\0\0\0")},
                                  headers)
    assert status == 422, raw
    [item] = orjson.loads(raw)["detail"]
    assert item["type"] == "url_unusable" and item["msg"].startswith(UNFETCHABLE)
    assert await audio_calls(whisper) == before
    answer = await transcribe(m, {"audio_url": m.serve("/limit.wav", limit)}, headers)
    assert answer["duration"] == round(seconds, 3)
    charges = await m.charges("acct-25")
    assert [(c.get("audio_ms", 0), c["cost"]) for c in charges] == [
        (0, 0), (math.ceil(seconds * 1000), cost(math.ceil(seconds * 1000)))]


async def test_audio_longer_than_600_s_is_the_gateways_422(asr: Media, whisper: Replica) -> None:
    """vLLM refuses more than 600 s of audio (VLLM_MAX_AUDIO_DECODE_DURATION_S) with a 400; the
    gateway's [asr] max_audio_s (600) refuses it first, from the file's header."""
    m = asr
    headers = await m.key("max", "acct-long")
    before = await audio_calls(whisper)
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/long.wav", wav(610.0, 8000))},
                                  headers)
    assert status == 422, raw
    assert orjson.loads(raw)["detail"][0]["type"] == "audio_too_long"
    assert await audio_calls(whisper) == before
    assert [c["cost"] for c in await m.charges("acct-long")] == [0]


async def test_audio_vllm_cannot_decode_is_its_400_relayed_free(asr: Media,
                                                                whisper: Replica) -> None:
    """A FLAC whose header is fine (the gateway measures 3 s from it) but whose frames are
    junk: vLLM's 400 reaches the client as the gateway's 400 with vLLM's message only (no
    backend name or address), nothing is charged, and the backend stays in rotation."""
    m = asr
    headers = await m.key("max", "acct-junk")
    flac = encoded("flac")
    junk = flac[:42] + bytes(range(256)) * 40  # fLaC, STREAMINFO (3 s), then noise
    status, got, raw = await m.post(ASR, {"audio_url": m.serve("/junk.flac", junk)}, headers)
    assert status == 400, raw
    body = orjson.loads(raw)
    assert body["error"]["message"] == body["detail"] == (
        "the model server rejected the request: Invalid or unsupported audio file.")
    for secret in (whisper.name, str(whisper.port), "127.0.0.1", WHISPER_SERVED):
        assert secret not in raw.decode() and secret not in str(dict(got))
    [charge] = await m.charges("acct-junk")
    assert charge["cost"] == 0 and charge["status"] != "completed"
    assert all(b.healthy and b.health.consecutive_failures == 0
               for b in m.gateway.app[ROUTER].backends)
    assert m.internal_seen == []


async def test_a_large_upload_raises_no_warning(asr: Media) -> None:
    m = asr
    url = m.serve("/tone-40.wav", wav(40.0))  # 1.28 MB
    answer = await transcribe(m, {"audio_url": url}, await m.key("max", "acct-big"))
    assert answer["duration"] == 40.0
