"""Audio a client names by URL (ASR `audio_url`, TTS `custom_voice.url`), fetched under the live
policy's SSRF rules, with one answer for every way it can fail (reliability F6)."""

from __future__ import annotations

from proxy.errors import GatewayError, validation_failed
from proxy.families.base import Ctx
from proxy.upstream.fetch import PUBLIC_MESSAGE, FetchRefused


async def fetch_audio(ctx: Ctx, url: str, loc: tuple[str, ...], max_bytes: int | None = None,
                      limits: str = "") -> bytes:
    """The audio at `url`; no more than `max_bytes` (below the [fetch] cap) are read. Every
    failure, a body over the cap included, is the one 422 (F6); `limits` is said in it."""
    fetcher = ctx.fetcher
    fetcher.follow(ctx.policies.requests.fetch)
    try:
        fetched = await fetcher.fetch(url, max_bytes=max_bytes)
    except FetchRefused:
        raise unfetchable(loc, limits) from None
    return fetched.data


def unfetchable(loc: tuple[str, ...], limits: str = "") -> GatewayError:
    return validation_failed([{"loc": ["body", *loc], "type": "url_unusable",
                               "msg": f"{PUBLIC_MESSAGE} (it must be a public http(s) URL of a "
                                      f"WAV, MP3, M4A, WEBM, FLAC or OGG file{limits})"}])
