"""The Anthropic-style request (`POST /v2/messages/v1/messages`): schema, rules, OpenAI form. Pure.

The Messages API request (protocols.md §5) as msgspec Structs, validated by `validate.validate`
(so 422 items read like the compat route's), the cross-field rules a schema cannot say, and
`to_openai`, the OpenAI-style body the upstream gets. (The response and stream side is in
`proxy.styles.anthropic`.)

Schema conventions, as in `openai_schema.py`: the top level forbids unknown fields (Anthropic's API
refuses them too, and a silently dropped field such as a structured-output request would change
the answer without telling the client); nested objects allow extras, because clients routinely
send `cache_control` and `citations` there, which change nothing a self-hosted model does.
Content blocks and tool choices are tagged unions on `type`, so an unsupported block type
(`document`, server tools' blocks) is refused with the list of supported ones.

Translation (protocols.md §5, gateway notes): `system` becomes the first system message; text
and image blocks become OpenAI content parts (base64 images as data URLs); assistant `tool_use`
blocks become `tool_calls` (input JSON-encoded); user `tool_result` blocks become `role: "tool"`
messages ahead of whatever else that user message says. Decisions:

- `temperature` (0-1 here) is forwarded unscaled: it lies inside OpenAI's 0-2 range and means
  the same softmax temperature to vLLM and TGI, so 0.7 stays 0.7.
- `thinking` enabled (or adaptive)/disabled sets `chat_template_kwargs.enable_thinking` (vLLM
  only; other backends drop the field); absent leaves the model's default. `budget_tokens` has no
  OpenAI-compatible counterpart and is not sent. Thinking blocks a client sends back are
  dropped: OpenAI messages have no place for them.
- `tool_result.is_error` has no OpenAI counterpart and is dropped; images inside a tool result
  go into the user message after the tool messages (tool messages carry text only).
- Several text blocks in a system prompt, assistant turn or tool result are joined with "\n";
  user turns keep their blocks as content parts.
- Tool ids: responses say `toolu_<upstream id>` and requests strip the prefix again, so the
  upstream sees back exactly the ids it issued (some chat templates, e.g. Mistral's and
  Kimi's, insist on their own id format).
- `metadata.user_id` becomes OpenAI's `user`; `service_tier` and a top-level `cache_control`
  are accepted and ignored.
"""

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import orjson
from msgspec import Meta

from proxy.styles.openai_schema import JSON_INT_MAX, STREAM_RULES, Mode, Tokens, stream_faults

__all__ = [
    "Block",
    "ImageBlock",
    "Message",
    "MessagesRequest",
    "RedactedThinkingBlock",
    "SystemBlock",
    "TextBlock",
    "ThinkingAdaptive",
    "ThinkingBlock",
    "ThinkingDisabled",
    "ThinkingEnabled",
    "Tool",
    "ToolChoiceAny",
    "ToolChoiceAuto",
    "ToolChoiceNone",
    "ToolChoiceTool",
    "ToolResultBlock",
    "ToolUseBlock",
    "to_openai",
    "upstream_tool_id",
    "usage_rules",
]

JSONObject = dict[str, Any]
TOOL_ID_PREFIX = "toolu_"
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]


class _Open(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Nested request object: extra properties are allowed and ignored."""


class _Block(_Open, tag_field="type"):
    """A content block; `type` is the tag."""


class Base64Source(_Open, tag_field="type", tag="base64"):
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: Annotated[str, Meta(min_length=1)]


class URLSource(_Open, tag_field="type", tag="url"):
    # A data: URL only (usage_rules refuses others with `url_not_allowed`; the document states
    # it as a pattern, which the validator leaves to that rule and its own error type).
    url: Annotated[str, Meta(min_length=1, extra_json_schema={
        "pattern": "^[dD][aA][tT][aA]:",
        "description": "A data: URL (base64); the gateway forwards no other URL"})]


class TextBlock(_Block, tag="text"):
    text: str


class ImageBlock(_Block, tag="image"):
    source: Base64Source | URLSource


class ToolUseBlock(_Block, tag="tool_use"):
    id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    input: JSONObject


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock \
    | RedactedThinkingBlock


class Message(_Open):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[Block], Meta(description="Text, or a list of content blocks")]

    # usage_rules' block-per-role rule, as the OpenAPI document states it.
    json_schema_rules: ClassVar[JSONObject] = {"allOf": [
        {"description": f"{role} messages carry only {', '.join(kinds)} blocks",
         "if": {"properties": {"role": {"const": role}}},
         "then": {"properties": {"content": {"items": {"properties": {"type": {"enum": kinds}}}}}}}
        for role, kinds in (("user", ["text", "image", "tool_result"]),
                            ("assistant", ["text", "tool_use", "thinking", "redacted_thinking"]))
    ]}


class Tool(_Open):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    input_schema: Annotated[JSONObject, Meta(description="JSON Schema of the tool's input")]
    description: str | None = None
    type: Literal["custom"] | None = None  # server tools (web search, bash, ...) are not offered


class _Choice(_Open, tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_Choice, tag="auto"):
    pass


class ToolChoiceAny(_Choice, tag="any"):
    pass


class ToolChoiceNone(_Choice, tag="none"):
    pass


class ToolChoiceTool(_Choice, tag="tool", kw_only=True):
    name: str


class ThinkingEnabled(_Open, tag_field="type", tag="enabled"):
    budget_tokens: Annotated[
        int, Meta(ge=1, le=JSON_INT_MAX, description="Not forwarded: see the style module")]


class ThinkingAdaptive(_Open, tag_field="type", tag="adaptive"):
    """The model decides how much to think: for an open model, thinking on."""


class ThinkingDisabled(_Open, tag_field="type", tag="disabled"):
    pass


class SystemBlock(_Open):
    """A text block of the system prompt. Not the tagged TextBlock: msgspec does not require the
    tag of a tagged Struct decoded on its own, and Anthropic's API requires `type` here too."""

    type: Literal["text"]
    text: str


class Metadata(_Open):
    user_id: str | None = None


class MessagesRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                      forbid_unknown_fields=True):
    """Anthropic Messages request, plus the gateway's own `mode` and `async`."""

    model: Annotated[str, Meta(min_length=1, description="Model identifier, case-sensitive")]
    max_tokens: Annotated[Tokens, Meta(description="Completion-token cap (required)")]
    messages: Annotated[list[Message], Meta(min_length=1, description="The conversation")]
    system: str | list[SystemBlock] | None = None
    # Four, like the compat route: TGI and OpenAI upstreams refuse more.
    stop_sequences: Annotated[list[str], Meta(max_length=4)] | None = None
    temperature: Annotated[Unit | None, Meta(description="0-1; sent upstream unscaled")] = None
    top_p: Unit | None = None
    top_k: Annotated[int, Meta(ge=1, le=JSON_INT_MAX)] | None = None
    stream: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceAuto | ToolChoiceAny | ToolChoiceNone | ToolChoiceTool | None = None
    thinking: ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled | None = None
    metadata: Metadata | None = None
    # Accepted and ignored: one service tier here, and prompt caching is the upstream's own
    # (vLLM's prefix cache needs no hint).
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: JSONObject | None = None
    mode: Annotated[Mode | None, Meta(description="Routing mode; absent means auto")] = None
    async_: Annotated[
        bool | None, Meta(description="Return a task handle (202) instead of the message")
    ] = msgspec.field(default=None, name="async")

    # usage_rules' request-level rules, as the OpenAPI document states them. (A `tool` choice
    # naming none of `tools` is left to the model server, which refuses it.)
    json_schema_rules: ClassVar[JSONObject] = {"allOf": [
        *STREAM_RULES,
        {"description": "tool_choice any or tool needs tools",
         "anyOf": [{"properties": {"tool_choice": {"anyOf": [
                       {"type": "null"}, {"properties": {"type": {"enum": ["auto", "none"]}}}]}}},
                   {"required": ["tools"], "properties": {"tools": {"type": "array",
                                                                    "minItems": 1}}}]},
    ]}


_USER_ONLY = (ImageBlock, ToolResultBlock)
_ASSISTANT_ONLY = (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)


def _fault(loc: list[str | int], text: str) -> dict[str, object]:
    return {"loc": ["body", *loc], "msg": f"Value error, {text}", "type": "value_error"}


def _url_faults(block: object, loc: list[str | int]) -> list[dict[str, object]]:
    """An image (also inside a tool result) may name a data: URL only: the gateway forwards no
    URL for the model server to fetch (docs/chat-styles.md, "Media parts")."""
    inner = block.content if isinstance(block, ToolResultBlock) else None
    if isinstance(inner, list):
        return [f for k, b in enumerate(inner) for f in _url_faults(b, [*loc, "content", k])]
    if not isinstance(block, ImageBlock) or not isinstance(block.source, URLSource) \
            or block.source.url[:5].lower() == "data:":
        return []
    return [{"loc": ["body", *loc, "source", "url"], "type": "url_not_allowed",
             "msg": "images are accepted inline only (a base64 source or a data: URL): the "
                    "gateway does not forward URLs for the model server to fetch"}]


def usage_rules(req: MessagesRequest) -> list[dict[str, object]]:
    """Rules across fields (same wording as the compat route's): 422 items, [] when none."""
    faults: list[dict[str, object]] = [*stream_faults(req.stream, req.async_, req.mode)]
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            continue
        wrong = _ASSISTANT_ONLY if message.role == "user" else _USER_ONLY
        for j, block in enumerate(message.content):
            if isinstance(block, wrong):
                tag = type(block).__struct_config__.tag
                faults.append(_fault(["messages", i, "content", j, "type"],
                                     f"{tag} blocks are not allowed in {message.role} messages"))
            faults += _url_faults(block, ["messages", i, "content", j])
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not req.tools:
        faults.append(_fault(["tool_choice"], "tool_choice needs tools"))
    return faults


# ---- the OpenAI form -------------------------------------------------------------------------


def to_openai(req: MessagesRequest) -> JSONObject:
    """The OpenAI-style body for a validated Messages request (gateway fields left out)."""
    messages: list[JSONObject] = []
    system = req.system if isinstance(req.system, str) else _join(req.system or ())
    if system:
        messages.append({"role": "system", "content": system})
    for message in req.messages:
        messages.extend(_assistant(message) if message.role == "assistant" else _user(message))
    body: JSONObject = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    if req.stream:
        body["stream"] = True
    for name in ("temperature", "top_p", "top_k"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name,
            **({"description": tool.description} if tool.description is not None else {}),
            "parameters": tool.input_schema}} for tool in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if req.tools:  # OpenAI servers refuse tool_choice without tools; none/auto mean nothing
            body["tool_choice"] = (
                "auto" if isinstance(choice, ToolChoiceAuto)
                else "required" if isinstance(choice, ToolChoiceAny)
                else "none" if isinstance(choice, ToolChoiceNone)
                else {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        thinks = not isinstance(req.thinking, ThinkingDisabled)
        body["chat_template_kwargs"] = {"enable_thinking": thinks}
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    return body


def _join(blocks: Sequence[TextBlock | SystemBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def upstream_tool_id(tool_use_id: str) -> str:
    """The upstream's call id behind a `toolu_...` id (ids from elsewhere pass unchanged)."""
    return tool_use_id.removeprefix(TOOL_ID_PREFIX) or tool_use_id


def _image(block: ImageBlock) -> JSONObject:
    source = block.source
    url = source.url if isinstance(source, URLSource) else \
        f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant(message: Message) -> list[JSONObject]:
    if isinstance(message.content, str):
        return [{"role": "assistant", "content": message.content}]
    texts = [block.text for block in message.content if isinstance(block, TextBlock)]
    calls = [{"id": upstream_tool_id(block.id), "type": "function",
              "function": {"name": block.name, "arguments": orjson.dumps(block.input).decode()}}
             for block in message.content if isinstance(block, ToolUseBlock)]
    out: JSONObject = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    elif out["content"] is None:
        out["content"] = ""  # only thinking blocks: nothing for an OpenAI server to replay
    return [out]


def _user(message: Message) -> list[JSONObject]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    results: list[JSONObject] = []
    carried: list[JSONObject] = []  # images from tool results: tool messages hold only text
    parts: list[JSONObject] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image(block))
        elif isinstance(block, ToolResultBlock):
            content = block.content
            if content is None or isinstance(content, str):
                text = content or ""
            else:
                text = _join([b for b in content if isinstance(b, TextBlock)])
                carried += [_image(b) for b in content if isinstance(b, ImageBlock)]
            results.append({"role": "tool", "tool_call_id": upstream_tool_id(block.tool_use_id),
                            "content": text})
    parts = carried + parts
    if parts or not results:
        results.append({"role": "user", "content": parts})
    return results
