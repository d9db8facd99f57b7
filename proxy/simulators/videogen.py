"""A text-to-video server without a video model: `POST /v1/videos/generations`.

`{model, prompt, seconds (1-20, default 2), fps (1-30, default 8), size ("WxH", default
"64x64", at most 256x256)}` answers 200 `Content-Type: video/x-msvideo` with a real
uncompressed AVI of round(seconds * fps) frames (a gradient drifting across the frame in
colours picked by the prompt's hash; same request, same bytes) and `X-Video-Duration`, the
file's duration in seconds (frames / fps). Errors use OpenAI's envelope; an unknown `model`
is 404 `model_not_found`; `model` defaults to the first served model.

There is no single standard for this route (OpenAI's Sora API is asynchronous, with jobs);
a synchronous answer keeps a gateway test to one request. `--ttft-ms` is the render time.
"""

from __future__ import annotations

import asyncio
import hashlib
import re

import numpy as np
from aiohttp import web

from proxy.media.visual import avi_bytes
from proxy.simulators.exchange import Exchange
from proxy.simulators.openai_facade import (
    add_facade_routes,
    integer,
    invalid,
    number,
    prompted,
    string,
)

MAX_SIDE = 256
MIN_SECONDS, MAX_SECONDS = 1.0, 20.0
MAX_FPS = 30
_SIZE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")


def frames(prompt: str, count: int, width: int, height: int) -> list[bytes]:
    """`count` top-down RGB frames: a diagonal gradient that moves a few pixels a frame."""
    d = hashlib.sha256(prompt.encode()).digest()
    tint = np.array([d[0], d[1], d[2]], dtype=np.int64)
    y, x = np.mgrid[0:height, 0:width]
    out = []
    for k in range(count):
        wave = (x * 255 // max(width - 1, 1) + y * 128 // max(height - 1, 1) + 6 * k) % 256
        rgb = np.stack([(wave + tint[0]) % 256, (255 - wave + tint[1]) % 256,
                        np.full_like(wave, int(tint[2]))], axis=-1)
        out.append(rgb.astype(np.uint8).tobytes())
    return out


def render(prompt: str, count: int, width: int, height: int, fps: int) -> bytes:
    return avi_bytes(frames(prompt, count, width, height), width, height, fps)


async def generations(ex: Exchange) -> web.StreamResponse:
    body, prompt = prompted(ex)
    seconds = number(body, "seconds", 2.0, MIN_SECONDS, MAX_SECONDS)
    fps = integer(body, "fps", 8, 1, MAX_FPS)
    size = string(body, "size") or "64x64"
    match = _SIZE.fullmatch(size)
    if match is None or int(match[1]) > MAX_SIDE or int(match[2]) > MAX_SIDE:
        raise invalid(f"Invalid 'size': '{size}'. Expected 'WIDTHxHEIGHT', each side 1 to "
                      f"{MAX_SIDE} pixels.", "size")
    width, height = int(match[1]), int(match[2])
    await ex.processing()
    count = max(1, round(seconds * fps))
    # The largest video (600 frames of 256x256) takes seconds to build: in a thread, so the
    # server keeps answering meanwhile.
    video = await asyncio.get_running_loop().run_in_executor(
        None, render, prompt, count, width, height, fps)
    return web.Response(body=video, headers={"Content-Type": "video/x-msvideo",
                                             "X-Video-Duration": f"{count / fps:g}"})


def add_routes(app: web.Application) -> None:
    add_facade_routes(app, "/v1/videos/generations", generations)
