"""Wire schema of the Ollama-style chat request (`POST /v2/native/api/chat`, protocols.md §4)
and its cross-field rules (`usage_rules`).

msgspec Structs checked by `validate.validate`, so 422 items look like the compat route's.
Unknown fields are allowed at every level, the top level included: Ollama's own server (Go's
encoding/json) ignores them and its clients add fields release by release (`truncate`, `shift`,
...), so refusing them would break newer clients. Unknown `options` keys (Modelfile parameters
such as `num_gpu`, `mirostat`) are accepted and ignored likewise.
"""

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from proxy.styles.openai_schema import JSON_INT_MAX, JsonInt, Mode

__all__ = [
    "OllamaChatRequest",
    "OllamaFunction",
    "OllamaMessage",
    "OllamaOptions",
    "OllamaTool",
    "OllamaToolCall",
    "OllamaToolCallFunction",
    "usage_rules",
]

Role = Literal["system", "user", "assistant", "tool"]
ThinkLevel = Literal["low", "medium", "high", "max"]
# Standard base64 as Go's encoding/json reads []byte (padding required; CR/LF tolerated).
Base64 = Annotated[str, Meta(min_length=1, pattern=r"^[A-Za-z0-9+/\r\n]*={0,2}[\r\n]*$",
                             description="Base64-encoded image bytes (no data: URL prefix)")]
JSONObject = dict[str, Any]
EMPTY_MESSAGES = ("an empty messages list asks Ollama to load the model; this gateway keeps its "
                  "models loaded itself, so send at least one message")


class _Open(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Extra properties allowed (and ignored)."""


class OllamaToolCallFunction(_Open):
    name: Annotated[str, Meta(min_length=1)]
    arguments: Annotated[JSONObject, Meta(description="An object, not a JSON string")] = {}
    index: JsonInt | None = None


class OllamaToolCall(_Open):
    function: OllamaToolCallFunction
    id: str | None = None


class OllamaMessage(_Open):
    role: Role
    content: str = ""
    thinking: str | None = None
    images: list[Base64] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: Annotated[str | None, Meta(description="The tool a `tool` message answers")] = None
    tool_call_id: str | None = None

    # usage_rules' per-message rules, as the OpenAPI document states them.
    json_schema_rules: ClassVar[JSONObject] = {"allOf": [
        {"description": "images are only accepted on user messages",
         "if": {"properties": {"role": {"enum": ["system", "assistant", "tool"]}}},
         "then": {"properties": {"images": {"maxItems": 0}}}},
        {"description": "tool_calls are only accepted on assistant messages",
         "if": {"properties": {"role": {"enum": ["system", "user", "tool"]}}},
         "then": {"properties": {"tool_calls": {"maxItems": 0}}}},
    ]}


class OllamaFunction(_Open):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: JSONObject | None = None


class OllamaTool(_Open):
    function: OllamaFunction
    type: Literal["function"] = "function"


class OllamaOptions(_Open):
    """Modelfile parameters that have an OpenAI-side equivalent; other keys are ignored."""

    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[JsonInt | None, Meta(description="<= 0 disables it")] = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: JsonInt | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    num_predict: Annotated[
        Annotated[int, Meta(ge=-2, le=128_000)] | None,
        Meta(description="Max completion tokens; -1, -2 (and 0, as in Ollama) mean unlimited"),
    ] = None
    num_ctx: Annotated[int, Meta(ge=1, le=JSON_INT_MAX)] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None


class OllamaChatRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: Annotated[str, Meta(min_length=1, description="Model identifier, case-sensitive")]
    messages: Annotated[
        list[OllamaMessage], Meta(description="The conversation; must not be empty here")
    ] = []
    stream: Annotated[bool | None, Meta(description="NDJSON stream; absent means true")] = None
    format: Annotated[
        Literal["json", ""] | JSONObject | None,
        Meta(description='"json", or a JSON Schema the answer must follow'),
    ] = None
    options: OllamaOptions | None = None
    keep_alive: Annotated[
        str | float | None, Meta(description="Accepted and ignored: the operator keeps models")
    ] = None
    think: Annotated[
        bool | ThinkLevel | None, Meta(description="Thinking models: reasoning in message.thinking")
    ] = None
    tools: list[OllamaTool] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    mode: Annotated[Mode | None, Meta(description="Routing mode; absent means auto")] = None

    # usage_rules' request-level rules, as the OpenAPI document states them. `messages` has a
    # default only so that the validator can say why an empty list is refused.
    json_schema_rules: ClassVar[JSONObject] = {
        "required": ["messages"],
        "properties": {"messages": {"minItems": 1}},
        "allOf": [
            {"description": "streaming (the default) is only available in direct mode",
             "anyOf": [{"required": ["stream"], "properties": {"stream": {"const": False}}},
                       {"properties": {"mode": {"enum": ["auto", "direct", None]}}}]},
            {"description": "top_logprobs requires logprobs: true",
             "anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},
                       {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
        ],
    }


def _value_error(loc: list[str | int], text: str) -> dict[str, object]:
    return {"loc": ["body", *loc], "msg": f"Value error, {text}", "type": "value_error"}


def usage_rules(request: OllamaChatRequest) -> list[dict[str, object]]:
    """Cross-field rules a schema cannot express, as 422 items."""
    faults: list[dict[str, object]] = []
    if not request.messages:
        faults.append(_value_error(["messages"], EMPTY_MESSAGES))
    if request.stream is not False and request.mode == "network":
        faults.append(_value_error(["stream"], "streaming (the default here) is only available "
                                               "in direct mode; send stream: false"))
    if request.top_logprobs is not None and request.logprobs is not True:
        faults.append(_value_error(["top_logprobs"], "top_logprobs requires logprobs: true"))
    for i, message in enumerate(request.messages):
        if message.images and message.role != "user":
            faults.append(_value_error(["messages", i, "images"],
                                       "images are only accepted on user messages"))
        if message.tool_calls and message.role != "assistant":
            faults.append(_value_error(["messages", i, "tool_calls"],
                                       "tool_calls are only accepted on assistant messages"))
    return faults
