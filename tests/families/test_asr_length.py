"""Issue 30 #6: ASR audio is measured by what it carries, not by what its header claims. An MP3
whose Xing header claims one frame but carries hundreds, a FLAC whose STREAMINFO says "length
unknown" (0) or one sample: over the limit they are refused before any server is called; within
it they are charged their real length, whatever the server (the simulator trusts the headers)
reports."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.asr_audio import encoded
from tests.support.media_builders import MP3_HEADER, mp3_xing
from tests.support.media_stack import ASR_MODEL, PER_AUDIO_S, MediaFactory

ASR = "/v2/audio/asr/engine"
LIMIT = "[asr]\nmax_audio_s = 20\n"
FRAME_S = 1152 / 48000  # the builders' MP3 frames: MPEG-1 Layer III, 48 kHz


def lying_mp3(frames: int) -> bytes:
    """A Xing header that claims one frame, then `frames` audio frames."""
    return mp3_xing(1)[:384] + (MP3_HEADER + bytes(380)) * frames


def lying_flac(seconds: float, total: int) -> bytes:
    """A real FLAC of `seconds`, its STREAMINFO's total samples rewritten as `total`."""
    data = bytearray(encoded("flac", seconds))
    info = 8  # after "fLaC" and the block header
    data[info + 13] = (data[info + 13] & 0xF0) | (total >> 32) & 0x0F
    data[info + 14 : info + 18] = (total & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


async def _refused(m: Any, account: str, path: str, audio: bytes) -> None:
    headers = await m.key("basic", account)
    status, _, raw = await m.post(ASR, {"audio_url": m.serve(path, audio)}, headers)
    assert status == 422, raw
    [item] = orjson.loads(raw)["detail"]
    assert item["type"] == "audio_too_long" and item["loc"] == ["body", "audio_url"]
    assert await m.sim_requests("whisper") == []  # refused before the server was called
    assert [c["cost"] for c in await m.charges(account)] == [0]


@pytest.mark.parametrize("api", ["openai", "whisper.cpp"])
async def test_mp3_claiming_one_frame_is_measured_by_its_frames(media: MediaFactory, api: str
                                                                ) -> None:
    m = await media(requests_toml=LIMIT, asr_api=api)
    await _refused(m, "acct-mp3-long", "/long.mp3", lying_mp3(1000))  # 24 s
    headers = await m.key("basic", "acct-mp3")
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/ok.mp3", lying_mp3(500))},
                                  headers)
    assert status == 200, raw
    assert orjson.loads(raw)["duration"] == 12.0  # 500 frames of 24 ms
    [charge] = await m.charges("acct-mp3")
    assert charge["audio_ms"] == 12_000 and charge["cost"] == 12 * PER_AUDIO_S


@pytest.mark.parametrize("total", [0, 1])
async def test_flac_with_an_unknown_or_tiny_length_is_measured(media: MediaFactory, total: int
                                                               ) -> None:
    m = await media(requests_toml=LIMIT, asr_api="whisper.cpp")
    await _refused(m, "acct-flac-long", "/long.flac", lying_flac(25.0, total))
    headers = await m.key("basic", "acct-flac")
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/ok.flac", lying_flac(8.0, total))},
                                  headers)
    assert status == 200, raw
    [charge] = await m.charges("acct-flac")
    # The simulator takes an unknown length to be 128 kbps (more than 8 s here): the longer
    # of the two measures counts; a claimed single sample counts for nothing.
    assert charge["audio_ms"] >= 8000
    if total == 1:
        assert charge["audio_ms"] == 8000 and charge["cost"] == 8 * PER_AUDIO_S


async def test_a_header_claiming_more_is_refused_and_a_longer_report_counts(
        media: MediaFactory) -> None:
    """An MP3 claiming 30 s but carrying 12 is refused (over the 20 s limit by its headers);
    one claiming 15 with 12 present is charged the server's (header-trusting) 15 s."""
    m = await media(requests_toml=LIMIT)
    await _refused(m, "acct-claim", "/claims.mp3", mp3_xing(1250)[:384] + lying_mp3(500)[384:])
    headers = await m.key("basic", "acct-ok")
    audio = mp3_xing(625)[:384] + lying_mp3(500)[384:]
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/ok.mp3", audio)}, headers)
    assert status == 200, raw
    [charge] = await m.charges("acct-ok")
    assert charge["audio_ms"] == 15_000


async def test_a_server_reporting_more_than_the_limit_is_charged_the_limit(
        media: MediaFactory) -> None:
    """15 s of FLAC of unknown length: the simulator takes it to be 128 kbps (about 26 s, over
    the 20 s limit); the request has run, so it is charged the limit (its hold), no more."""
    m = await media(requests_toml=LIMIT, asr_api="whisper.cpp")
    headers = await m.key("basic", "acct-cap")
    url = m.serve("/flac", lying_flac(15.0, 0))
    status, _, raw = await m.post(ASR, {"audio_url": url}, headers)
    assert status == 200, raw
    assert orjson.loads(raw)["duration"] > 20
    [charge] = await m.charges("acct-cap")
    assert charge["audio_ms"] == 20_000 and charge["cost"] == charge["held"] == 20 * PER_AUDIO_S


async def test_an_upload_is_measured_the_same(media: MediaFactory) -> None:
    """OpenAI's multipart route: the lying MP3 uploaded, not fetched; refused on body.file."""
    m = await media(requests_toml=LIMIT)
    headers = await m.key("basic", "acct-up")
    results = []
    for frames in (1000, 500):
        form = aiohttp.FormData()
        form.add_field("model", ASR_MODEL)
        form.add_field("response_format", "verbose_json")
        form.add_field("file", lying_mp3(frames), filename="a.mp3", content_type="audio/mpeg")
        async with aiohttp.ClientSession() as session, session.post(
                m.gateway.make_url("/v2/compat/v1/audio/transcriptions"), data=form,
                headers=headers) as r:
            results.append((r.status, await r.json()))
    (refused, body), (ok, answer) = results
    assert refused == 422 and body["detail"][0]["type"] == "audio_too_long"
    assert body["detail"][0]["loc"] == ["body", "file"]
    assert ok == 200 and answer["duration"] == 12.0
    assert [c["audio_ms"] for c in await m.charges("acct-up") if c["cost"]] == [12_000]
