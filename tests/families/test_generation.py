"""Image and video generation by provider, through the gateway: tier gating (image Pro and up,
video Max), bodies passed through, per-image and per-video-second charges from what was
delivered, and the model list naming every family."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.media.visual import probe_image, probe_video
from tests.support.media_stack import (
    ASR_MODEL,
    IMAGE_MODEL,
    PER_IMAGE,
    PER_VIDEO_S,
    TTS_MODEL,
    VIDEO_MODEL,
    MediaFactory,
)

IMAGE = "/v2/image/acme/generate"
VIDEO = "/v2/video/acme/t2v"


@pytest.mark.parametrize(("tier", "image", "video"), [
    ("basic", 403, 403), ("pro", 200, 403), ("max", 200, 200),
])
async def test_tiers_gate_the_families(media: MediaFactory, tier: str, image: int,
                                       video: int) -> None:
    m = await media()
    headers = await m.key(tier, f"acct-{tier}")
    status, _, raw = await m.post(IMAGE, {"prompt": "a cat"}, headers)
    assert status == image, raw
    status, _, raw = await m.post(VIDEO, {"prompt": "a cat", "seconds": 1}, headers)
    assert status == video, raw
    if video == 403:
        assert orjson.loads(raw)["error"]["type"] == "forbidden"
        assert await m.sim_requests("video") == []


async def test_images_are_passed_through_and_charged_each(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("pro", "acct-img")
    body = {"prompt": "a lighthouse", "n": 3, "size": "256x256", "mode": "direct",
            "async": False}
    status, _, raw = await m.post(IMAGE, body, headers)
    assert status == 200, raw
    data = orjson.loads(raw)["data"]
    assert len(data) == 3
    for item in data:
        assert probe_image(base64.b64decode(item["b64_json"])).format == "png"
    [sent] = await m.sim_requests("image")
    assert sent["body"] == {"prompt": "a lighthouse", "n": 3, "size": "256x256",
                            "model": IMAGE_MODEL}  # the gateway's fields stay home
    [charge] = await m.charges("acct-img")
    assert (charge["images"], charge["cost"], charge["held"]) == (3, 3 * PER_IMAGE,
                                                                  3 * PER_IMAGE)


async def test_video_is_charged_by_the_seconds_delivered(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("max", "acct-vid")
    status, got, raw = await m.post(VIDEO, {"prompt": "waves", "seconds": 2, "fps": 4}, headers)
    assert status == 200, raw
    assert got["Content-Type"].startswith("video/")
    assert probe_video(raw).duration_s == pytest.approx(2.0)
    [charge] = await m.charges("acct-vid")
    assert (charge["video_ms"], charge["cost"]) == (2000, 2 * PER_VIDEO_S)
    async with aiohttp.ClientSession() as session, session.get(
            m.gateway.make_url("/v2/account/usage"), headers=headers) as r:
        assert (await r.json())["totals"]["video_seconds"] == 2.0


@pytest.mark.parametrize(("path", "body", "status"), [
    (IMAGE, {"prompt": "x", "n": 11}, 422),  # requests.toml max_images
    (IMAGE, {"prompt": "x", "n": 0}, 422),
    (IMAGE, {"prompt": "x", "n": 1.5}, 422),
    (IMAGE, {"prompt": "x", "n": True}, 422),
    (IMAGE, {"prompt": "x", "model": 3}, 422),
    (IMAGE, {"prompt": "x", "mode": "fast"}, 422),
    (IMAGE, {"prompt": "x", "async": "yes"}, 422),
    (IMAGE, {"prompt": "x", "mode": "network"}, 404),
    (IMAGE, {"prompt": "x", "model": VIDEO_MODEL}, 404),  # not this provider's
    ("/v2/image/nobody/generate", {"prompt": "x"}, 404),
    ("/v2/video/nobody/t2v", {"prompt": "x"}, 404),
    (VIDEO, {"prompt": "x", "seconds": 21}, 422),  # requests.toml max_video_s
    (VIDEO, {"prompt": "x", "seconds": 0}, 422),
    (VIDEO, {"prompt": "x", "duration": "long"}, 422),
    (IMAGE, ["not", "an", "object"], 400),
])
async def test_refusals_reach_no_provider(media: MediaFactory, path: str, body: Any,
                                          status: int) -> None:
    m = await media()
    got, _, raw = await m.post(path, body, await m.key("max", "acct-r"))
    assert got == status, raw
    assert await m.sim_requests("image") == [] and await m.sim_requests("video") == []
    assert await m.charges("acct-r") == []


async def test_a_provider_failure_is_free(media: MediaFactory) -> None:
    m = await media()
    headers = {**await m.key("max", "acct-pf"), "x-sim-status": "503"}
    status, _, _ = await m.post(VIDEO, {"prompt": "x", "seconds": 3}, headers)
    assert status == 503
    [charge] = await m.charges("acct-pf")
    assert charge["cost"] == 0 and charge["held"] == 3 * PER_VIDEO_S


async def test_models_list_every_family(media: MediaFactory) -> None:
    m = await media()
    async with aiohttp.ClientSession() as session, session.get(
            m.gateway.make_url("/v2/models")) as r:
        models = {d["id"]: d for d in (await r.json())["data"]}
    assert {models[k]["task_family"] for k in (TTS_MODEL, ASR_MODEL, IMAGE_MODEL,
                                                VIDEO_MODEL)} == {"tts", "asr", "image",
                                                                  "video"}
    assert models[TTS_MODEL]["resource"] == f"direct.audio.{TTS_MODEL}"
    assert models[IMAGE_MODEL]["tiers"]["direct"] == ["guest", "pro", "max"]
    assert models[VIDEO_MODEL]["tiers"]["direct"] == ["guest", "max"]
    assert models[ASR_MODEL]["price"]["per_audio_second"] == 100
    assert all(d["healthy"] for d in models.values())
