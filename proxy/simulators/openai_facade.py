"""What the OpenAI-style media facades (`tts`, `imagegen`, `videogen`) share: field validators
that word their 400s as OpenAI does, OpenAI's error envelope and model list, the routes
around each facade's one route, and the prompt that the image and video routes both take."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from proxy.simulators.bodies import json_object, json_response
from proxy.simulators.errors import HttpError
from proxy.simulators.exchange import Exchange
from proxy.simulators.runtime import Handler, inference
from proxy.simulators.state import STATE, health_status

_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


def invalid(message: str, param: str | None, code: str | None = "invalid_value") -> HttpError:
    return HttpError(400, message, param=param, code=code)


def missing(param: str) -> HttpError:
    return invalid(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def wrong_type(param: str, expected: str, value: object) -> HttpError:
    got = _KIND_NAMES.get(type(value), "null")
    return invalid(f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
                   param, "invalid_type")


def string(body: dict[str, Any], key: str, *, required: bool = False) -> str | None:
    """`body[key]` as OpenAI validates a string field (null counts as absent)."""
    value = body.get(key)
    if value is None:
        if required:
            raise missing(key)
        return None
    if not isinstance(value, str):
        raise wrong_type(key, "a string", value)
    return value


def _check_range(key: str, kind: str, value: float, low: float, high: float, spec: str) -> None:
    """OpenAI's 400 for a `kind` of number ("decimal", "integer") outside [low, high]; `spec`
    formats the numbers in its message."""
    if value < low:
        side, code, limit = "below minimum", "below_min", f">= {low:{spec}}"
    elif value > high:
        side, code, limit = "above maximum", "above_max", f"<= {high:{spec}}"
    else:
        return
    raise invalid(f"Invalid '{key}': {kind} {side} value. Expected a value {limit}, but got "
                  f"{value:{spec}} instead.", key, f"{kind}_{code}_value")


def number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong_type(key, "a decimal", value)
    _check_range(key, "decimal", value, low, high, "g")
    return float(value)


def integer(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(key, "an integer", value)
    _check_range(key, "integer", value, low, high, "")
    return value


def known_model(ex: Exchange, model: str) -> None:
    if model not in ex.config.models:
        raise HttpError(404, f"The model `{model}` does not exist or you do not have access to "
                        "it.", "invalid_request_error", code="model_not_found")


def choice(body: dict[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = string(body, key) or default
    if value not in allowed:
        names = ", ".join(f"'{a}'" for a in allowed[:-1]) + f", and '{allowed[-1]}'"
        raise invalid(f"Invalid value: '{value}'. Supported values are: {names}.", key)
    return value


def check_length(key: str, value: str, max_length: int | None = None) -> None:
    """A string field's length as OpenAI checks it: at least 1, at most `max_length`."""
    if not value:
        raise invalid(f"Invalid '{key}': empty string. Expected a string with minimum length 1, "
                      "but got an empty string instead.", key, "empty_string")
    if max_length is not None and len(value) > max_length:
        raise invalid(f"Invalid '{key}': string too long. Expected a string with maximum "
                      f"length {max_length}, but got a string with length {len(value)} "
                      "instead.", key, "string_above_max_length")


def prompted(ex: Exchange, max_length: int | None = None) -> tuple[dict[str, Any], str]:
    """An image or video request's JSON body and its `prompt`, checked as OpenAI checks them.
    `model` defaults to the first served model, as OpenAI's image route defaults to
    dall-e-2."""
    body = json_object(ex.record.body)
    ex.model = string(body, "model") or ex.config.models[0]
    known_model(ex, ex.model)
    prompt = string(body, "prompt", required=True)
    assert prompt is not None
    check_length("prompt", prompt, max_length)
    ex.prompt_tokens = len(prompt)
    return body, prompt


def openai_error(exc: HttpError) -> web.Response:
    """OpenAI's envelope (protocols.md §1.6): all four keys, `code` a string or null."""
    if exc.error_type is not None:
        error_type = exc.error_type
    elif exc.status == 429:
        error_type = "requests"
    else:
        error_type = "server_error" if exc.status >= 500 else "invalid_request_error"
    code = exc.code or ("rate_limit_exceeded" if exc.status == 429 else None)
    body = {"error": {"message": exc.message, "type": error_type, "param": exc.param,
                      "code": code}}
    return json_response(body, status=exc.status)


async def openai_models(request: web.Request) -> web.Response:
    """OpenAI's `GET /v1/models` list, for the facades that serve one."""
    created = int(time.time())
    models = request.app[STATE].config.models
    return json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "system"}
        for model in models]})


def add_facade_routes(app: web.Application, path: str, handler: Handler) -> None:
    """The facade's route at `path` (errors in OpenAI's envelope), `/v1/models`, `/health`."""
    app.router.add_post(path, inference(handler, errors=openai_error))
    app.router.add_get("/v1/models", openai_models)
    app.router.add_get("/health", health_status)
