"""Placeholder: being written (issue 6)."""

from __future__ import annotations

from typing import Any

from proxy.translate.base import ChatCall, ChatStyle, StreamEncoder


class AnthropicStyle(ChatStyle):
    name = "anthropic"

    def parse(self, body: dict[str, Any]) -> ChatCall:
        raise NotImplementedError

    def response(self, completion: dict[str, Any], call: ChatCall, task_id: str, mode: str
                 ) -> dict[str, Any]:
        raise NotImplementedError

    def encoder(self, call: ChatCall, task_id: str) -> StreamEncoder:
        raise NotImplementedError
