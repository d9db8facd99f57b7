"""Wire schemas of the chat API (spec: "Chat request", "Chat response", 202, 422).

These msgspec Structs are the single source of truth: `validate.py` checks request bodies against
them (compiled by msgspec, no per-request schema interpretation) and `openapi.py` renders them as
OpenAPI components, so the 422 errors and the published document cannot drift apart. The usage
rules msgspec types cannot carry are Python (`chat_usage_rules`), stated beside them as JSON
Schema (`json_schema_rules`) for the document; tests/api checks that both say the same.

Conventions: every optional field defaults to None (the gateway forwards what the client sent and
does not inject the spec's documented defaults); the top-level request forbids unknown fields
(spec: "declares no properties beyond those listed"), nested objects allow them (spec: message
objects "may carry further properties"). msgspec drops those extras when converting, so handlers
forward the client's original JSON, not a re-encoded Struct.
"""

from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec
from msgspec import Meta

from proxy.credits.pricing import MEDIA_KEYS
from proxy.validate import ErrorItem, Loc, validate_with, value_error

__all__ = [
    "JSON_INT_MAX",
    "NOT_TRUE",
    "STREAM_RULES",
    "AsyncAccepted",
    "ChatMessage",
    "ChatRequest",
    "ChatResponse",
    "FunctionDefinition",
    "FunctionName",
    "JsonInt",
    "ResponseFormat",
    "StreamOptions",
    "Tool",
    "ToolChoice",
    "chat_usage_rules",
    "stream_faults",
    "validate_chat",
]

# Integer fields without a bound of their own take 64-bit integers, as OpenAI's own schema bounds
# `seed` (orjson reads larger JSON integers as floats, and msgspec bounds stop at int64).
JSON_INT_MIN: Final = -(2**63)
JSON_INT_MAX: Final = 2**63 - 1
JsonInt = Annotated[int, Meta(ge=JSON_INT_MIN, le=JSON_INT_MAX)]
# Bounds straight from the spec's chat table / Limits table.
Tokens = Annotated[int, Meta(ge=1, le=128_000)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopList = Annotated[list[str], Meta(max_length=4)]
Role = Literal["system", "user", "assistant", "tool"]
Mode = Literal["auto", "network", "direct"]
JSONObject = dict[str, Any]

# JSON Schema for "absent, null or false": what a usage rule's either/or branches say of a flag.
NOT_TRUE: Final[JSONObject] = {"enum": [False, None]}
# Rules every chat route's request shares (the usage rules say them in Python too).
STREAM_RULES: Final[list[JSONObject]] = [
    {"description": "stream cannot be combined with async",
     "anyOf": [{"properties": {"stream": NOT_TRUE}}, {"properties": {"async": NOT_TRUE}}]},
    {"description": "stream is only available in direct mode",
     "anyOf": [{"properties": {"stream": NOT_TRUE}},
               {"properties": {"mode": {"enum": ["auto", "direct", None]}}}]},
]
_TEXT_OR_PARTS: Final[JSONObject] = {"type": ["string", "array"]}
# What families/chat.check_media refuses in a content part (422), as JSON Schema: embeddings
# (by key, or vLLM's `prompt_embeds` type), a media URL other than a data: URL, a `file_id`.
_DATA_URL: Final[JSONObject] = {"type": "string", "pattern": "^[dD][aA][tT][aA]:"}
_MEDIA_VALUE: Final[JSONObject] = {"anyOf": [
    _DATA_URL,
    {"type": "object", "required": ["url"], "properties": {"url": _DATA_URL}},
    {"type": "object", "properties": {"url": {"not": {"type": "string"}}},
     "anyOf": [{"required": ["file_data"], "properties": {"file_data": {"type": "string"}}},
               {"required": ["data"], "properties": {"data": {"type": "string"}}},
               {"not": {"required": ["file_id"]}}]},
    {"not": {"type": ["string", "object"]}},
]}
_CONTENT_PART: Final[JSONObject] = {"allOf": [
    {"description": "embeddings are not accepted: send the media itself",
     "not": {"anyOf": [*({"required": [key]} for key, kind in MEDIA_KEYS.items()
                         if kind == "embeds"),
                       {"required": ["type"],
                        "properties": {"type": {"const": "prompt_embeds"}}}]}},
    *({"description": f"{key}: inline only (a data: URL or base64), not a URL or a file_id",
       "if": {"required": [key]}, "then": {"properties": {key: _MEDIA_VALUE}}}
      for key, kind in MEDIA_KEYS.items() if kind != "embeds"),
]}


class _Open(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Nested request object: extra properties are allowed (and ignored by the validator)."""


class ChatMessage(_Open):
    role: Annotated[Role, Meta(description="Author of the message")]
    content: Annotated[
        str | list[JSONObject] | None,
        Meta(description="Text, or a list of content parts; required except on assistant "
                         "messages that carry tool_calls"),
    ] = None
    tool_calls: Annotated[
        list[JSONObject] | None, Meta(description="Tool calls made by the assistant")
    ] = None
    tool_call_id: Annotated[
        str | None, Meta(description="The tool call a `tool` message answers (required there)")
    ] = None
    name: Annotated[str | None, Meta(description="Optional participant name")] = None

    # chat_usage_rules' per-message rules, as the OpenAPI document states them (openapi.py
    # merges `json_schema_rules` into the component).
    json_schema_rules: ClassVar[JSONObject] = {"allOf": [
        {"properties": {"content": {"items": _CONTENT_PART}}},
        {"description": "system, user and tool messages need content (not null)",
         "if": {"properties": {"role": {"enum": ["system", "user", "tool"]}}},
         "then": {"required": ["content"], "properties": {"content": _TEXT_OR_PARTS}}},
        {"description": "a tool message needs tool_call_id",
         "if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"],
                  "properties": {"tool_call_id": {"type": "string"}}}},
        {"description": "an assistant message needs content or tool_calls",
         "if": {"properties": {"role": {"const": "assistant"}}},
         "then": {"anyOf": [
             {"required": ["content"], "properties": {"content": _TEXT_OR_PARTS}},
             {"required": ["tool_calls"],
              "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]}},
    ]}


class ResponseFormat(_Open):
    type: Literal["json_object", "text"]


class FunctionDefinition(_Open):
    name: str
    description: str | None = None
    parameters: Annotated[
        JSONObject | None, Meta(description="JSON Schema of the function's arguments")
    ] = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Open):
    name: str


class ToolChoice(_Open):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Open):
    include_usage: Annotated[
        bool | None, Meta(description="Adds token usage to the stream")
    ] = None


class ChatRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Compat chat request; one field per row of the spec's chat table, in the table's order."""

    model: Annotated[str, Meta(min_length=1, description="Model identifier, case-sensitive")]
    messages: Annotated[list[ChatMessage], Meta(min_length=1, description="The conversation")]
    max_completion_tokens: Annotated[
        Tokens | None,
        Meta(description="Preferred over max_tokens; counts reasoning tokens too"),
    ] = None
    max_tokens: Annotated[
        Tokens | None,
        Meta(description="Deprecated: use max_completion_tokens",
             extra_json_schema={"deprecated": True}),
    ] = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stop: Annotated[str | StopList | None, Meta(description="Up to 4 stop sequences")] = None
    stream: Annotated[
        bool | None,
        Meta(description="Server-Sent Events; direct mode only; not together with async"),
    ] = None
    response_format: ResponseFormat | None = None
    seed: Annotated[JsonInt | None, Meta(description="Deterministic-output seed")] = None
    n: Annotated[int, Meta(ge=1, le=10)] | None = None
    logprobs: Annotated[bool | None, Meta(description="Return log probabilities")] = None
    top_logprobs: Annotated[
        Annotated[int, Meta(ge=0, le=20)] | None, Meta(description="Requires logprobs: true")
    ] = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoice | None = None
    stream_options: StreamOptions | None = None
    store: Annotated[bool | None, Meta(description="Store the output for later use")] = None
    user: Annotated[str | None, Meta(description="End-user id for abuse monitoring")] = None
    chat_template_kwargs: Annotated[
        JSONObject | None, Meta(description="Chat-template parameters, e.g. enable_thinking")
    ] = None
    mode: Annotated[Mode | None, Meta(description="Routing mode; absent means auto")] = None
    async_: Annotated[
        bool | None, Meta(description="Return a task handle (202) instead of the completion")
    ] = msgspec.field(default=None, name="async")

    # chat_usage_rules' request-level rules, as the OpenAPI document states them. (A named
    # tool_choice that names none of `tools` is left to the model server, which refuses it with
    # a 400: JSON Schema cannot compare values, and the document must say what we check.)
    json_schema_rules: ClassVar[JSONObject] = {"allOf": [
        *STREAM_RULES,
        {"description": "top_logprobs requires logprobs: true",
         "anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},
                   {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
        {"description": "tool_choice other than none needs tools",
         "anyOf": [{"properties": {"tool_choice": {"enum": [None, "none"]}}},
                   {"required": ["tools"],
                    "properties": {"tools": {"type": "array", "minItems": 1}}}]},
    ]}


# ---- Response side: documentation only (the gateway relays upstream bytes, it does not
# re-validate them), hence extra properties allowed everywhere.


class ChatResponse(msgspec.Struct, kw_only=True):
    id: str | None = None
    object: str = "chat.completion"
    created: Annotated[int | None, Meta(description="Unix timestamp")] = None
    model: str
    choices: list[JSONObject]
    usage: Annotated[JSONObject | None, Meta(description="Token usage statistics")] = None
    system_fingerprint: str | None = None
    task_id: Annotated[
        str | None, Meta(description="`direct:<uuid>` or `network:<uuid>`")
    ] = None
    task_address: Annotated[
        str | None, Meta(description="Redundant-execution address; network mode only")
    ] = None
    mode: Annotated[str | None, Meta(description="Execution mode used")] = None


class AsyncAccepted(msgspec.Struct, kw_only=True):
    task_id: Annotated[str, Meta(description="`direct:<uuid>` or `network:<uuid>`")]
    status: str = "running"
    poll_url: str
    message: str


# ---- usage rules and the validation entry point


def validate_chat(body: object) -> ChatRequest:
    return validate_with(body, ChatRequest, chat_usage_rules)


def stream_faults(stream: bool | None, async_: bool | None, mode: str | None
                  ) -> list[ErrorItem]:
    """STREAM_RULES, as the usage rules of every chat style say them."""
    faults: list[ErrorItem] = []
    if stream and async_:
        faults.append(value_error(("body", "stream"), "stream cannot be combined with async"))
    if stream and mode == "network":
        faults.append(value_error(("body", "stream"), "stream is only available in direct mode"))
    return faults


def chat_usage_rules(req: ChatRequest) -> list[ErrorItem]:
    """Cross-field rules of the spec and DESIGN §6, which msgspec types cannot express; the
    Structs' `json_schema_rules` state the same rules in the OpenAPI document."""
    faults = stream_faults(req.stream, req.async_, req.mode)
    if req.top_logprobs is not None and req.logprobs is not True:
        faults.append(value_error(("body", "top_logprobs"),
                                   "top_logprobs requires logprobs: true"))
    # OpenAI and vLLM refuse this too; refusing here names the field (and nothing is charged).
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        faults.append(value_error(("body", "tool_choice"), "tool_choice needs tools"))
    for i, msg in enumerate(req.messages):
        loc: Loc = ("body", "messages", i)
        if msg.role == "assistant":
            if msg.content is None and not msg.tool_calls:
                faults.append(value_error((*loc, "content"),
                                           "an assistant message needs content or tool_calls"))
        elif msg.content is None:
            faults.append({"loc": [*loc, "content"], "msg": "Field required", "type": "missing"})
        if msg.role == "tool" and msg.tool_call_id is None:
            faults.append(value_error((*loc, "tool_call_id"),
                                       "a tool message needs tool_call_id"))
    return faults
