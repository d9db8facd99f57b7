"""Upstream simulators: inference servers without GPUs, speaking the real wire formats.

Chat: TGI and vLLM (`--runner pooling`: an embedding model). Embeddings: `tei`
(text-embeddings-inference). Media: `tts` (CSM-1B behind an OpenAI TTS facade), `whisper` (vLLM's
and whisper.cpp's transcription routes on one port), `image` (OpenAI Images) and `video`
(text-to-video, an uncompressed AVI). Operators run them with
`inference-gateway simulate KIND ...`; the gateway's tests run against them. Faults are
chosen per request with `x-sim-*` headers (see `faults`), and `/_sim/requests`,
`/_sim/stats`, `/_sim/reset`, `/_sim/health` expose what they saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from aiohttp import web

from proxy.simulators import imagegen, tei, tgi, tts, videogen, vllm, whisper
from proxy.simulators.config import SimConfig
from proxy.simulators.state import STATE, SimState, add_sim_routes

CHAT_KINDS = ("tgi", "vllm")
MEDIA_KINDS = ("tts", "whisper", "image", "video")
KINDS = CHAT_KINDS + MEDIA_KINDS + ("tei",)
MAX_BODY = 16 * 1024 * 1024  # above both servers' defaults: the gateway enforces the real caps

_ROUTES: dict[str, Callable[[web.Application], None]] = {
    "tgi": tgi.add_routes, "vllm": vllm.add_routes, "tts": tts.add_routes,
    "whisper": whisper.add_routes, "image": imagegen.add_routes, "video": videogen.add_routes,
    "tei": tei.add_routes,
}

__all__ = ["CHAT_KINDS", "KINDS", "MEDIA_KINDS", "SimConfig", "build_app"]


def build_app(kind: str, config: SimConfig) -> web.Application:
    if kind not in KINDS:
        raise ValueError(f"unknown simulator kind {kind!r}; expected one of {KINDS}")
    if not config.models:
        raise ValueError("a simulator needs at least one model")
    if not config.speed > 0:
        raise ValueError(f"speed must be positive, not {config.speed}")
    if kind == "whisper":
        # vLLM lists Whisper with its decoder's context; uploads above vLLM's 25 MB must
        # reach the handler to get vLLM's own 400.
        config = dataclasses.replace(config, max_model_len=whisper.MAX_MODEL_LEN)
    app = web.Application(client_max_size=whisper.MAX_UPLOAD if kind == "whisper" else MAX_BODY)
    app[STATE] = SimState(kind, config)
    add_sim_routes(app)
    _ROUTES[kind](app)
    if config.startup_delay_s > 0:
        # on_startup runs before the site binds, so the port stays closed (connection
        # refused) while "loading", as with the real servers.
        async def load(_app: web.Application) -> None:
            await asyncio.sleep(config.startup_delay_s)

        app.on_startup.append(load)
    return app
