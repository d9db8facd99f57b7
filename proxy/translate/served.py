"""The vLLM style (the served route): OpenAI-style chat plus vLLM's extensions. Pure.

The extensions reach vLLM backends only (`upstream.VLLM_ONLY_FIELDS`); other backends get the
OpenAI part of the request. Answers are relayed as the OpenAI style relays them, vLLM's
`reasoning` field included.
"""

from __future__ import annotations

from typing import Any

from proxy.schemas_served import ServedChatRequest
from proxy.translate.base import ChatCall
from proxy.translate.openai import OpenAIStyle
from proxy.validate import chat_usage_rules, validate_with


class ServedStyle(OpenAIStyle):
    name = "served"

    def parse(self, body: dict[str, Any]) -> ChatCall:
        return self.call_for(validate_with(body, ServedChatRequest, chat_usage_rules), body)
