"""The vLLM style (the served route): OpenAI-style chat plus vLLM's extensions. Pure.

The extensions reach vLLM backends only (`upstream.VLLM_ONLY_FIELDS`); other backends get the
OpenAI part of the request. Answers are relayed as the OpenAI style relays them, vLLM's
`reasoning` field included.
"""

from __future__ import annotations

from typing import Any

from proxy.styles.base import ChatCall
from proxy.styles.openai import OpenAIStyle
from proxy.styles.openai_schema import chat_usage_rules
from proxy.styles.served_schema import ServedChatRequest
from proxy.validate import conform_with


class ServedStyle(OpenAIStyle):
    name = "served"

    def parse(self, body: dict[str, Any]) -> ChatCall:
        return self.call_for(*conform_with(body, ServedChatRequest, chat_usage_rules))
