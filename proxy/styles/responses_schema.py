"""The Responses-style request (`POST /v2/compat/v1/responses`): schema, rules, OpenAI chat form.
Pure.

OpenAI's Responses API request as msgspec Structs, validated like the other chat routes (422
items in the same shape), and `to_openai`, the chat body every engine understands: the gateway
answers the Responses API through the chat path, whatever the engine (vLLM's own /v1/responses
is not used, so TGI, Ollama and OpenAI-compatible servers answer it too). The answer's side is
in `proxy.styles.responses`.

Decisions:

- Nothing is stored: a response exists only in its answer (and the usage journal). `store` is
  accepted (the client library may send it) and answered `false`; `previous_response_id` is
  refused with a 422 saying to send the conversation itself in `input`, as a stateless client
  does. Async tasks (`async: true`) are the gateway's way to fetch an answer later.
- `input`: a string (one user message) or a list of items: messages (roles user, system,
  developer (= system), assistant; `type: "message"` optional; content a string or
  `input_text` / `input_image` (a data: URL only, as every chat route) / `output_text` parts),
  `function_call` (the model's earlier call: an assistant tool call) and `function_call_output`
  (its result: a tool message). Other item types (file search, computer use, item references)
  are refused with the list of the supported ones.
- `instructions` is the first system message; `max_output_tokens` the completion cap (and the
  hold); `tools` are function tools (`strict` passed on); `tool_choice`, `parallel_tool_calls`,
  `temperature`, `top_p`, `user` as in chat; `text.format` `json_object` is chat's
  `response_format`. `metadata` is echoed back, not sent upstream.
"""

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from proxy.styles.openai_schema import STREAM_RULES, Mode, Tokens, stream_faults
from proxy.validate import value_error

__all__ = [
    "FunctionTool",
    "InputImage",
    "InputItem",
    "InputText",
    "OutputText",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
    "ToolChoiceFunction",
    "to_openai",
    "usage_rules",
]

JSONObject = dict[str, Any]
_REFUSED_PREVIOUS = ("responses are not stored here: send the whole conversation in `input` "
                     "(earlier outputs as items) instead of previous_response_id")


class _Open(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Nested request object: extra properties are allowed and ignored."""


class _Part(_Open, tag_field="type"):
    """A content part; `type` is the tag."""


class InputText(_Part, tag="input_text"):
    text: str


class InputImage(_Part, tag="input_image"):
    image_url: Annotated[str, Meta(min_length=1, extra_json_schema={
        "pattern": "^[dD][aA][tT][aA]:",
        "description": "A data: URL (base64); the gateway forwards no other URL"})]
    detail: Literal["auto", "low", "high"] | None = None


class OutputText(_Part, tag="output_text"):
    """An earlier answer's text, sent back in an assistant message."""

    text: str


Part = InputText | InputImage | OutputText


class InputItem(_Open):
    """A message (`type` "message" or absent), a `function_call` or a `function_call_output`;
    which fields each needs is a usage rule (stated below for the document)."""

    type: Literal["message", "function_call", "function_call_output"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[Part] | None = None
    call_id: Annotated[str, Meta(min_length=1)] | None = None
    name: Annotated[str, Meta(min_length=1)] | None = None
    arguments: str | None = None
    output: str | None = None

    json_schema_rules: ClassVar[JSONObject] = {"allOf": [
        {"description": "a message item needs role and content",
         "if": {"properties": {"type": {"enum": ["message", None]}}},
         "then": {"required": ["role", "content"],
                  "properties": {"role": {"type": "string"},
                                 "content": {"type": ["string", "array"]}}}},
        {"description": "a function_call item needs call_id, name and arguments",
         "if": {"required": ["type"], "properties": {"type": {"const": "function_call"}}},
         "then": {"required": ["call_id", "name", "arguments"],
                  "properties": {"call_id": {"type": "string"}, "name": {"type": "string"},
                                 "arguments": {"type": "string"}}}},
        {"description": "a function_call_output item needs call_id and output",
         "if": {"required": ["type"],
                "properties": {"type": {"const": "function_call_output"}}},
         "then": {"required": ["call_id", "output"],
                  "properties": {"call_id": {"type": "string"}, "output": {"type": "string"}}}},
    ]}


class FunctionTool(_Open):
    type: Literal["function"]
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: Annotated[
        JSONObject | None, Meta(description="JSON Schema of the function's arguments")] = None
    strict: bool | None = None


class ToolChoiceFunction(_Open):
    type: Literal["function"]
    name: str


class TextFormat(_Open):
    type: Literal["text", "json_object"]


class TextConfig(_Open):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                       forbid_unknown_fields=True):
    """OpenAI Responses request (the fields a chat engine can honour), plus the gateway's own
    `mode` and `async`."""

    model: Annotated[str, Meta(min_length=1, description="Model identifier, case-sensitive")]
    input: Annotated[str | Annotated[list[InputItem], Meta(min_length=1)], Meta(
        description="Text (one user message) or a list of input items")]
    instructions: Annotated[str | None, Meta(description="A system message ahead of input")] \
        = None
    max_output_tokens: Annotated[Tokens | None, Meta(description="Completion-token cap")] = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: Annotated[
        bool | None,
        Meta(description="Server-Sent Events (named events); direct mode only; not with async"),
    ] = None
    store: Annotated[bool | None, Meta(description="Accepted; nothing is stored (false)")] = None
    previous_response_id: Annotated[
        str | None, Meta(description="Refused: responses are not stored; send the conversation "
                                     "in input")] = None
    metadata: Annotated[dict[str, str] | None, Meta(description="Echoed in the response")] = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    mode: Annotated[Mode | None, Meta(description="Routing mode; absent means auto")] = None
    async_: Annotated[
        bool | None, Meta(description="Return a task handle (202) instead of the response")
    ] = msgspec.field(default=None, name="async")

    json_schema_rules: ClassVar[JSONObject] = {"allOf": [
        *STREAM_RULES,
        {"description": _REFUSED_PREVIOUS,
         "properties": {"previous_response_id": {"type": "null"}}},
        {"description": "tool_choice other than none and auto needs tools",
         "anyOf": [{"properties": {"tool_choice": {"enum": [None, "none", "auto"]}}},
                   {"required": ["tools"],
                    "properties": {"tools": {"type": "array", "minItems": 1}}}]},
    ]}


def usage_rules(req: ResponsesRequest) -> list[dict[str, object]]:
    """Rules across fields (the other chat routes' wording): 422 items, [] when none."""
    faults: list[dict[str, object]] = [*stream_faults(req.stream, req.async_, req.mode)]
    if req.previous_response_id is not None:
        faults.append(value_error(("body", "previous_response_id"), _REFUSED_PREVIOUS))
    if req.tool_choice not in (None, "none", "auto") and not req.tools:
        faults.append(value_error(("body", "tool_choice"), "tool_choice needs tools"))
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        kind = item.type or "message"
        wanted = {"message": ("role", "content"),
                  "function_call": ("call_id", "name", "arguments"),
                  "function_call_output": ("call_id", "output")}[kind]
        for name in wanted:
            if getattr(item, name) is None:
                faults.append({"loc": ["body", "input", i, name], "type": "missing",
                               "msg": f"Field required (a {kind} item needs {name})"})
        for j, part in enumerate(item.content if isinstance(item.content, list) else ()):
            if isinstance(part, InputImage) and part.image_url[:5].lower() != "data:":
                faults.append({
                    "loc": ["body", "input", i, "content", j, "image_url"],
                    "type": "url_not_allowed",
                    "msg": "images are accepted inline only, as a data: URL (base64): the "
                           "gateway does not forward URLs for the model server to fetch"})
    return faults


# ---- the OpenAI chat form --------------------------------------------------------------------


def to_openai(req: ResponsesRequest) -> JSONObject:
    """The OpenAI chat body for a validated Responses request (gateway fields left out)."""
    messages: list[JSONObject] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for item in req.input:
            _add(messages, item)
    body: JSONObject = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.stream:
        body["stream"] = True
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name,
            **({"description": tool.description} if tool.description is not None else {}),
            **({"parameters": tool.parameters} if tool.parameters is not None else {}),
            **({"strict": tool.strict} if tool.strict is not None else {})}}
            for tool in req.tools]
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    if req.text is not None and req.text.format is not None \
            and req.text.format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def _add(messages: list[JSONObject], item: InputItem) -> None:
    if item.type == "function_call":  # the model's earlier call: an assistant tool call
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        elif last is not None and last["role"] == "assistant":
            last["tool_calls"] = [call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif item.type == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    else:
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": _content(item.content, role)})


def _content(content: str | list[Part] | None, role: str | None) -> object:
    if isinstance(content, str) or content is None:
        return content
    if role in ("assistant", "system"):  # text only there: the parts joined
        return "\n".join(part.text for part in content if not isinstance(part, InputImage))
    return [{"type": "image_url", "image_url": {
                "url": part.image_url, **({"detail": part.detail} if part.detail else {})}}
            if isinstance(part, InputImage) else {"type": "text", "text": part.text}
            for part in content]

