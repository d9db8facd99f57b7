"""OpenAI Images API (`POST /v1/images/generations`) without a diffusion model.

`{model, prompt (1-4000 characters), n (1-10), size, response_format, seed}` gives
`{"created", "data": [{"b64_json": <PNG>, "revised_prompt": prompt}] * n}`; each PNG is real
(a gradient and a disc in colours picked by the hash of seed, prompt and index), so the same
request gives the same images and the n items differ. Errors use OpenAI's envelope; an
unknown `model` is 404 `model_not_found`, and `model` defaults to the first served model (as
OpenAI's defaults to dall-e-2).

Decisions where the docs are silent: sizes are DALL-E 2's three ("256x256", "512x512",
"1024x1024"), but the PNG is rendered at min(size, 128) pixels a side (128x128 for all three),
so tests stay fast; a client that needs the asked size reads it from its own request.
`response_format: "url"` is a 400 (no file host here); `b64_json` is the default.
`--ttft-ms` is the generation time.
"""

from __future__ import annotations

import base64
import hashlib
import time

from aiohttp import web

from proxy.media.visual import Pixel, png_bytes
from proxy.simulators.bodies import json_response
from proxy.simulators.exchange import Exchange
from proxy.simulators.openai_facade import (
    add_facade_routes,
    choice,
    integer,
    invalid,
    prompted,
    wrong_type,
)

MAX_PROMPT = 4000  # DALL-E 2's limit
SIZES = ("256x256", "512x512", "1024x1024")
MAX_RENDER = 128  # pixels a side actually drawn
MAX_N = 10


def painter(key: bytes, side: int) -> Pixel:
    """A deterministic picture for `key`: a diagonal two-colour gradient and a disc."""
    d = hashlib.sha256(key).digest()
    low, high, disc = d[0:3], d[3:6], (d[6], d[7], d[8])
    cx, cy, radius = d[9] % side, d[10] % side, side // 6 + d[11] % (side // 4 + 1)
    span = max(2 * side - 2, 1)

    def pixel(x: int, y: int) -> tuple[int, int, int]:
        if (x - cx) ** 2 + (y - cy) ** 2 <= radius * radius:
            return disc
        t = (x + y) / span
        r, g, b = (round(a + (z - a) * t) for a, z in zip(low, high, strict=True))
        return r, g, b

    return pixel


async def generations(ex: Exchange) -> web.StreamResponse:
    body, prompt = prompted(ex, MAX_PROMPT)
    n = integer(body, "n", 1, 1, MAX_N)
    size = choice(body, "size", "1024x1024", SIZES)
    fmt = choice(body, "response_format", "b64_json", ("url", "b64_json"))
    if fmt == "url":
        raise invalid("response_format 'url' is not supported by this simulator; use "
                      "'b64_json'.", "response_format", "unsupported_value")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise wrong_type("seed", "an integer", seed)
    await ex.processing()
    side = min(int(size.split("x")[0]), MAX_RENDER)
    data = []
    for index in range(n):
        key = f"{seed}\0{prompt}\0{index}".encode()
        png = png_bytes(side, side, painter(key, side))
        data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": prompt})
    return json_response({"created": int(time.time()), "data": data})


def add_routes(app: web.Application) -> None:
    add_facade_routes(app, "/v1/images/generations", generations)
