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
import importlib
from typing import TYPE_CHECKING

from proxy.simulators.config import SimConfig

if TYPE_CHECKING:
    from aiohttp import web

CHAT_KINDS = ("tgi", "vllm")
MEDIA_KINDS = ("tts", "whisper", "image", "video")
KINDS = CHAT_KINDS + MEDIA_KINDS + ("tei",)
MAX_BODY = 16 * 1024 * 1024  # above both servers' defaults: the gateway enforces the real caps

# Each kind's module, imported when its app is built: a simulator loads only its own kind's
# libraries (numpy, zmq), and commands that merely list KINDS (every `inference-gateway`
# command builds the `simulate` parser) load none, nor aiohttp.
_MODULES = {"tgi": "tgi", "vllm": "vllm", "tts": "tts", "whisper": "whisper",
            "image": "imagegen", "video": "videogen", "tei": "tei"}

__all__ = ["CHAT_KINDS", "KINDS", "MEDIA_KINDS", "SimConfig", "build_app"]


def build_app(kind: str, config: SimConfig) -> web.Application:
    from aiohttp import web

    from proxy.simulators.state import STATE, SimState, add_sim_routes

    if kind not in KINDS:
        raise ValueError(f"unknown simulator kind {kind!r}; expected one of {KINDS}")
    if not config.models:
        raise ValueError("a simulator needs at least one model")
    if not config.speed > 0:
        raise ValueError(f"speed must be positive, not {config.speed}")
    max_body = MAX_BODY
    if kind == "whisper":
        from proxy.simulators import whisper

        # vLLM lists Whisper with its decoder's context; uploads above vLLM's 25 MB must
        # reach the handler to get vLLM's own 400.
        config = dataclasses.replace(config, max_model_len=whisper.MAX_MODEL_LEN)
        max_body = whisper.MAX_UPLOAD
    app = web.Application(client_max_size=max_body)
    app[STATE] = SimState(kind, config)
    add_sim_routes(app)
    importlib.import_module(f"proxy.simulators.{_MODULES[kind]}").add_routes(app)
    if config.startup_delay_s > 0:
        # on_startup runs before the site binds, so the port stays closed (connection
        # refused) while "loading", as with the real servers.
        async def load(_app: web.Application) -> None:
            await asyncio.sleep(config.startup_delay_s)

        app.on_startup.append(load)
    return app
