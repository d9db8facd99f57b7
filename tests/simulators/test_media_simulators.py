"""Media simulators: TTS (CSM behind OpenAI's facade), Whisper (vLLM + whisper.cpp wire
formats), image and video generation. Real loopback servers and real multipart uploads.

Whisper error bodies are compared with the raw captures of a real vLLM 0.32 Whisper server
(shared/real-engines/whisper-wire.md, served as `acme/whisper-tiny`), byte for byte.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import math
import os
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp.test_utils import TestClient

from proxy.media.audio import probe
from proxy.media.visual import probe_image, probe_video
from proxy.media.wav import read_wav, wav_bytes
from proxy.simulators import KINDS, MEDIA_KINDS, SimConfig, build_app, cli
from proxy.simulators.speech import CSM_PRESETS, embed_text, read_text, segments
from tests.support.encoded_media import AUDIO_FORMATS, audio_clip, read_audio

Json = dict[str, Any]
MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]
WHISPER = "acme/whisper-tiny"  # the captured server's name, so bodies compare exactly
CORRUPTED = ("Invalid or corrupted audio data. Ensure the input is a valid audio or video file "
             "(e.g. a complete WAV, MP3, or MP4).")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_client(aiohttp_client: Any) -> MakeClient:
    async def make(kind: str, models: tuple[str, ...] | None = None, **config: Any) -> Any:
        chosen = models or ((WHISPER,) if kind == "whisper" else (cli.DEFAULT_MODELS[kind],))
        return await aiohttp_client(build_app(kind, SimConfig(models=chosen, **config)))

    return make


def tone(seconds: float, rate: int = 16000, hz: float = 440.0) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    samples = np.round(np.sin(2 * np.pi * hz * t) * 12000).astype("<i2")
    return wav_bytes(samples.tobytes(), rate)


async def speak(client: Any, text: str, voice: str = "alloy",
                headers: dict[str, str] | None = None, **extra: Any) -> Any:
    body = {"model": "acme/csm-1b", "input": text, "voice": voice, "response_format": "wav",
            **extra}
    return await client.post("/v1/audio/speech", json=body, headers=headers)


async def speech_wav(client: Any, text: str, voice: str = "alloy", **extra: Any) -> bytes:
    resp = await speak(client, text, voice, **extra)
    assert resp.status == 200, await resp.text()
    return bytes(await resp.read())


def form(audio: bytes | None, fields: Sequence[tuple[str, str]] = (),
         filename: str = "a.wav") -> aiohttp.FormData:
    data = aiohttp.FormData()
    if audio is not None:
        # A file object, as aiohttp wants for large bodies (raw bytes over 1 MB warn).
        data.add_field("file", io.BytesIO(audio), filename=filename, content_type="audio/wav")
    for name, value in fields:
        data.add_field(name, value)
    return data


async def upload(client: Any, audio: bytes | None, *fields: tuple[str, str],
                 path: str = "/v1/audio/transcriptions", **kw: Any) -> Any:
    return await client.post(path, data=form(audio, fields), **kw)


def vllm_error(message: str, type_: str = "BadRequestError", param: str | None = None,
               code: int = 400) -> Json:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def openai_error(code: str | None, param: str | None) -> Any:
    class Matches:
        def __eq__(self, other: object) -> bool:
            error = other["error"] if isinstance(other, dict) else None
            return (isinstance(error, dict) and error.get("code") == code
                    and error.get("param") == param and isinstance(error.get("message"), str)
                    and error.get("type") == "invalid_request_error")

    return Matches()


def header_fields(wav: bytes) -> tuple[Any, ...]:
    return struct.unpack("<4sI4s4sIHHIIHH4sI", wav[:44])


def monotonic(values: Sequence[float]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(values))


# --- TTS ----------------------------------------------------------------------------------


async def test_tts_wav_header_is_canonical_and_sent_chunked(make_client: MakeClient) -> None:
    client = await make_client("tts")
    resp = await speak(client, "Hello there.")  # 12 characters: 0.72 s
    assert resp.status == 200 and resp.headers["Content-Type"] == "audio/wav"
    assert resp.headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in resp.headers
    wav = await resp.read()
    samples = round(0.72 * 24000)
    assert header_fields(wav) == (b"RIFF", 36 + 2 * samples, b"WAVE", b"fmt ", 16, 1, 1, 24000,
                                  48000, 2, 16, b"data", 2 * samples)
    assert len(wav) == 44 + 2 * samples
    pcm = read_wav(wav)
    assert (pcm.rate, pcm.channels, pcm.bits) == (24000, 1, 16)
    assert read_text(pcm.data) == "Hello there."
    # A voiced waveform: loud inside words, silent (watermark bits only) at the space.
    x = np.frombuffer(pcm.data, "<i2").astype(int)
    at = samples * 5 // 24  # the middle of "Hello" (characters 0-4) ...
    space = slice(samples * 5 // 12 + 100, samples * 6 // 12 - 100)  # ... and the space
    assert np.abs(x[at - 200 : at + 200]).max() > 3000 and np.abs(x[space]).max() <= 1


@pytest.mark.parametrize(("text", "speed", "seconds"), [
    ("a" * 50, 1.0, 3.0), ("a" * 50, 2.0, 1.5), ("a" * 50, 0.25, 12.0), ("Hi", 1.0, 0.3),
    ("Hi", 4.0, 0.3),
])
async def test_tts_duration_follows_text_and_speed(make_client: MakeClient, text: str,
                                                   speed: float, seconds: float) -> None:
    client = await make_client("tts")
    pcm = read_wav(await speech_wav(client, text, speed=speed))
    assert pcm.frames == round(seconds * 24000)


async def test_tts_is_deterministic_and_voices_differ(make_client: MakeClient) -> None:
    client = await make_client("tts")
    text = "The quick brown fox."
    first = await speech_wav(client, text, "alloy")
    assert first == await speech_wav(client, text, "alloy")
    outputs = {voice: await speech_wav(client, text, voice) for voice in ("alloy", "echo",
                                                                          *CSM_PRESETS)}
    assert len(set(outputs.values())) == len(outputs)
    assert await speech_wav(client, text, "alloy", speed=1.5) != first


async def test_tts_sample_rate_option_and_pcm(make_client: MakeClient) -> None:
    client = await make_client("tts", sample_rate=22050)
    wav = await speech_wav(client, "Piper speaks.")  # 13 characters: 0.78 s
    samples = round(0.78 * 22050)
    assert header_fields(wav)[7:9] == (22050, 44100) and header_fields(wav)[12] == 2 * samples
    resp = await speak(client, "Piper speaks.", response_format="pcm")
    assert resp.status == 200 and resp.headers["Content-Type"] == "audio/pcm;rate=22050"
    assert await resp.read() == wav[44:]
    default = await make_client("tts")
    resp = await speak(default, "Piper speaks.", response_format="pcm")
    assert resp.headers["Content-Type"] == "audio/pcm;rate=24000"
    assert len(await resp.read()) == 2 * round(0.78 * 24000)


async def test_tts_errors_use_openai_envelope(make_client: MakeClient) -> None:
    client = await make_client("tts", voices=("alloy", "emma"))
    cases: list[tuple[Json, int, Any]] = [
        ({"voice": "nova"}, 400, openai_error("invalid_value", "voice")),
        ({"input": "x" * 4097}, 400, openai_error("string_above_max_length", "input")),
        ({"input": ""}, 400, openai_error("empty_string", "input")),
        ({"response_format": None}, 400, openai_error("unsupported_value", "response_format")),
        ({"response_format": "mp3"}, 400, openai_error("unsupported_value", "response_format")),
        ({"response_format": "opus"}, 400, openai_error("unsupported_value", "response_format")),
        ({"response_format": "ogg"}, 400, openai_error("invalid_value", "response_format")),
        ({"speed": 5}, 400, openai_error("decimal_above_max_value", "speed")),
        ({"speed": 0.1}, 400, openai_error("decimal_below_min_value", "speed")),
        ({"input": None}, 400, openai_error("missing_required_parameter", "input")),
        ({"voice": 3}, 400, openai_error("invalid_type", "voice")),
        ({"stream_format": "sse"}, 400, openai_error("unsupported_value", "stream_format")),
        ({"model": "tts-1"}, 404, openai_error("model_not_found", None)),
    ]
    base = {"model": "acme/csm-1b", "input": "Hello.", "voice": "emma", "response_format": "wav"}
    for change, status, expected in cases:
        body = {k: v for k, v in {**base, **change}.items() if v is not None}
        resp = await client.post("/v1/audio/speech", json=body)
        assert resp.status == status, (change, await resp.text())
        assert await resp.json() == expected, (change, await resp.text())
    resp = await client.post("/v1/audio/speech", json={**base, "response_format": "mp3"})
    assert "not supported by this simulator" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/audio/speech", data=b"{nope")
    assert resp.status == 400 and (await resp.json())["error"]["param"] is None


async def test_tts_voice_sample_clones_a_speaker(make_client: MakeClient) -> None:
    client = await make_client("tts")
    text = "Cloned voices speak too."

    def sample(audio: bytes) -> Json:
        return {"audio": base64.b64encode(audio).decode(), "context_text": "A reference."}

    plain = await speech_wav(client, text)
    low = await speech_wav(client, text, voice_sample=sample(tone(1.0, hz=120)))
    high = await speech_wav(client, text, voice_sample=sample(tone(1.0, hz=240)))
    assert len({plain, low, high}) == 3
    assert read_wav(low).frames == read_wav(plain).frames and read_text(read_wav(low).data) == text
    for bad in ({"audio": "%%%", "context_text": ""}, sample(b"not a wav at all"),
                {"context_text": "no audio"}, {"audio": "", "context_text": 1}):
        resp = await speak(client, text, voice_sample=bad)
        assert resp.status == 400 and await resp.json() == openai_error("invalid_value",
                                                                        "voice_sample")
    resp = await speak(client, text, voice_sample="x")
    assert await resp.json() == openai_error("invalid_type", "voice_sample")


async def test_tts_faults_and_record(make_client: MakeClient) -> None:
    client = await make_client("tts")
    resp = await speak(client, "Hi.", headers={"x-sim-status": "503", "x-sim-retry-after": "2"})
    assert resp.status == 503 and resp.headers["Retry-After"] == "2"
    assert (await resp.json())["error"] == {"message": "simulated 503 Service Unavailable",
                                            "type": "server_error", "param": None, "code": None}
    started = time.monotonic()
    assert (await speak(client, "Hi.", headers={"x-sim-delay-ms": "150"})).status == 200
    assert time.monotonic() - started >= 0.15
    with pytest.raises(aiohttp.ClientConnectionError):
        await speak(client, "Hi.", headers={"x-sim-refuse": "1"})
    resp = await speak(client, "Hello there, a longer text.", headers={"x-sim-cut-after": "2"})
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    records = await (await client.get("/_sim/requests")).json()
    assert [r["outcome"] for r in records] == ["error", "completed", "cut", "cut"]
    assert records[0]["body"]["input"] == "Hi." and records[0]["path"] == "/v1/audio/speech"


# --- TTS -> Whisper round trip ------------------------------------------------------------


async def test_round_trip_every_preset(make_client: MakeClient) -> None:
    tts = await make_client("tts")
    asr = await make_client("whisper")
    for i, voice in enumerate(CSM_PRESETS):
        text = f"{voice.title()} says: line {i} of twelve, naïve café — 你好!"
        wav = await speech_wav(tts, text, voice, speed=0.75 + i / 8)
        body = await (await upload(asr, wav, ("model", WHISPER))).json()
        duration = read_wav(wav).duration_s
        assert body == {"text": text, "usage": {"type": "duration",
                                                "seconds": math.ceil(duration)}}


async def test_round_trip_verbose_json_timing(make_client: MakeClient) -> None:
    tts = await make_client("tts")
    asr = await make_client("whisper", word_timestamps=True)
    text = "First sentence here. Second one is a little longer! Third? " + "More words " * 70
    wav = await speech_wav(tts, text.strip(), "emma")
    duration = read_wav(wav).duration_s
    assert duration > 45
    resp = await upload(asr, wav, ("response_format", "verbose_json"),
                        ("timestamp_granularities[]", "word"),
                        ("timestamp_granularities[]", "segment"))
    body = await resp.json()
    assert list(body) == ["duration", "language", "text", "segments", "words"]
    assert abs(body["duration"] - duration) < 0.01 and body["language"] == "en"
    assert body["text"] == text.strip()
    segs = body["segments"]
    assert [s["text"] for s in segs][:3] == ["First sentence here.",
                                             "Second one is a little longer!", "Third?"]
    assert " ".join(s["text"] for s in segs) == body["text"]
    times = [t for s in segs for t in (s["start"], s["end"])]
    assert monotonic(times) and times[0] == 0 and times[-1] == body["duration"]
    assert all(s["end"] - s["start"] <= 30 for s in segs)
    # vLLM's 30 s windows: ids restart and seek names the window.
    assert [s["seek"] for s in segs] == sorted(s["seek"] for s in segs)
    assert {s["seek"] for s in segs} == {0, 30}
    second = [s for s in segs if s["seek"] == 30]
    assert second[0]["id"] == 0 and second[0]["start"] >= 29.9
    first = segs[0]
    assert list(first) == ["id", "avg_logprob", "compression_ratio", "end", "no_speech_prob",
                           "seek", "start", "temperature", "text", "tokens"]
    assert first["no_speech_prob"] is None and first["temperature"] == 0.0
    assert len(first["tokens"]) == 3 and first["avg_logprob"] < 0
    words = body["words"]
    assert [w["word"] for w in words[:4]] == ["First", "sentence", "here", "Second"]
    stamps = [t for w in words for t in (w["start"], w["end"])]
    assert monotonic(stamps) and stamps[0] >= 0 and stamps[-1] <= body["duration"]
    assert len(words) == len(text.split())


async def test_vllm_leaves_words_null_by_default(make_client: MakeClient) -> None:
    asr = await make_client("whisper")
    resp = await upload(asr, tone(3.0), ("response_format", "verbose_json"),
                        ("timestamp_granularities[]", "word"))
    body = await resp.json()
    assert body["words"] is None and body["duration"] == 3.0


async def test_unmarked_audio_gets_a_deterministic_pseudo_transcript(
    make_client: MakeClient,
) -> None:
    asr = await make_client("whisper")
    texts = []
    for audio in (tone(10.0), tone(10.0), tone(10.0, hz=300), tone(10.0, rate=44100)):
        body = await (await upload(asr, audio)).json()
        assert body["usage"] == {"type": "duration", "seconds": 10}
        texts.append(body["text"])
    assert texts[0] == texts[1] and len(set(texts[1:])) == 3
    assert all(len(text.split()) == 25 and text.endswith(".") for text in texts)
    body = await (await upload(asr, tone(0.1))).json()
    assert len(body["text"].split()) == 1 and body["usage"]["seconds"] == 1


def test_watermark_survives_and_truncates() -> None:
    silence = np.zeros(400, dtype=np.int16)
    marked = embed_text(silence, "x" * 100)  # 400 bits: room for 50 bytes, 40 of text
    assert read_text(marked.astype("<i2").tobytes()) == "x" * 40
    assert read_text(np.zeros(400, dtype="<i2").tobytes()) is None
    broken = marked.copy()
    broken[100] ^= 1
    assert read_text(broken.astype("<i2").tobytes()) is None
    segs = segments("One. Two three.", 1.5)
    assert [(s.start, s.end, s.text) for s in segs] == [(0.0, 0.4, "One."),
                                                        (0.4, 1.5, "Two three.")]


# --- Whisper: vLLM wire format --------------------------------------------------------------


async def test_whisper_vllm_errors_match_the_captures(make_client: MakeClient) -> None:
    asr = await make_client("whisper")
    wav = tone(3.0)
    langs = ("['af', 'ar', 'hy', 'az', 'be', 'bs', 'bg', 'ca', 'zh', 'hr', 'cs', 'da', 'nl', "
             "'en', 'et', 'fi', 'fr', 'gl', 'de', 'el', 'he', 'hi', 'hu', 'is', 'id', 'it', "
             "'ja', 'kn', 'kk', 'ko', 'lv', 'lt', 'mk', 'ms', 'mr', 'mi', 'ne', 'no', 'fa', "
             "'pl', 'pt', 'ro', 'ru', 'sr', 'sk', 'sl', 'es', 'sw', 'sv', 'tl', 'ta', 'th', "
             "'tr', 'uk', 'ur', 'vi', 'cy']")
    literal = ("2 validation errors:\n  {'type': 'literal_error', 'loc': 'body.response_format', "
               "'msg': \"Input should be 'json', 'text', 'srt', 'verbose_json' or 'vtt'\", "
               "'input': 'bogus', 'ctx': {'expected': \"'json', 'text', 'srt', 'verbose_json' "
               "or 'vtt'\"}}\n  {'type': 'literal_error', 'loc': 'body.response_format', "
               "'msg': \"Input should be 'diarized_json'\", 'input': 'bogus', 'ctx': "
               "{'expected': \"'diarized_json'\"}}")
    only = ("Currently only support response_format: `text`, `json`, `verbose_json` or "
            "`diarized_json`")
    cases: list[tuple[bytes | None, list[tuple[str, str]], int, Json]] = [
        (wav, [("model", "acme/nope")], 404, vllm_error(
            "The model `acme/nope` does not exist. Valid aliases: acme/whisper-tiny.",
            "NotFoundError", "model", 404)),
        (None, [("model", WHISPER)], 400, vllm_error(
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.file', 'msg': 'Field "
            "required', 'input': '<dict of 14 items>'}", "Bad Request", "body.file")),
        (None, [("file", "hello"), ("model", WHISPER)], 422, vllm_error(
            "Expected 'file' to be a file-like object, not 'str'.", "Unprocessable Entity",
            None, 422)),
        (b"", [], 400, vllm_error(CORRUPTED)),
        (b"this is not audio\n" * 20, [], 400, vllm_error(CORRUPTED)),
        (wav[:30], [], 400, vllm_error("Invalid or unsupported audio file.")),
        (wav, [("response_format", "srt")], 400, vllm_error(only)),
        (wav, [("response_format", "vtt")], 400, vllm_error(only)),
        (wav, [("response_format", "bogus")], 400, vllm_error(literal, "Bad Request",
                                                              "body.response_format")),
        (wav, [("language", "xx")], 400, vllm_error(
            f"Unsupported language: 'xx'.  Must be one of {langs}.")),
        (wav, [("language", "English")], 400, vllm_error(
            f"Unsupported language: 'English'.  Must be one of {langs}.")),
        (wav, [("temperature", "5")], 400, vllm_error(
            "temperature must be in [0, 2], got 5.0. (parameter=temperature, value=5.0)",
            param="temperature")),
        (wav, [("temperature", "-1")], 400, vllm_error(
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
            param="temperature")),
        (wav, [("temperature", "abc")], 400, vllm_error(
            "1 validation error:\n  {'type': 'float_parsing', 'loc': 'body.temperature', "
            "'msg': 'Input should be a valid number, unable to parse string as a number', "
            "'input': 'abc'}", "Bad Request", "body.temperature")),
        (wav, [("stream", "true"), ("response_format", "verbose_json")], 400, vllm_error(
            "verbose_json format doesn't support streaming case")),
        (wav, [("stream_include_usage", "true")], 400, vllm_error(
            "Stream options can only be defined when `stream=True`. (parameter="
            "stream_include_usage)", param="stream_include_usage")),
    ]
    for audio, fields, status, expected in cases:
        resp = await upload(asr, audio, *fields)
        assert resp.status == status, (fields, await resp.text())
        assert await resp.json() == expected, fields
    resp = await asr.post("/v1/audio/transcriptions", json={"model": WHISPER, "file": "abc"})
    assert await resp.json() == vllm_error(
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.file', 'msg': 'Field "
        "required', 'input': '<dict of 13 items>'}", "Bad Request", "body.file")
    resp = await asr.post("/v1/audio/transcriptions", data={"model": WHISPER, "file": "abc"})
    assert resp.status == 422
    assert (await upload(asr, wav, ("language", "haw"))).status == 200  # Whisper-only code
    resp = await upload(asr, wav, ("timestamp_granularities[]", "char"))
    # vLLM checks the list on its own, so pydantic's loc is the item's index alone.
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "body.0"
    # A translation has no timestamp_granularities[] to check.
    resp = await upload(asr, wav, ("timestamp_granularities[]", "char"),
                        path="/v1/audio/translations")
    assert resp.status == 200


async def test_whisper_size_and_duration_limits(make_client: MakeClient) -> None:
    asr = await make_client("whisper")
    big = wav_bytes(b"\0" * (26 * 1024 * 1024), 16000)  # the captured big-26MB.wav
    resp = await upload(asr, big)
    assert await resp.json() == vllm_error(
        "Maximum file size exceeded (parameter=audio_filesize_mb, value=26.000041961669922)",
        param="audio_filesize_mb")
    long = wav_bytes(b"\x80" * (610 * 8000), 8000, bits=8)  # tone-610s-8k-u8.wav
    resp = await upload(asr, long)
    assert await resp.json() == vllm_error(
        "Audio exceeds maximum allowed duration of 600s (file contains 610.0s at 8000Hz). Set "
        "VLLM_MAX_AUDIO_DECODE_DURATION_S to increase this limit.")
    records = await (await asr.get("/_sim/requests")).json()
    assert records[0]["body"] == {"file": {"filename": "a.wav", "content_type": "audio/wav",
                                           "size": len(big)}}


async def test_whisper_formats_translation_and_record(make_client: MakeClient) -> None:
    asr = await make_client("whisper")
    wav = tone(2.5)
    whole = await (await upload(asr, wav)).json()
    resp = await upload(asr, wav, ("response_format", "text"))  # vLLM answers JSON anyway
    assert resp.content_type == "application/json" and await resp.json() == whole
    resp = await upload(asr, wav, path="/v1/audio/translations")
    assert await resp.json() == {"text": whole["text"]}  # no usage on translations
    resp = await upload(asr, wav, ("response_format", "verbose_json"), ("language", "de"),
                        path="/v1/audio/translations")
    assert (await resp.json())["language"] == "de"
    resp = await upload(asr, wav, ("model", WHISPER), ("timestamp_granularities[]", "word"),
                        ("timestamp_granularities[]", "segment"), ("prompt", "hi"))
    assert resp.status == 200
    record = (await (await asr.get("/_sim/requests")).json())[-1]
    assert record["body"] == {
        "file": {"filename": "a.wav", "content_type": "audio/wav", "size": len(wav)},
        "model": WHISPER, "timestamp_granularities[]": ["word", "segment"], "prompt": "hi"}
    assert record["outcome"] == "completed"
    models = await (await asr.get("/v1/models")).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(WHISPER, 448)]
    assert (await asr.get("/v1/audio/transcriptions")).status == 405


async def test_whisper_stream_matches_vllm_chunks(make_client: MakeClient) -> None:
    tts = await make_client("tts")
    asr = await make_client("whisper")
    text = "Streams come a word at a time. " * 12  # 371 characters stripped: 22.26 s
    wav = await speech_wav(tts, text.strip())
    resp = await upload(asr, wav, ("stream", "true"), ("stream_include_usage", "true"),
                        headers={"X-Request-Id": "my-req-123"})
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]
    assert all(e["id"] == "transcribe-my-req-123" and e["object"] == "transcription.chunk"
               and e["model"] == WHISPER for e in events)
    content = "".join(c["delta"]["content"] for e in events for c in e["choices"])
    assert content == text.strip()
    assert events[-2]["choices"] == [{"delta": {"content": ""}, "finish_reason": "stop",
                                      "stop_reason": None}]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {
        # 4 decoder prompt tokens + 2226 audio frames; 84 words + 1 end-of-text
        "prompt_tokens": 4 + 2226, "total_tokens": 4 + 2226 + 85, "completion_tokens": 85}
    assert events[0]["choices"][0]["delta"] == {"content": "Streams"}
    assert "usage" not in events[0]
    # Over 30 s: a finish chunk per window; continuous usage counts up on every chunk.
    wav = await speech_wav(tts, (text * 2).strip())  # 44.58 s
    resp = await upload(asr, wav, ("stream", "true"), ("stream_include_usage", "true"),
                        ("stream_continuous_usage_stats", "true"))
    events = [orjson.loads(e[6:]) for e in (await resp.read()).split(b"\n\n")[:-2]]
    *chunks, final = events
    finishes = [i for i, e in enumerate(chunks) if e["choices"][0].get("finish_reason")]
    assert len(finishes) == 2 and finishes[-1] == len(chunks) - 1
    assert chunks[finishes[0] + 1]["choices"][0]["delta"]["content"].startswith(" ")
    assert [e["usage"]["completion_tokens"] for e in chunks] == list(range(1, len(chunks) + 1))
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(chunks)
    assert "".join(e["choices"][0]["delta"]["content"] for e in chunks) == (text * 2).strip()
    # Continuous usage without stream_include_usage adds nothing, as in vLLM.
    resp = await upload(asr, wav, ("stream", "true"), ("stream_continuous_usage_stats", "true"))
    events = [orjson.loads(e[6:]) for e in (await resp.read()).split(b"\n\n")[:-2]]
    assert events and all("usage" not in e and e["choices"] for e in events)


async def test_whisper_measures_other_containers(make_client: MakeClient) -> None:
    asr = await make_client("whisper")
    # FLAC: STREAMINFO says 48000 samples at 16 kHz (3 s); frames are never decoded.
    info = bytearray(34)
    info[10:13] = bytes([16000 >> 12, (16000 >> 4) & 0xFF, ((16000 & 0xF) << 4) | (0 << 1)])
    info[13] = 0x10  # 16 bits per sample, total samples' high bits 0
    info[14:18] = (48000).to_bytes(4, "big")
    flac = b"fLaC" + bytes([0x80, 0, 0, 34]) + bytes(info) + b"\xff\xf8" + bytes(200)
    # MP3: 115 MPEG-1 layer III frames, 128 kbps, 44.1 kHz: 3.004 s.
    mp3 = (b"\xff\xfb\x90\x00" + bytes(413)) * 115
    # Ogg with a codec nobody measures: the duration comes from the size at 128 kbps.
    body = b"\x80speex-ish" + bytes(40)
    page = (b"OggS\x00\x02" + bytes(8) + b"\x01\x00\x00\x00" + bytes(8) + bytes([1, len(body)])
            + body)
    ogg = page + bytes(16000 - len(page))
    for audio, seconds in ((flac, 3.0), (mp3, 115 * 1152 / 44100), (ogg, 1.0)):
        assert probe(audio).format in ("flac", "mp3", "ogg")
        resp = await upload(asr, audio, ("response_format", "verbose_json"))
        body_json = await resp.json()
        assert resp.status == 200 and body_json["duration"] == round(seconds, 3), audio[:4]
        assert (await (await upload(asr, audio)).json())["usage"]["seconds"] == math.ceil(seconds)


def vllm_seconds(audio: bytes, fmt: str) -> float:
    """vLLM 0.32's reading of an upload: libsndfile decodes WAV, FLAC, Ogg and MP3 whole (then
    resamples, flushed); PyAV decodes the rest, resampling each frame to 16 kHz without a
    final flush (vllm/multimodal/media/audio.py, load_audio_pyav)."""
    if fmt not in ("m4a", "webm"):
        return read_audio(audio).decoded_s
    import av  # the test extras'

    with av.open(io.BytesIO(audio)) as file:
        stream = file.streams.audio[0]
        resampler = (av.AudioResampler(format="fltp", layout="mono", rate=16000)
                     if stream.rate != 16000 else None)
        samples = 0
        for frame in file.decode(stream):
            for out in resampler.resample(frame) if resampler else [frame]:
                samples += out.samples
    return samples / 16000


@pytest.mark.parametrize("fmt", list(AUDIO_FORMATS))
async def test_whisper_real_clips(make_client: MakeClient, fmt: str) -> None:
    """What real encoders write (FFmpeg's, through PyAV): the 3 s tone in every format, its
    duration what vLLM finds (see vllm_seconds)."""
    audio = audio_clip(fmt).data
    asr = await make_client("whisper")
    body = await (await upload(asr, audio, ("response_format", "verbose_json"))).json()
    decoded = vllm_seconds(audio, fmt)
    assert body["duration"] == pytest.approx(decoded, abs=0.001)
    usage = (await (await upload(asr, audio)).json())["usage"]
    assert usage == {"type": "duration", "seconds": math.ceil(decoded)}


async def test_whisper_faults(make_client: MakeClient) -> None:
    asr = await make_client("whisper")
    resp = await upload(asr, tone(1.0), headers={"x-sim-status": "503"})
    assert await resp.json() == vllm_error("simulated 503 Service Unavailable",
                                           "Service Unavailable", None, 503)
    resp = await upload(asr, tone(1.0), path="/inference", headers={"x-sim-status": "500"})
    assert resp.status == 500
    assert await resp.json() == {"error": "simulated 500 Internal Server Error"}
    with pytest.raises(aiohttp.ClientConnectionError):
        await upload(asr, tone(1.0), headers={"x-sim-refuse": "1"})
    started = time.monotonic()
    assert (await upload(asr, tone(1.0), headers={"x-sim-delay-ms": "120"})).status == 200
    assert time.monotonic() - started >= 0.12
    outcomes = [r["outcome"] for r in await (await asr.get("/_sim/requests")).json()]
    assert outcomes == ["error", "error", "cut", "completed"]


# --- Whisper: whisper.cpp /inference ------------------------------------------------------


async def test_whisper_cpp_inference(make_client: MakeClient) -> None:
    tts = await make_client("tts")
    asr = await make_client("whisper")
    text = "Hello from whisper dot cpp. It answers in its own way."
    wav = await speech_wav(tts, text)
    duration = round(read_wav(wav).duration_s, 3)
    assert await (await upload(asr, wav, path="/inference")).json() == {"text": " " + text}
    resp = await upload(asr, wav, ("response_format", "verbose_json"), path="/inference")
    body = await resp.json()
    assert list(body) == ["task", "language", "duration", "text", "segments"]
    assert (body["task"], body["language"], body["duration"]) == ("transcribe", "english",
                                                                  duration)
    segs = body["segments"]
    assert [s["id"] for s in segs] == [0, 1]
    assert [s["text"] for s in segs] == [" Hello from whisper dot cpp.",
                                         " It answers in its own way."]
    assert list(segs[0]) == ["id", "text", "start", "end", "tokens", "words", "temperature",
                             "avg_logprob", "no_speech_prob"]
    words = [w for s in segs for w in s["words"]]
    assert words[0]["word"] == " Hello" and set(words[0]) == {"word", "start", "end", "t_dtw",
                                                              "probability"}
    stamps = [t for w in words for t in (w["start"], w["end"])]
    assert monotonic(stamps) and stamps[0] >= 0 and stamps[-1] <= duration
    for fields, language in (((("language", "de"),), "german"),
                             ((("language", "auto"),), "english"),
                             ((("language", "french"),), "french")):
        resp = await upload(asr, wav, ("response_format", "verbose_json"), *fields,
                            path="/inference")
        assert (await resp.json())["language"] == language
    resp = await upload(asr, wav, ("response_format", "verbose_json"), ("translate", "true"),
                        ("no_timestamps", "true"), path="/inference")
    body = await resp.json()
    assert body["task"] == "translate" and "start" not in body["segments"][0]
    resp = await upload(asr, wav, ("response_format", "text"), path="/inference")
    assert resp.headers["Content-Type"] == "text/html; charset=utf-8"
    assert await resp.text() == " " + text + "\n"
    resp = await upload(asr, wav, ("response_format", "srt"), path="/inference")
    assert resp.content_type == "application/x-subrip"
    assert (await resp.text()).startswith("1\n00:00:00,000 --> 00:00:01,620\n Hello from")
    resp = await upload(asr, wav, ("response_format", "vtt"), path="/inference")
    assert (await resp.text()).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.620\n Hello")


@pytest.mark.parametrize(("flag", "status"), [(False, 400), (True, 200)])
async def test_whisper_cpp_errors(make_client: MakeClient, flag: bool, status: int) -> None:
    asr = await make_client("whisper", whisper_cpp_errors_200=flag)
    m4a = b"\0\0\0\x18ftypM4A \0\0\0\0M4A mp42" + bytes(100)
    cases = [
        (None, (), "no 'file' field in the request"),
        (b"not audio" * 10, (), "failed to read audio data"),
        (b"", (), "failed to read audio data"),
        (m4a, (), "failed to read audio data"),  # needs --convert (ffmpeg)
        (tone(1.0), (("language", "xx"),), "unknown language 'xx'"),
    ]
    for audio, fields, message in cases:
        resp = await upload(asr, audio, *fields, path="/inference")
        assert resp.status == status and await resp.json() == {"error": message}
    resp = await upload(asr, tone(1.0), ("temperature", "hot"), path="/inference")
    assert resp.status == 500 and await resp.read() == b""


async def test_whisper_cpp_serves_one_request_at_a_time(make_client: MakeClient) -> None:
    asr = await make_client("whisper", ttft_ms=150)
    wav = tone(1.0)

    async def timed(path: str) -> float:
        started = time.monotonic()
        results = await asyncio.gather(*(upload(asr, wav, path=path) for _ in range(3)))
        assert all(r.status == 200 for r in results)
        return time.monotonic() - started

    assert await timed("/inference") >= 0.45
    assert await timed("/v1/audio/transcriptions") < 0.4


# --- image and video ----------------------------------------------------------------------


async def test_image_generations(make_client: MakeClient) -> None:
    client = await make_client("image")
    resp = await client.post("/v1/images/generations", json={
        "model": "acme/image-gen", "prompt": "a red fox", "n": 3, "size": "256x256"})
    assert resp.status == 200
    body = await resp.json()
    assert list(body) == ["created", "data"] and abs(body["created"] - time.time()) < 5
    pngs = [base64.b64decode(item["b64_json"]) for item in body["data"]]
    assert [item["revised_prompt"] for item in body["data"]] == ["a red fox"] * 3
    assert len(set(pngs)) == 3
    for png in pngs:
        info = probe_image(png)
        assert (info.format, info.width, info.height) == ("png", 128, 128)
    again = await (await client.post("/v1/images/generations", json={
        "prompt": "a red fox", "n": 1, "size": "256x256"})).json()
    assert again["data"][0]["b64_json"] == body["data"][0]["b64_json"]
    seeded = await (await client.post("/v1/images/generations", json={
        "prompt": "a red fox", "seed": 7, "size": "256x256"})).json()
    assert seeded["data"][0]["b64_json"] != body["data"][0]["b64_json"]


async def test_image_errors(make_client: MakeClient) -> None:
    client = await make_client("image")
    cases: list[tuple[Json, int, Any]] = [
        ({}, 400, openai_error("missing_required_parameter", "prompt")),
        ({"prompt": "x" * 4001}, 400, openai_error("string_above_max_length", "prompt")),
        ({"prompt": "x", "n": 11}, 400, openai_error("integer_above_max_value", "n")),
        ({"prompt": "x", "n": 0}, 400, openai_error("integer_below_min_value", "n")),
        ({"prompt": "x", "size": "300x300"}, 400, openai_error("invalid_value", "size")),
        ({"prompt": "x", "response_format": "url"}, 400,
         openai_error("unsupported_value", "response_format")),
        ({"prompt": "x", "model": "dall-e-3"}, 404, openai_error("model_not_found", None)),
    ]
    for body, status, expected in cases:
        resp = await client.post("/v1/images/generations", json=body)
        assert resp.status == status and await resp.json() == expected, body
    resp = await client.post("/v1/images/generations", json={"prompt": "x"},
                             headers={"x-sim-status": "429"})
    assert resp.status == 429 and (await resp.json())["error"]["code"] == "rate_limit_exceeded"


async def test_video_generations(make_client: MakeClient) -> None:
    client = await make_client("video")
    for seconds, fps, size, frames in ((2, 8, "32x24", 16), (1.5, 4, None, 6)):
        body: Json = {"model": "acme/video-gen", "prompt": "waves", "seconds": seconds,
                      "fps": fps}
        if size:
            body["size"] = size
        resp = await client.post("/v1/videos/generations", json=body)
        assert resp.status == 200 and resp.content_type == "video/x-msvideo"
        assert resp.headers["X-Video-Duration"] == f"{seconds:g}"
        video = await resp.read()
        info = probe_video(video)
        assert info.format == "avi" and info.duration_s == pytest.approx(seconds)
        width, height = (32, 24) if size else (64, 64)
        assert len(video) > frames * width * height * 3
    first = await (await client.post("/v1/videos/generations", json={"prompt": "a"})).read()
    assert first == await (await client.post("/v1/videos/generations", json={"prompt": "a"})).read()
    assert probe_video(first).duration_s == pytest.approx(2.0)


async def test_video_errors_and_faults(make_client: MakeClient) -> None:
    client = await make_client("video")
    cases: list[tuple[Json, int, Any]] = [
        ({}, 400, openai_error("missing_required_parameter", "prompt")),
        ({"prompt": "x", "seconds": 25}, 400, openai_error("decimal_above_max_value", "seconds")),
        ({"prompt": "x", "fps": 0}, 400, openai_error("integer_below_min_value", "fps")),
        ({"prompt": "x", "fps": 2.5}, 400, openai_error("invalid_type", "fps")),
        ({"prompt": "x", "size": "512x512"}, 400, openai_error("invalid_value", "size")),
        ({"prompt": "x", "size": "big"}, 400, openai_error("invalid_value", "size")),
        ({"prompt": "x", "model": "sora"}, 404, openai_error("model_not_found", None)),
    ]
    for body, status, expected in cases:
        resp = await client.post("/v1/videos/generations", json=body)
        assert resp.status == status and await resp.json() == expected, body
    started = time.monotonic()
    resp = await client.post("/v1/videos/generations", json={"prompt": "x"},
                             headers={"x-sim-delay-ms": "100"})
    assert resp.status == 200 and time.monotonic() - started >= 0.1
    with pytest.raises(aiohttp.ClientConnectionError):
        await client.post("/v1/videos/generations", json={"prompt": "x"},
                          headers={"x-sim-refuse": "1"})


# --- every media kind -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", MEDIA_KINDS)
async def test_health_models_and_startup_delay(make_client: MakeClient, kind: str) -> None:
    started = time.monotonic()
    client = await make_client(kind, startup_delay_s=0.1)
    assert time.monotonic() - started >= 0.1
    resp = await client.get("/health")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [WHISPER if kind == "whisper"
                                                 else cli.DEFAULT_MODELS[kind]]
    await client.post("/_sim/health", json={"healthy": False})
    assert (await client.get("/health")).status == 503


def test_cli_media_options() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["tts", "--voice", "alloy", "--voice", "emma", "--sample-rate",
                              "22050"])
    assert cli.config_from(args) == SimConfig(models=("acme/csm-1b",), voices=("alloy", "emma"),
                                              sample_rate=22050)
    args = parser.parse_args(["whisper", "--word-timestamps", "--whisper-cpp-errors-200"])
    assert cli.config_from(args) == SimConfig(models=("acme/whisper-large-v3",),
                                              word_timestamps=True, whisper_cpp_errors_200=True)
    assert cli.DEFAULT_PORTS == {"tgi": 3000, "vllm": 8000, "tts": 8880, "whisper": 8178,
                                 "image": 8188, "video": 8189, "tei": 3001}
    args = parser.parse_args(["tei", "--embedding-size", "256", "--max-input-length", "128",
                              "--max-client-batch-size", "4"])
    assert cli.config_from(args) == SimConfig(models=("acme/embed-small",), embedding_size=256,
                                              max_input_length=128, max_client_batch_size=4)
    args = parser.parse_args(["vllm", "--runner", "pooling"])
    assert cli.config_from(args).runner == "pooling"
    assert set(KINDS) == set(cli.DEFAULT_PORTS)


async def test_cli_starts_a_tts_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "simulate", "tts", "--port", str(port), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                        assert resp.status == 200 and await resp.json() == {"status": "ok"}
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("the tts simulator never answered /health")
            async with session.post(f"http://127.0.0.1:{port}/v1/audio/speech", json={
                "model": "acme/csm-1b", "input": "Hi.", "voice": "ella",
                "response_format": "wav"}) as resp:
                assert read_text(read_wav(await resp.read()).data) == "Hi."
    finally:
        proc.terminate()
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=10)
    assert f"simulating tts on http://127.0.0.1:{port} serving acme/csm-1b" in out.decode()
