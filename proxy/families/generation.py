"""Image and video generation: the few fields the gateway reads of bodies it passes through,
and the units it charges from the answers. Pure.

The spec shows no payload for `/v2/image/<provider>/generate` or `/v2/video/<provider>/t2v`:
the body goes to the provider as the client wrote it, minus the gateway's own fields (`mode`,
`async`). The gateway reads `prompt` (required), `model` (default: the provider's first model),
`n` (images, for the hold) and `seconds` or `duration` (video seconds, for the hold); every other
field is the provider's to judge. Charged: the images in the
answer (OpenAI Images' `data` items, or one image body), the seconds of the video it decoded.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from proxy.media.visual import NotMedia, probe_video
from proxy.validate import ErrorItem, conform_with

GATEWAY_FIELDS = ("mode", "async")
# Schema bounds: the hard limits of requests.toml; the served OpenAPI document states the
# running gateway's own (proxy.api.openapi fills them in), and `parse_*` enforce them.
IMAGES_MAX = 100
VIDEO_S_MAX = 3600


class _Generation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the gateway reads of a generation body; any other field goes to the provider."""

    prompt: Annotated[str, Meta(min_length=1, description="What to generate")]
    model: Annotated[str, Meta(min_length=1, description="Default: the provider's first "
                                                         "model")] | None = None
    mode: Literal["auto", "network", "direct"] | None = None
    async_: Annotated[bool | None, Meta(description="Return a task handle (202)")] = \
        msgspec.field(default=None, name="async")


class ImageRequest(_Generation, kw_only=True, omit_defaults=True):
    n: Annotated[int, Meta(ge=1, le=IMAGES_MAX, description="Images to generate (held "
                                                              "for; default 1)")] | None = None


Seconds = Annotated[float, Meta(ge=1, le=VIDEO_S_MAX)]


class VideoRequest(_Generation, kw_only=True, omit_defaults=True):
    seconds: Annotated[Seconds | None, Meta(description="Length of the video (held for; "
                                                          "default: the most allowed)")] = None
    duration: Annotated[Seconds | None, Meta(description="Another name for seconds")] = None


def parse_image(body: dict[str, Any], max_images: int
                ) -> tuple[ImageRequest, dict[str, Any]]:
    """The request and the body to send on (1.0 where an integer is due sent as 1)."""
    def rules(req: ImageRequest) -> list[ErrorItem]:
        if req.n is not None and req.n > max_images:
            return [{"loc": ["body", "n"], "type": "less_than_equal",
                     "msg": f"Input should be less than or equal to {max_images}"}]
        return []

    return conform_with(body, ImageRequest, rules)


def parse_video(body: dict[str, Any], max_seconds: int
                ) -> tuple[VideoRequest, dict[str, Any]]:
    def rules(req: VideoRequest) -> list[ErrorItem]:
        return [{"loc": ["body", name], "type": "less_than_equal",
                 "msg": f"Input should be less than or equal to {max_seconds}"}
                for name in ("seconds", "duration")
                if (value := getattr(req, name)) is not None and value > max_seconds]

    return conform_with(body, VideoRequest, rules)


def video_seconds_asked(req: VideoRequest, max_seconds: int) -> int:
    """The whole seconds held: what the body asks for, rounded up, else the most allowed."""
    asked = req.seconds if req.seconds is not None else req.duration
    return max_seconds if asked is None else math.ceil(asked)


def forwarded(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}


def images_in(answer: object, content_type: str) -> int:
    """Images delivered: OpenAI Images' `data` items, or 1 for an image body."""
    if content_type.startswith("image/"):
        return 1
    data = answer.get("data") if isinstance(answer, dict) else None
    return sum(1 for item in data if isinstance(item, dict)) if isinstance(data, list) else 0


def video_ms_in(body: bytes, answer: object, content_type: str) -> int | None:
    """Seconds of video delivered (as ms), decoded from the media; None if it can't be told."""
    if content_type.startswith("video/") or content_type == "application/octet-stream":
        return _decoded_ms(body)
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return None
    total = 0
    for item in data:
        encoded = item.get("b64_json") if isinstance(item, dict) else None
        if not isinstance(encoded, str):
            return None
        try:
            ms = _decoded_ms(base64.b64decode(encoded, validate=True))
        except binascii.Error:
            return None
        if ms is None:
            return None
        total += ms
    return total


def _decoded_ms(media: bytes) -> int | None:
    try:
        seconds = probe_video(media).duration_s
    except NotMedia:
        return None
    return None if seconds is None else round(seconds * 1000)
