"""Fixture (a pytest plugin) `media`: a gateway in front of the four media simulators (tts,
whisper, image, video), an "audio host" that serves files for `audio_url` (on 127.0.0.2, the one
private address the gateway's fetch policy allows) and an "internal" server on 127.0.0.1 that
nothing may reach. Also the media routes' prices and tiers, a WAV tone to send for ASR and the
check of the WAV that TTS answers (tests/families, tests/tasks, the real-engine ASR tests)."""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.credits.ledger import Ledger
from proxy.media.wav import wav_bytes
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.config_files import toml_value
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

TTS_MODEL, ASR_MODEL = "acme/csm-1b", "acme/large-v3"
IMAGE_MODEL, VIDEO_MODEL = "acme/image-gen", "acme/video-gen"
PER_1K_CHARS, PER_AUDIO_S, PER_IMAGE, PER_VIDEO_S = 15_000, 100, 20_000, 50_000
PRICES = f"""
version = "media-v1"
[models."{TTS_MODEL}"]
per_1k_characters = {PER_1K_CHARS}
[models."{ASR_MODEL}"]
per_audio_second = {PER_AUDIO_S}
[models."{IMAGE_MODEL}"]
per_image = {PER_IMAGE}
[models."{VIDEO_MODEL}"]
per_video_second = {PER_VIDEO_S}
"""
# The spec's tier table (families), at rates no test reaches.
TIERS = """
[tiers.guest]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image", "video"]
models = { "*" = ["direct", "network"] }
[tiers.basic]
requests_per_minute = 100000
families = ["chat", "tts", "asr"]
models = { standard = ["direct", "network"] }
[tiers.pro]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image"]
models = { standard = ["direct", "network"] }
[tiers.max]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image", "video"]
models = { standard = ["direct", "network"] }
"""
AUDIO_HOST = "127.0.0.2"


@dataclass
class Files:
    """What the audio host serves: path -> (body, content type); `seen` counts requests."""

    served: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)


@dataclass
class Media:
    gateway: TestServer
    sims: dict[str, TestServer]
    audio: TestServer
    files: Files
    internal: TestServer
    internal_seen: list[str]
    ledger: Ledger
    redis: Redis
    redis_url: str

    def url(self, path: str) -> str:
        return f"http://{AUDIO_HOST}:{self.audio.port}{path}"

    def serve(self, path: str, body: bytes, content_type: str = "audio/wav") -> str:
        self.files.served[path] = (body, content_type)
        return self.url(path)

    async def key(self, tier: str, account: str, credits: int = 10**9) -> dict[str, str]:
        key = await new_key(self.redis_url, tier, account=account)
        if credits:
            await self.ledger.credit(account, credits, {"reason": "test"})
        return {"X-API-Key": key}

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None
                   ) -> tuple[int, aiohttp.typedefs.LooseHeaders, bytes]:
        async with aiohttp.ClientSession() as session, session.post(
                self.gateway.make_url(path), json=body, headers=headers or {}) as response:
            return response.status, response.headers, await response.read()

    async def get(self, path: str, headers: dict[str, str] | None = None
                  ) -> tuple[int, Any, bytes]:
        async with aiohttp.ClientSession() as session, session.get(
                self.gateway.make_url(path), headers=headers or {}) as response:
            return response.status, response.headers, await response.read()

    async def async_speech(self, text: str, headers: dict[str, str], timeout_s: float = 15
                           ) -> dict[str, Any]:
        """Submit `text` as an async TTS task (202) and poll it until it ends: its record."""
        status, _, raw = await self.post("/v2/audio/tts/engine", {"text": text, "async": True},
                                         headers)
        assert status == 202, raw
        poll = orjson.loads(raw)["poll_url"]
        async with asyncio.timeout(timeout_s):
            while True:
                record: dict[str, Any] = orjson.loads((await self.get(poll, headers))[2])
                if record["status"] != "running":
                    return record
                await asyncio.sleep(0.05)

    async def sim_requests(self, kind: str) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session, session.get(
                self.sims[kind].make_url("/_sim/requests")) as response:
            records: list[dict[str, Any]] = await response.json()
            return records

    async def charges(self, account: str) -> list[dict[str, Any]]:
        await settled(self.gateway)
        return [e for e in await self.ledger.all_entries(account) if e["type"] == "charge"]


def audio_app(files: Files) -> web.Application:
    async def serve(request: web.Request) -> web.StreamResponse:
        files.seen.append(request.path)
        found = files.served.get(request.path)
        if found is None:
            return web.Response(status=404)
        body, content_type = found
        if content_type.startswith("redirect:"):
            raise web.HTTPFound(content_type.removeprefix("redirect:"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/{tail:.*}", serve)
    return app


def internal_app(seen: list[str]) -> web.Application:
    async def anything(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(body=b"RIFF-internal-secret", content_type="audio/wav")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


def tone(seconds: float, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV of a tone, `seconds` long."""
    samples = int(seconds * rate)
    pcm = b"".join(int(8000 * math.sin(i / 7)).to_bytes(2, "little", signed=True)
                   for i in range(samples))
    return wav_bytes(pcm, rate)


def assert_speech_wav(data: bytes) -> float:
    """The spec's WAV: the canonical 44-byte header, 16-bit PCM, mono, 24 kHz. Its seconds."""
    riff, size, wave, fmt, fmt_size, audio_format, channels, rate, byte_rate, align, bits, \
        data_id, data_size = struct.unpack("<4sI4s4sIHHIIHH4sI", data[:44])
    assert (riff, wave, fmt, fmt_size, data_id) == (b"RIFF", b"WAVE", b"fmt ", 16, b"data")
    assert (audio_format, channels, rate, byte_rate, align, bits) == (1, 1, 24000, 48000, 2, 16)
    assert size == 36 + data_size and data_size == len(data) - 44 and data_size % 2 == 0
    return data_size / 48000


MediaFactory = Callable[..., Awaitable[Media]]


@pytest.fixture
async def media(gateway: GatewayFactory, simulator: SimulatorFactory, aiohttp_server: Any,
                clean_redis: RedisProcess) -> Any:
    redis = Redis.from_url(clean_redis.url)

    async def start(*, sim_options: dict[str, dict[str, Any]] | None = None,
                    requests_toml: str = "", fetch: dict[str, Any] | None = None,
                    extra_ports: list[int] | None = None, asr_api: str = "openai",
                    tts_backend: dict[str, Any] | None = None,
                    resolver: AbstractResolver | None = None,
                    tiers: str = TIERS, store: dict[str, Any] | None = None) -> Media:
        options = sim_options or {}
        sims = {
            "tts": await simulator("tts", (TTS_MODEL,), **options.get("tts", {})),
            "whisper": await simulator("whisper", (ASR_MODEL,), **options.get("whisper", {})),
            "image": await simulator("image", (IMAGE_MODEL,), **options.get("image", {})),
            "video": await simulator("video", (VIDEO_MODEL,), **options.get("video", {})),
        }
        files = Files()
        audio = await aiohttp_server(audio_app(files), host=AUDIO_HOST)
        internal_seen: list[str] = []
        internal = await aiohttp_server(internal_app(internal_seen), host="127.0.0.1")

        def backend(name: str, kind: str, sim: TestServer, model: str, **extra: Any
                    ) -> dict[str, Any]:
            return {"name": name, "kind": kind, "url": str(sim.make_url("/")).rstrip("/"),
                    "models": [model], "forward_headers": ["x-sim-*"], **extra}

        rules = {"allow_networks": [f"{AUDIO_HOST}/32"],
                 "ports": [80, 443, audio.port, internal.port, *(extra_ports or [])],
                 **(fetch or {})}
        fetch_toml = "[fetch]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in rules.items())
        gw = await gateway(
            backend("tts-a", "tts", sims["tts"], TTS_MODEL, **(tts_backend or {})),
            backend("asr-a", "whisper", sims["whisper"], ASR_MODEL, api=asr_api),
            backend("image-a", "image", sims["image"], IMAGE_MODEL, provider="acme"),
            backend("video-a", "video", sims["video"], VIDEO_MODEL, provider="acme"),
            policies={"prices.toml": PRICES, "tiers.toml": tiers,
                      "requests.toml": fetch_toml + requests_toml},
            resolver=resolver, media=store)
        return Media(gw, sims, audio, files, internal, internal_seen, Ledger(redis), redis,
                     clean_redis.url)

    try:
        yield start
    finally:
        await redis.aclose()
