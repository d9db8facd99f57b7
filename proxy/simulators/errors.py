"""The errors a simulator's handlers raise; the lifecycle (`runtime`) answers each in the
server's own envelope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from aiohttp import web

# What vLLM answers (500, and as the in-band error of live streams) once its EngineCore died.
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ENGINE_DEAD_TYPE = "InternalServerError"


class HttpError(Exception):
    """Answered with the server's own JSON error envelope (`code`: OpenAI's string code)."""

    def __init__(self, status: int, message: str, error_type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type
        self.param, self.code = param, code


# A route's own error envelope; routes without one get their kind's (faults.error_response).
ErrorStyle = Callable[[HttpError], web.Response]


class BadRequest(Exception):
    """Invalid request. `level`: unparsable JSON, wrong JSON types, or bad values.

    TGI rejects the first two in axum with plain text (400 / 422) and bad values with a
    JSON 422 `validation` error; vLLM answers 400 `BadRequestError` for all three.
    """

    def __init__(self, message: str, level: Literal["syntax", "type", "value"],
                 param: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.message, self.level = message, level
        self.param, self.value = param, value
