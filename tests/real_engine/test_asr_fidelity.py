"""Whisper simulator fidelity: the same multipart requests to `simulate whisper` and to a real
vLLM serving Whisper, compared as a client (the gateway) sees them. Transcripts differ by nature
(random BPE pieces against placeholder words), and so do the number of segments and stream
events; everything else must match: statuses, content types, error bodies word for word, the
JSON shape, `usage.seconds`, `duration`, `language`, `words: null`, SSE framing and the usage
chunk. A case marked `xfail(strict=True)` is a difference found here and not fixed yet: it
fails the run once the simulator matches, so the mark goes with the fix."""

from __future__ import annotations

import asyncio
import functools
import io
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from tests.support.asr_audio import encoded, silence, wav
from tests.support.fidelity import events, shape
from tests.support.real_engines import WHISPER_SERVED, Replica
from tests.support.upstreams import SimulatorFactory

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

Fields = tuple[tuple[str, str], ...]
VERBOSE: Fields = (("response_format", "verbose_json"),)


def differs(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"simulator differs: {reason}")


@functools.cache
def clip(name: str) -> bytes:
    """The test clips, made once per run."""
    if name == "26mb":  # over vLLM's 25 MB (VLLM_MAX_AUDIO_CLIP_FILESIZE_MB)
        return silence(26 * 1024 * 1024)
    if name in ("flac", "mp3", "ogg", "m4a", "webm"):
        return encoded(name)
    return {
        "3s": lambda: wav(3.0),
        "0.1s": lambda: wav(0.1),
        "45s": lambda: wav(45.0, freq=220),  # two 30 s windows
        "stereo": lambda: wav(3.0, rate=44100, channels=2, freq=300),
        "610s": lambda: wav(610.0, rate=8000),  # over VLLM_MAX_AUDIO_DECODE_DURATION_S (600)
        "empty": lambda: b"",
        "text": lambda: b"this is not audio\n" * 10,
        "truncated": lambda: wav(3.0)[:30],  # a WAV header and no data
    }[name]()


async def post(base: str, route: str, fields: Fields, file: str | None,
               headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    form = aiohttp.FormData()
    for name, value in fields:
        form.add_field(name, value)
    if file is not None:
        # A stream, not bytes: aiohttp warns about (so here refuses) raw bodies over 1 MiB.
        form.add_field("file", io.BytesIO(clip(file)), filename="audio.wav",
                       content_type="audio/wav")
    async with aiohttp.ClientSession() as session, session.post(
            f"{base}/v1/audio/{route}", data=form, headers=headers or {}) as response:
        return response.status, response.headers.get("Content-Type", ""), await response.read()


@pytest.fixture
async def pair(whisper: Replica, simulator: SimulatorFactory) -> tuple[str, str]:
    sim: TestServer = await simulator("whisper", models=(WHISPER_SERVED,))
    return whisper.url, str(sim.make_url("")).rstrip("/")


async def both(pair: tuple[str, str], route: str, fields: Fields, file: str | None,
               headers: dict[str, str] | None = None
               ) -> tuple[tuple[int, str, bytes], tuple[int, str, bytes]]:
    real, sim = pair
    got = await asyncio.gather(post(real, route, fields, file, headers),
                               post(sim, route, fields, file, headers))
    return got[0], got[1]


@pytest.mark.parametrize(("route", "fields", "file", "status"), [
    ("transcriptions", (("model", "acme/nope"),), "3s", 404),
    ("transcriptions", (("model", WHISPER_SERVED),), None, 400),
    ("transcriptions", (("file", "abc"),), None, 422),
    ("transcriptions", (), "empty", 400),
    ("transcriptions", (), "text", 400),
    ("transcriptions", (), "truncated", 400),
    ("transcriptions", (), "26mb", 400),
    ("transcriptions", (), "610s", 400),
    ("transcriptions", (("response_format", "srt"),), "3s", 400),
    ("transcriptions", (("response_format", "vtt"),), "3s", 400),
    ("transcriptions", (("response_format", "bogus"),), "3s", 400),
    ("transcriptions", (*VERBOSE, ("stream", "true")), "3s", 400),
    ("transcriptions", (("stream_include_usage", "true"),), "3s", 400),
    ("transcriptions", (("language", "xx"),), "3s", 400),
    ("transcriptions", (("language", "English"),), "3s", 400),
    ("translations", (("language", "xx"),), "3s", 400),
    ("transcriptions", (("temperature", "5"),), "3s", 400),
    ("transcriptions", (("temperature", "-1"),), "3s", 400),
    ("transcriptions", (("temperature", "abc"),), "3s", 400),
    ("transcriptions", (*VERBOSE, ("timestamp_granularities[]", "words")), "3s", 400),
])
async def test_errors_match(pair: tuple[str, str], route: str, fields: Fields,
                            file: str | None, status: int) -> None:
    (real_status, real_type, real), (sim_status, sim_type, sim) = await both(
        pair, route, fields, file)
    assert (real_status, sim_status) == (status, status), (real[:300], sim[:300])
    assert real_type == sim_type == "application/json"
    assert orjson.loads(sim) == orjson.loads(real)  # the whole body, message text included


@pytest.mark.parametrize(("route", "fields", "file"), [
    ("transcriptions", (("model", WHISPER_SERVED), ("language", "en")), "3s"),
    ("transcriptions", (), "3s"),  # no model, no language: vLLM detects it
    ("transcriptions", (("response_format", "text"),), "3s"),  # vLLM answers JSON here too
    ("transcriptions", (*VERBOSE, ("language", "en")), "3s"),
    ("transcriptions", (*VERBOSE, ("timestamp_granularities[]", "segment"),
                        ("timestamp_granularities[]", "word")), "3s"),  # words stay null
    ("translations", (), "3s"),  # no usage
    ("translations", (*VERBOSE, ("language", "de")), "3s"),
    ("transcriptions", (), "0.1s"),  # usage.seconds is a ceiling: 1
    ("transcriptions", VERBOSE, "stereo"),
    ("transcriptions", (), "flac"),
    ("transcriptions", VERBOSE, "flac"),
    ("transcriptions", (), "mp3"),
    ("transcriptions", VERBOSE, "mp3"),
    ("transcriptions", (), "ogg"),  # Ogg Opus: decoded 3.000 s (the last granule says 3.0065)
    ("transcriptions", VERBOSE, "ogg"),
    ("transcriptions", (), "webm"),  # WebM Opus: decoded 3.000 s (Duration says 3.008)
    ("transcriptions", VERBOSE, "webm"),
    ("transcriptions", (), "m4a"),  # AAC priming: 3.07 s, so 4 seconds in both
    ("transcriptions", VERBOSE, "m4a"),  # 48 whole AAC frames decoded: 3.072 s (mvhd 3.064)
    ("transcriptions", VERBOSE, "45s"),
    ("transcriptions", (), "45s"),
    ("transcriptions", (*VERBOSE, ("chunk_length_s", "10"), ("batch_size", "4"),
                        ("temperature", "1.0")), "3s"),  # unknown fields pass
    ("transcriptions", (("language", "haw"),), "3s"),  # Whisper-only codes: 200 (a warning)
    ("transcriptions", (*VERBOSE, ("language", "sn")), "3s"),
    ("transcriptions", (("max_completion_tokens", "1000"),), "3s"),  # over 448: clamped
])
async def test_answers_have_the_same_shape_and_measures(
        pair: tuple[str, str], route: str, fields: Fields, file: str) -> None:
    (real_status, real_type, real_raw), (sim_status, sim_type, sim_raw) = await both(
        pair, route, fields, file)
    assert real_status == sim_status == 200, (real_raw[:300], sim_raw[:300])
    assert real_type == sim_type == "application/json"
    real, sim = orjson.loads(real_raw), orjson.loads(sim_raw)
    assert shape(sim) == shape(real)
    for key in ("usage", "duration", "language", "words"):
        assert sim.get(key) == real.get(key), key
    if "segments" in real:
        for answer in (real, sim):  # ids restart at 0 in each 30 s window, `seek` its start
            windows = sorted({s["seek"] for s in answer["segments"]})
            assert len(windows) == (2 if real["duration"] > 30 else 1)
            for seek in windows:
                ids = [s["id"] for s in answer["segments"] if s["seek"] == seek]
                assert ids == list(range(len(ids)))
                assert all(seek <= s["start"] <= s["end"] <= answer["duration"]
                           for s in answer["segments"] if s["seek"] == seek)


STREAM: Fields = (("stream", "true"),)
USAGE: Fields = (("stream_include_usage", "true"),)
CONTINUOUS: Fields = (("stream_continuous_usage_stats", "true"),)


@pytest.mark.parametrize(("route", "fields", "file"), [
    ("transcriptions", STREAM, "3s"),
    ("transcriptions", STREAM + USAGE, "3s"),
    ("transcriptions", STREAM + USAGE + CONTINUOUS, "3s"),
    ("transcriptions", STREAM + CONTINUOUS, "3s"),  # without include_usage: no usage at all
    ("transcriptions", STREAM + USAGE, "45s"),  # a finish chunk per 30 s window
    ("translations", STREAM + USAGE, "3s"),  # translation.chunk, translate-<id>
])
async def test_streams_have_the_same_framing_and_usage(
        pair: tuple[str, str], route: str, fields: Fields, file: str) -> None:
    (real_status, real_type, real_raw), (sim_status, sim_type, sim_raw) = await both(
        pair, route, (("language", "en"), *fields), file, {"X-Request-Id": "fidelity-1"})
    assert real_status == sim_status == 200
    assert real_type == sim_type == "text/event-stream; charset=utf-8"
    real_events, sim_events = events(real_raw), events(sim_raw)
    assert real_events[-1] == sim_events[-1] == b"[DONE]"
    real_chunks = [orjson.loads(e) for e in real_events[:-1]]
    sim_chunks = [orjson.loads(e) for e in sim_events[:-1]]
    prefix, kind = ("translate", "translation") if route == "translations" else \
        ("transcribe", "transcription")
    for chunks in (real_chunks, sim_chunks):  # the id is the request's X-Request-Id
        assert {c["id"] for c in chunks} == {f"{prefix}-fidelity-1"}
        assert {c["object"] for c in chunks} == {f"{kind}.chunk"}
    assert {orjson.dumps(shape(c)) for c in sim_chunks} == \
        {orjson.dumps(shape(c)) for c in real_chunks}

    def finishes(chunks: list[dict[str, Any]]) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and "finish_reason" in c["choices"][0]]

    assert finishes(sim_chunks) == finishes(real_chunks) == \
        ["stop"] * (2 if file == "45s" else 1)
    real_usage = [c["usage"] for c in real_chunks if "usage" in c]
    sim_usage = [c["usage"] for c in sim_chunks if "usage" in c]
    assert bool(sim_usage) == bool(real_usage)
    if real_usage:  # the decoder prompt (4) and 10 ms audio frames: the same in both
        assert sim_usage[-1]["prompt_tokens"] == real_usage[-1]["prompt_tokens"]
        assert (len(sim_usage) > 1) == (len(real_usage) > 1)  # continuous, or the last only


async def test_models_and_version_are_the_same(pair: tuple[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        answers = []
        for base in pair:
            async with session.get(base + "/v1/models") as models, \
                    session.get(base + "/version") as version, \
                    session.get(base + "/health") as health:
                answers.append((models.status, await models.json(), await version.json(),
                                health.status))
    (real_status, real, real_version, real_health), (sim_status, sim, sim_version,
                                                     sim_health) = answers
    assert real_status == sim_status == 200 and real_health == sim_health == 200
    assert shape(sim) == shape(real)
    pick = ("id", "object", "owned_by", "parent", "max_model_len")
    assert [{k: m[k] for k in pick} for m in sim["data"]] == \
        [{k: m[k] for k in pick} for m in real["data"]] == [
            {"id": WHISPER_SERVED, "object": "model", "owned_by": "vllm", "parent": None,
             "max_model_len": 448}]
    assert sim_version == real_version


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/audio/transcriptions", 405),  # FastAPI's {"detail":...}, Allow: POST
    ("POST", "/v1/chat/completions", 404),  # a route a Whisper server lacks
])
async def test_routes_it_does_not_serve(pair: tuple[str, str], method: str, path: str,
                                        status: int) -> None:
    async with aiohttp.ClientSession() as session:
        got = []
        for base in pair:
            async with session.request(method, base + path,
                                       json={} if method == "POST" else None) as response:
                got.append((response.status, response.headers.get("Content-Type"),
                            response.headers.get("Allow"), await response.read()))
    real, sim = got
    assert real[0] == sim[0] == status and real[2] == sim[2]
    assert sim[1:] == real[1:]
