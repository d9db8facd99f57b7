"""POST /v2/audio/asr/engine through the gateway: the ASR table's bounds and enums, the SSRF
rules on `audio_url` (reliability.md F1-F6), format checks by content, metering by the decoded
audio's seconds, and both server wires (OpenAI/vLLM and whisper.cpp)."""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from tests.support.media_stack import AUDIO_HOST, PER_AUDIO_S, MediaFactory, tone

ASR = "/v2/audio/asr/engine"
UNFETCHABLE = "the audio could not be fetched from this URL"


class StubResolver(AbstractResolver):
    """A DNS that answers what the test says (a rebinding attacker's, say)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        self.asked.append(host)
        return [ResolveResult(hostname=host, host=ip, port=port,
                              family=socket.AF_INET6 if ":" in ip else socket.AF_INET,
                              proto=0, flags=socket.AI_NUMERICHOST)
                for ip in self.answers.get(host, [])]

    async def close(self) -> None:
        return None


async def test_transcribes_wav_with_segments_and_words(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("basic", "acct-a")
    url = m.serve("/tone.wav", tone(3.0), "audio/x-wav")
    status, got, raw = await m.post(ASR, {"audio_url": url}, headers)
    assert status == 200, raw
    plain = orjson.loads(raw)
    assert set(plain) == {"text", "language", "duration"} and plain["duration"] == 3.0
    assert plain["language"] == "en" and plain["text"]
    assert got["X-RateLimit-Limit"] and got["X-Task-Id"].startswith("direct:")
    status, _, raw = await m.post(ASR, {"audio_url": url, "return_timestamps": True}, headers)
    segments = orjson.loads(raw)["segments"]
    assert status == 200 and segments and all(0 <= s["start"] <= s["end"] <= 3.0
                                              for s in segments)
    status, _, raw = await m.post(ASR, {"audio_url": url, "return_timestamps": "word"}, headers)
    answer = orjson.loads(raw)
    assert status == 200 and "segments" not in answer
    words = answer["words"]
    assert " ".join(w["word"] for w in words) == answer["text"]
    assert answer["words_estimated"] is True  # vLLM leaves `words` null: spread over segments
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in itertools.pairwise(words))
    charges = await m.charges("acct-a")
    assert [(c["audio_ms"], c["cost"]) for c in charges] == [(3000, 3 * PER_AUDIO_S)] * 3
    sent = await m.sim_requests("whisper")
    assert sent[2]["body"]["timestamp_granularities[]"] == ["segment", "word"]
    assert sent[0]["body"]["file"]["filename"] == "audio.wav"


async def test_server_words_are_used_when_it_gives_them(media: MediaFactory) -> None:
    m = await media(sim_options={"whisper": {"word_timestamps": True}})
    url = m.serve("/tone.wav", tone(2.0))
    status, _, raw = await m.post(ASR, {"audio_url": url, "return_timestamps": "word"})
    answer = orjson.loads(raw)
    assert status == 200 and answer["words"] and "words_estimated" not in answer


async def test_whisper_cpp_wire(media: MediaFactory) -> None:
    m = await media(asr_api="whisper.cpp")
    url = m.serve("/tone.wav", tone(2.5))
    body = {"audio_url": url, "task": "translate", "language": "de",
            "return_timestamps": "word", "temperature": 0.2}
    status, _, raw = await m.post(ASR, body)
    assert status == 200, raw
    answer = orjson.loads(raw)
    assert answer["duration"] == 2.5 and answer["language"] in ("de", "en")
    assert answer["words"] and "words_estimated" not in answer  # inside whisper.cpp segments
    [sent] = await m.sim_requests("whisper")
    assert sent["path"] == "/inference"
    assert sent["body"]["translate"] == "true" and sent["body"]["language"] == "de"


async def test_translate_goes_to_the_translations_route(media: MediaFactory) -> None:
    m = await media()
    url = m.serve("/tone.wav", tone(1.0))
    status, _, _ = await m.post(ASR, {"audio_url": url, "task": "translate", "language": "fr"})
    assert status == 200
    [sent] = await m.sim_requests("whisper")
    assert sent["path"] == "/v1/audio/translations" and "language" not in sent["body"]


OK = {"audio_url": "http://media.example/a.wav"}


@pytest.mark.parametrize(("body", "loc", "kind"), [
    ({}, ["body", "audio_url"], "missing"),
    ({"audio_url": ""}, ["body", "audio_url"], "string_too_short"),
    ({**OK, "task": "summarize"}, ["body", "task"], "literal_error"),
    ({**OK, "language": "xx"}, ["body", "language"], "string_pattern_mismatch"),
    ({**OK, "language": "english"}, ["body", "language"], "string_pattern_mismatch"),
    ({**OK, "return_timestamps": "segment"}, ["body", "return_timestamps"], None),
    ({**OK, "temperature": 1.01}, ["body", "temperature"], "less_than_equal"),
    ({**OK, "temperature": -0.1}, ["body", "temperature"], "greater_than_equal"),
    ({**OK, "chunk_length_s": 0}, ["body", "chunk_length_s"], "greater_than_equal"),
    ({**OK, "chunk_length_s": 61}, ["body", "chunk_length_s"], "less_than_equal"),
    ({**OK, "chunk_length_s": 1.5}, ["body", "chunk_length_s"], "int_from_float"),
    ({**OK, "batch_size": 0}, ["body", "batch_size"], "greater_than_equal"),
    ({**OK, "batch_size": 33}, ["body", "batch_size"], "less_than_equal"),
    ({**OK, "mode": "network"}, ["body", "mode"], "literal_error"),  # ASR is direct-only
    ({**OK, "mode": "fast"}, ["body", "mode"], "literal_error"),
    ({**OK, "file": "x"}, ["body", "file"], "extra_forbidden"),
])
async def test_every_bound_and_enum_is_422_and_fetches_nothing(
        media: MediaFactory, body: dict[str, Any], loc: list[str], kind: str | None) -> None:
    m = await media()
    status, _, raw = await m.post(ASR, body, await m.key("basic", "acct-v"))
    assert status == 422, raw
    assert any(i["loc"] == loc and (kind is None or i["type"] == kind)
               for i in orjson.loads(raw)["detail"]), raw
    assert m.files.seen == [] and await m.sim_requests("whisper") == []
    assert await m.charges("acct-v") == []


@pytest.mark.parametrize("extra", [
    {"chunk_length_s": 1}, {"chunk_length_s": 60}, {"batch_size": 1}, {"batch_size": 32},
    {"temperature": 0.0}, {"temperature": 1}, {"language": "en"}, {"mode": "auto"},
    {"mode": "direct"}, {"return_timestamps": False}, {"task": "transcribe"},
])
async def test_bounds_themselves_are_accepted(media: MediaFactory, extra: dict[str, Any]
                                              ) -> None:
    m = await media()
    url = m.serve("/t.wav", tone(0.5))
    status, _, raw = await m.post(ASR, {"audio_url": url, **extra})
    assert status == 200, raw
    [sent] = await m.sim_requests("whisper")
    for name in ("chunk_length_s", "batch_size"):
        if name in extra:
            assert sent["body"][name] == str(extra[name])


def _refused(raw: bytes) -> None:
    [item] = orjson.loads(raw)["detail"]
    assert item["loc"] == ["body", "audio_url"] and item["type"] == "url_unusable"
    assert item["msg"].startswith(UNFETCHABLE)


async def test_ssrf_table_reaches_nothing_internal(media: MediaFactory) -> None:
    """F1-F4 through the gateway: one identical 422 for blocked and unreachable alike, the
    internal server untouched, nothing charged."""
    resolver = StubResolver({"rebind.test": [AUDIO_HOST, "127.0.0.1"],
                             "metadata.test": ["169.254.169.254"],
                             "good.test": [AUDIO_HOST]})
    m = await media(resolver=resolver)
    headers = await m.key("basic", "acct-s")
    port = m.internal.port
    m.serve("/to-internal", b"", f"redirect:http://127.0.0.1:{port}/a.wav")
    m.serve("/to-metadata", b"", "redirect:http://169.254.169.254/latest/meta-data")
    m.serve("/a.wav", tone(0.5))
    urls = [
        f"http://127.0.0.1:{port}/a.wav", f"http://127.1:{port}/a.wav",
        f"http://[::ffff:127.0.0.1]:{port}/a.wav", f"http://2130706433:{port}/a.wav",
        "http://169.254.169.254/latest/meta-data", f"http://localhost:{port}/a.wav",
        f"ftp://{AUDIO_HOST}:{m.audio.port}/a.wav", "file:///etc/passwd",
        f"http://user:pw@{AUDIO_HOST}:{m.audio.port}/a.wav",
        f"http://{AUDIO_HOST}:22/a.wav",  # a port not allowed
        f"http://rebind.test:{port}/a.wav",  # one public-looking, one internal address
        "http://metadata.test/latest/meta-data",
        m.url("/to-internal"), m.url("/to-metadata"),  # redirects, checked again
        f"http://{AUDIO_HOST}:{m.audio.port + 1 if m.audio.port < 65535 else 1}/a.wav",
    ]
    for url in urls:
        status, _, raw = await m.post(ASR, {"audio_url": url}, headers)
        assert status == 422, (url, raw)
        _refused(raw)
    assert m.internal_seen == []
    assert await m.sim_requests("whisper") == []
    assert all(c["cost"] == 0 for c in await m.charges("acct-s"))
    # The same resolver, a name that resolves only to the allowed host: fetched.
    status, _, raw = await m.post(ASR, {"audio_url": f"http://good.test:{m.audio.port}/a.wav"})
    assert status == 200, raw


@pytest.mark.parametrize(("name", "body", "content_type"), [
    ("html", b"<!doctype html><html>hi</html>", "audio/wav"),  # sniffed: not audio
    ("text", b"RIFF but not a wave file at all", "audio/wav"),
    ("typed-html", tone(0.2), "text/html"),  # audio bytes, but a web page's type
    ("empty", b"", "audio/wav"),
])
async def test_not_audio_gets_the_same_answer(media: MediaFactory, name: str, body: bytes,
                                              content_type: str) -> None:
    m = await media()
    status, _, raw = await m.post(ASR, {"audio_url": m.serve(f"/{name}", body, content_type)})
    assert status == 422
    _refused(raw)
    assert await m.sim_requests("whisper") == []


async def test_oversize_and_slow_audio(media: MediaFactory, aiohttp_server: Any) -> None:
    """F6: a body over the byte cap and one that drips past the deadline: the same 422."""

    async def drip(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "audio/wav"})
        await response.prepare(request)
        for _ in range(100):
            await response.write(b"R")
            await asyncio.sleep(0.1)
        return response

    app = web.Application()
    app.router.add_get("/slow.wav", drip)
    slow = await aiohttp_server(app, host=AUDIO_HOST)
    m = await media(fetch={"max_bytes": 50_000, "timeout_s": 1.0}, extra_ports=[slow.port])
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/big.wav", tone(3.0))})  # 96 KB
    assert status == 422
    _refused(raw)
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _, raw = await m.post(ASR, {"audio_url": f"http://{AUDIO_HOST}:{slow.port}/slow.wav"})
    assert status == 422 and loop.time() - started < 3.0
    _refused(raw)
    assert await m.sim_requests("whisper") == []


async def test_audio_longer_than_the_policy_is_refused(media: MediaFactory) -> None:
    m = await media(requests_toml="[asr]\nmax_audio_s = 2\n")
    headers = await m.key("basic", "acct-l")
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/long.wav", tone(2.5))}, headers)
    assert status == 422 and orjson.loads(raw)["detail"][0]["type"] == "audio_too_long"
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/ok.wav", tone(2.0))}, headers)
    assert status == 200
    status, _, raw = await m.post(ASR, {"audio_url": m.url("/missing.wav")}, headers)
    assert status == 422
    charges = await m.charges("acct-l")
    assert [c["cost"] for c in charges] == [0, 2 * PER_AUDIO_S, 0]
    assert charges[0]["held"] == 2 * PER_AUDIO_S  # the hold: the policy's longest audio
    # The client's own fault, not the upstream's (which was never asked).
    assert [c["status"] for c in charges] == ["client_error", "completed", "client_error"]


async def test_short_balance_is_402_before_any_fetch(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("basic", "acct-poor", credits=100 * PER_AUDIO_S)  # < 600 s
    status, _, raw = await m.post(ASR, {"audio_url": m.serve("/a.wav", tone(1.0))}, headers)
    assert status == 402, raw
    assert m.files.seen == [] and await m.sim_requests("whisper") == []


async def test_fetch_policy_reload_applies_to_the_next_fetch(
        media: MediaFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """requests.toml [fetch] is a policy like the others: reloaded, it rules the next fetch."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-secret-token-for-tests")
    m = await media()
    url = m.serve("/a.wav", tone(0.5))
    assert (await m.post(ASR, {"audio_url": url}))[0] == 200
    requests_file = tmp_path / "config" / "policies" / "requests.toml"
    requests_file.write_text(requests_file.read_text().replace(f'"{AUDIO_HOST}/32"', ""))
    status, _, _ = await m.post("/admin/reload", None,
                                {"Authorization": "Bearer admin-secret-token-for-tests"})
    assert status == 200
    status, _, raw = await m.post(ASR, {"audio_url": url})
    assert status == 422
    _refused(raw)
    assert m.files.seen == ["/a.wav"]  # the second one never left the gateway
