"""The OpenAI style (the compat route): the client already speaks the upstream's dialect. Pure.

Requests are validated against the spec's chat table and forwarded as sent (minus the gateway's
own fields); chunks pass through as bytes; the usage chunk reaches the client only when it set
`stream_options.include_usage`.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import GatewayError
from proxy.http.sse import DONE_FRAME, frame
from proxy.styles.base import ChatCall, ChatStyle, StreamEncoder
from proxy.styles.openai_schema import ChatRequest, chat_usage_rules
from proxy.validate import conform_with


class OpenAIStyle(ChatStyle):
    name = "openai"

    def parse(self, body: dict[str, Any]) -> ChatCall:
        # Forwarded as it passed: with 1.0 as 1 where it had to be, which TGI (serde) needs.
        return self.call_for(*conform_with(body, ChatRequest, chat_usage_rules))

    @staticmethod
    def call_for(request: ChatRequest, body: dict[str, Any]) -> ChatCall:
        return ChatCall(
            model=request.model,
            openai_body=body,
            stream=bool(request.stream),
            mode=request.mode or "auto",
            async_=bool(request.async_),
            want_usage=bool(request.stream_options and request.stream_options.include_usage),
            max_tokens=request.max_completion_tokens or request.max_tokens,
            cap_loc=("body", "max_completion_tokens" if request.max_completion_tokens
                     else "max_tokens"),
        )

    def response(self, completion: dict[str, Any], call: ChatCall, task_id: str, mode: str
                 ) -> dict[str, Any]:
        completion["task_id"] = task_id
        completion["mode"] = mode
        completion["task_address"] = None
        return completion

    def encoder(self, call: ChatCall, task_id: str) -> StreamEncoder:
        return OpenAIEncoder()


class OpenAIEncoder(StreamEncoder):
    def chunk(self, data: bytes) -> bytes:
        return frame(data)

    def end(self, usage: dict[str, Any] | None) -> bytes:
        return DONE_FRAME

    def error(self, error: GatewayError) -> bytes:
        return error.sse_event() + DONE_FRAME
