"""The discovery calls Ollama clients make besides chat, under the native prefix.

`GET|HEAD /api/tags` (the chat models served), `GET /api/version`, `POST /api/show`, `GET
/api/ps` and `GET /` ("Ollama is running"). Credentials are optional, but a key or token that is
sent must be valid (401 otherwise). These listings are free: they are not rate limited, and they
never touch an upstream. Errors come out in Ollama's `{"error": "..."}` shape.

Ollama-specific facts the gateway cannot know (size, quantization, digests) are filled with
plausible, stable values: `format` is "safetensors" (vLLM and TGI serve Hugging Face weights),
the digest is the SHA-256 of the model name, and `modified_at` is when the app was built.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from proxy.appkeys import LIVE, ROUTER
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.http.body import read_json
from proxy.upstream.pool import Backend
from proxy.validate import RequestInvalid, validate

# The Ollama API level these answers mirror (clients gate features on it, e.g. tools, think).
OLLAMA_VERSION = "0.12.0"
SHOW_MAX_BYTES = 16 * 1024
_PARAMETER_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])")


class ShowRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older clients' spelling of `model`


# Ollama reports when a model was last modified; here, when this process started.
_STARTED = datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


async def tags(request: web.Request) -> web.Response:
    """GET (and HEAD) /api/tags: the chat models served."""
    await _authenticate(request)
    router = request.app[ROUTER]
    return web.json_response(
        {"models": [_listing(model, _STARTED) for model in router.chat_models]}
    )


async def show(request: web.Request) -> web.Response:
    await _authenticate(request)
    body = await read_json(request, SHOW_MAX_BYTES)
    try:
        wanted = validate(body, ShowRequest)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None
    model = wanted.model or wanted.name or ""
    if model not in request.app[ROUTER].chat_models:
        raise GatewayError(ErrorKind.NOT_FOUND, f"model '{model}' not found")
    kinds = _kinds(request.app[ROUTER].chat_pool(model).backends)
    capabilities = ["completion", "tools"] + (["thinking"] if "vllm" in kinds else [])
    details = _details(model)
    return web.json_response({
        "modelfile": "", "parameters": "", "template": "", "details": details,
        "model_info": {"general.architecture": details["family"],
                       "general.basename": model.rsplit("/", 1)[-1]},
        "capabilities": capabilities, "modified_at": _STARTED,
    })


async def version(request: web.Request) -> web.Response:
    await _authenticate(request)
    return web.json_response({"version": OLLAMA_VERSION})


async def ps(request: web.Request) -> web.Response:
    await _authenticate(request)
    return web.json_response({"models": []})  # nothing is loaded on demand here


async def root(request: web.Request) -> web.Response:
    await _authenticate(request)
    return web.Response(text="Ollama is running")


async def _authenticate(request: web.Request) -> None:
    """A credential that is present must be valid (the route table gives errors Ollama's
    shape)."""
    await request.app[LIVE].current.auth.principal(request.headers, request.remote)


def _kinds(backends: Sequence[Backend]) -> set[str]:
    return {backend.spec.kind for backend in backends}


def _details(model: str) -> dict[str, Any]:
    family = model.rsplit("/", 1)[-1].lower()
    size = _PARAMETER_SIZE.search(model)
    return {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
            "parameter_size": f"{size.group(1)}B" if size else "", "quantization_level": ""}


def _listing(model: str, modified_at: str) -> dict[str, Any]:
    return {"name": model, "model": model, "modified_at": modified_at, "size": 0,
            "digest": hashlib.sha256(model.encode()).hexdigest(), "details": _details(model)}
