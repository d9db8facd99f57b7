"""Whisper on one port, in both wire formats a gateway meets (protocols.md §6): vLLM's
OpenAI-style `POST /v1/audio/transcriptions` and `/v1/audio/translations` (`whisper_vllm`),
whisper.cpp's `POST /inference` (`whisper_cpp`), vLLM's `GET /v1/models` and `/version`, and
`GET /health`, 200 `{"status":"ok"}`. An unserved path or method is FastAPI's JSON 404/405
`{"detail"}`, as vLLM's app answers it.

Hearing (`speech.hear`): a WAV is read sample by sample; audio the TTS simulator made carries
a watermark and is transcribed back to exactly its text (translation too: it is English
already). Other audio gets a pseudo-transcript (2.5 words/s) chosen by the bytes' hash. MP3,
FLAC, M4A, OGG and WebM are measured from their container (vLLM decodes them all; whisper.cpp
without --convert only WAV, MP3 and FLAC), except where vLLM's decoder puts out another
length (`whisper_vllm`); a container that states no duration is taken to be 128 kbps.
`--ttft-ms` is the processing time.

Differences kept on purpose: `prompt`, `seed` and the sampling fields do not change the text;
vLLM's 30 s windows split at a quiet point near 30 s, ours exactly at 30 s.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.simulators.bodies import json_response
from proxy.simulators.runtime import inference
from proxy.simulators.state import health_status
from proxy.simulators.vllm import models, version
from proxy.simulators.whisper_cpp import ONE_AT_A_TIME, cpp_error, whisper_cpp
from proxy.simulators.whisper_vllm import transcriptions, translations

MAX_MODEL_LEN = 448  # Whisper's max_target_positions, as vLLM lists it
MAX_UPLOAD = 64 * 1024 * 1024  # the app's body cap: above 25 MB, so vLLM's own 400 shows


@web.middleware
async def fastapi_route_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A path nobody serves, or a method a route does not take, answered as vLLM's FastAPI
    app does: 404 `{"detail":"Not Found"}`, 405 `{"detail":"Method Not Allowed"}` with
    `Allow` (FastAPI routes take no implicit HEAD), both application/json."""
    missing = request.match_info.http_exception
    if isinstance(missing, web.HTTPMethodNotAllowed):
        allow = ", ".join(sorted(m for m in missing.allowed_methods if m != "HEAD"))
        return json_response({"detail": "Method Not Allowed"}, status=405,
                             headers={"Allow": allow})
    if missing is not None and missing.status == 404:
        return json_response({"detail": "Not Found"}, status=404)
    return await handler(request)


def add_routes(app: web.Application) -> None:
    app.middlewares.append(fastapi_route_errors)
    app[ONE_AT_A_TIME] = asyncio.Lock()
    app.router.add_post("/v1/audio/transcriptions", inference(transcriptions, form=True))
    app.router.add_post("/v1/audio/translations", inference(translations, form=True))
    app.router.add_post("/inference", inference(whisper_cpp, form=True, errors=cpp_error))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health_status)
