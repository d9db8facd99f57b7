"""What every client-facing chat style provides to the pipeline. Pure.

All chat upstreams speak OpenAI-compatible `/v1/chat/completions` (vLLM, TGI's Messages API,
Ollama's OpenAI dialect), so a style translates its client's dialect to an OpenAI-style body and
the OpenAI-style answer back — whole, or chunk by chunk for a stream — and renders errors the way
its clients expect.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.errors import GatewayError


@dataclass(slots=True)
class ChatCall:
    """A validated chat request, in the terms the pipeline needs."""

    model: str
    openai_body: dict[str, Any]  # the OpenAI-style body for the upstream (gateway fields removed)
    stream: bool = False
    mode: str = "auto"  # requested: auto | direct | network
    async_: bool = False
    want_usage: bool = False  # OpenAI streams: the client asked for the usage chunk
    max_tokens: int | None = None  # completion-token cap the client asked for
    cap_loc: tuple[str, ...] = ("body", "max_tokens")  # where the request named it (for 422s)
    extras: dict[str, Any] = field(default_factory=dict)  # style-specific state


class StreamEncoder(ABC):
    """Turns normalised OpenAI-style chunks into the client's stream format."""

    content_type: str = "text/event-stream; charset=utf-8"

    @abstractmethod
    def chunk(self, data: bytes) -> bytes:
        """Bytes to send for one OpenAI-style chunk (b"" to send nothing)."""

    @abstractmethod
    def end(self, usage: dict[str, Any] | None) -> bytes:
        """The normal end of the stream, given the upstream's final usage (if any)."""

    @abstractmethod
    def error(self, error: GatewayError) -> bytes:
        """One in-band error and the stream's end, once a 200 has been sent."""


# Whose error shape a route answers in: the gateway's own (OpenAI/FastAPI), Anthropic's, Ollama's.
ErrorFamily = Literal["gateway", "anthropic", "ollama"]


class ChatStyle(ABC):
    """A client-facing chat dialect."""

    name: str = "openai"
    error_family: ErrorFamily = "gateway"

    @abstractmethod
    def parse(self, body: dict[str, Any]) -> ChatCall:
        """Validate the client's JSON; raise RequestInvalid (422) or GatewayError."""

    @abstractmethod
    def response(self, completion: dict[str, Any], call: ChatCall, task_id: str, mode: str
                 ) -> dict[str, Any]:
        """The client's response body for a finished OpenAI-style completion."""

    @abstractmethod
    def encoder(self, call: ChatCall, task_id: str) -> StreamEncoder:
        """A fresh encoder for one streamed answer."""

    def error_body(self, error: GatewayError) -> bytes:
        """An HTTP error body in this style (default: the gateway's own shape)."""
        return error.json()
