"""The Anthropic style (`POST /v2/messages/v1/messages`): Messages API <-> OpenAI chat. Pure.

The request's schema, rules and OpenAI form are in `proxy.styles.anthropic_schema` (with the request
decisions: unknown top-level fields refused, temperature unscaled, thinking and tool ids).
Here: the answer, whole or streamed, and errors, in the shapes the Anthropic SDK reads.

- Reasoning (`reasoning`, or the older `reasoning_content`) becomes a leading `thinking` block
  with an empty `signature`: nothing here can sign it, and the block is dropped when sent back.
- `stop_sequence` is reported only when the upstream names the matched string (vLLM's
  `stop_reason`); TGI does not, so its stops read `end_turn`.
- Streams: `message_start` carries `input_tokens: 0` because the prompt count is known only
  from the upstream's final usage; `message_delta` then reports it with `output_tokens`
  (cumulative, as Anthropic's are), and the SDK overwrites the start value with it.
- Cached prompt tokens (the engine's `prompt_tokens_details.cached_tokens`) are Anthropic's
  `cache_read_input_tokens`; as Anthropic counts them, `input_tokens` is then the rest of the
  prompt (the three input counts add up to the prompt). Cache writes are not reported: 0.
- Errors: the gateway's kinds map onto Anthropic's `error.type`s (503 stays 503, where Anthropic
  would say 529); `detail` is kept as an extra field, the 422 list included, so FastAPI-style
  clients read these errors too.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import orjson

from proxy.errors import ErrorKind, GatewayError
from proxy.http.sse import frame
from proxy.styles.anthropic_schema import TOOL_ID_PREFIX, MessagesRequest, to_openai, usage_rules
from proxy.styles.base import ChatCall, ChatStyle, StreamEncoder
from proxy.styles.wire import first_choice, parse_chunk, reasoning_text, token_count
from proxy.validate import validate_with

JsonObj = dict[str, Any]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "function_call": "tool_use", "content_filter": "refusal"}
# protocols.md §5.2; other 4xx are invalid_request_error, other 5xx api_error.
_ERROR_TYPES = {
    ErrorKind.INVALID_API_KEY: "authentication_error",
    ErrorKind.INSUFFICIENT_CREDITS: "billing_error",
    ErrorKind.BUDGET_EXCEEDED: "billing_error",
    ErrorKind.FORBIDDEN: "permission_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.PAYLOAD_TOO_LARGE: "request_too_large",
    ErrorKind.RATE_LIMITED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "overloaded_error",  # Anthropic says 529; the status stays 503
    ErrorKind.UPSTREAM_TIMEOUT: "timeout_error",
}


class AnthropicStyle(ChatStyle):
    name = "anthropic"
    error_family = "anthropic"

    def parse(self, body: dict[str, Any]) -> ChatCall:
        request = validate_with(body, MessagesRequest, usage_rules)
        return ChatCall(
            model=request.model,
            openai_body=to_openai(request),
            stream=bool(request.stream),
            mode=request.mode or "auto",
            async_=bool(request.async_),
            want_usage=False,
            max_tokens=request.max_tokens,
            extras={"stop_sequences": tuple(request.stop_sequences or ())},
        )

    def response(self, completion: dict[str, Any], call: ChatCall, task_id: str, mode: str
                 ) -> dict[str, Any]:
        message = to_message(completion, call.model, call.extras.get("stop_sequences", ()))
        # Gateway extras as top-level fields: the SDK keeps unknown fields on the model.
        message.update(task_id=task_id, mode=mode, task_address=None)
        return message

    def encoder(self, call: ChatCall, task_id: str) -> StreamEncoder:
        return AnthropicEncoder(call.model, task_id, call.extras.get("stop_sequences", ()))

    def error_body(self, error: GatewayError) -> bytes:
        return orjson.dumps({
            "type": "error",
            "error": {"type": error_type(error.kind), "message": error.message},
            # FastAPI-style clients read `detail` (the 422 list, else the message).
            "detail": error.detail if error.detail is not None else error.message,
        })


def error_type(kind: ErrorKind) -> str:
    return _ERROR_TYPES.get(kind, "invalid_request_error" if kind.status < 500 else "api_error")


# ---- response: OpenAI -> Anthropic ---------------------------------------------------------


class _ToolIds:
    """`toolu_<upstream id>`, unique within one message (TGI numbers every call "0")."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, upstream_id: object) -> str:
        base = upstream_id if isinstance(upstream_id, str) and upstream_id else uuid.uuid4().hex
        candidate, n = base, 1
        while candidate in self._seen:
            candidate, n = f"{base}_{n}", n + 1
        self._seen.add(candidate)
        return TOOL_ID_PREFIX + candidate


def message_id(completion_id: object) -> str:
    """`msg_` + the completion's own id, so gateway and upstream logs correlate."""
    if isinstance(completion_id, str) and completion_id.removeprefix("chatcmpl-"):
        return "msg_" + completion_id.removeprefix("chatcmpl-")
    return "msg_" + uuid.uuid4().hex


def stop_reason(finish: object, matched: object, tools_called: bool,
                stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`) for an OpenAI finish reason."""
    if tools_called and finish in (None, "stop", "tool_calls"):
        return "tool_use", None
    if finish == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    # vLLM's "abort" and unknown values: the turn ended, for no reason Anthropic names.
    reason = _STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn"
    return reason, None


def tool_input(arguments: object) -> JsonObj:
    """The parsed `arguments` object; text that is not one is kept rather than lost."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"raw_arguments": arguments}


def _input(usage: object) -> tuple[int, int] | None:
    """(`input_tokens`, `cache_read_input_tokens`) from OpenAI-style usage; None if unknown."""
    prompt = token_count(usage, "prompt_tokens")
    if prompt is None:
        return None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = min(max(token_count(details, "cached_tokens") or 0, 0), prompt)
    return prompt - cached, cached


def to_message(completion: JsonObj, model: str, stop_sequences: Sequence[str]) -> JsonObj:
    """An Anthropic Message for a finished OpenAI chat completion."""
    choice = first_choice(completion.get("choices"))
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    content: list[JsonObj] = []
    if reasoning := reasoning_text(message):
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    ids = _ToolIds()
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        name = function.get("name")
        content.append({"type": "tool_use", "id": ids(call.get("id")),
                        "name": name if isinstance(name, str) else "",
                        "input": tool_input(function.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   any(b["type"] == "tool_use" for b in content), stop_sequences)
    usage = completion.get("usage")
    fresh, cached = _input(usage) or (0, 0)
    return {
        "id": message_id(completion.get("id")), "type": "message", "role": "assistant",
        "model": model, "content": content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": {"input_tokens": fresh,
                  "output_tokens": token_count(usage, "completion_tokens") or 0,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached},
    }


# ---- streams -------------------------------------------------------------------------------


def _event(name: str, payload: JsonObj) -> bytes:
    return frame(orjson.dumps({"type": name, **payload}), event=name)


_PING = _event("ping", {})


class AnthropicEncoder(StreamEncoder):
    """OpenAI chunks -> `message_start`, content blocks, `message_delta`, `message_stop`.

    One block is open at a time: a delta of another kind (thinking, text, tool call index)
    closes it and starts the next. A fragment for a tool call whose block was already closed
    (interleaved parallel calls, which OpenAI servers do not send in practice) still goes to
    that block's index, where the SDK accumulates it.
    """

    def __init__(self, model: str, task_id: str, stop_sequences: Sequence[str]) -> None:
        self._model = model
        self._task_id = task_id
        self._stops = stop_sequences
        self._started = False
        self._open: object = None  # "thinking" | "text" | ("tool", openai index) | None
        self._blocks = 0
        self._tools: dict[int, int] = {}  # OpenAI tool index -> block index
        self._ids = _ToolIds()
        self._finish: object = None
        self._matched: object = None
        self._deltas = 0  # output estimate should the upstream send no usage

    def chunk(self, data: bytes) -> bytes:
        chunk = parse_chunk(data)
        out = [] if self._started else [self._start(chunk.get("id"))]
        choice = first_choice(chunk.get("choices"))
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        if reasoning := reasoning_text(delta):
            out += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                               {"type": "thinking_delta", "thinking": reasoning})
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._delta("text", {"type": "text", "text": ""},
                               {"type": "text_delta", "text": text})
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                out += self._tool(call)
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
            self._matched = choice.get("stop_reason")
        return b"".join(out)

    def end(self, usage: dict[str, Any] | None) -> bytes:
        out = [] if self._started else [self._start(None)]
        out.append(self._close())
        reason, sequence = stop_reason(self._finish, self._matched, bool(self._tools),
                                       self._stops)
        output = token_count(usage, "completion_tokens")
        counts: JsonObj = {"output_tokens": self._deltas if output is None else output}
        if (prompt := _input(usage)) is not None:
            counts["input_tokens"], counts["cache_read_input_tokens"] = prompt
        out.append(_event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": counts}))
        out.append(_event("message_stop", {}))
        return b"".join(out)

    def error(self, error: GatewayError) -> bytes:
        # Anthropic ends a failed stream with the error event alone: no block stop, no
        # message_stop (the SDK raises on it).
        return _event("error", {"error": {"type": error_type(error.kind),
                                          "message": error.message}})

    def _start(self, completion_id: object) -> bytes:
        self._started = True
        return _event("message_start", {"message": {
            "id": message_id(completion_id), "type": "message", "role": "assistant",
            "model": self._model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0},
            # As on the whole answer; a stream always ran in the mode its task id names.
            "task_id": self._task_id, "mode": self._task_id.partition(":")[0],
            "task_address": None,
        }})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"index": self._blocks - 1})

    def _begin(self, key: object, block: JsonObj) -> list[bytes]:
        """Frames that close the open block and start `block` (ping after the first)."""
        out = [self._close(), _event("content_block_start",
                                     {"index": self._blocks, "content_block": block})]
        if self._blocks == 0:
            out.append(_PING)
        self._open = key
        self._blocks += 1
        return out

    def _delta(self, key: str, block: JsonObj, delta: JsonObj) -> list[bytes]:
        out = [] if self._open == key else self._begin(key, block)
        self._deltas += 1
        out.append(_event("content_block_delta", {"index": self._blocks - 1, "delta": delta}))
        return out

    def _tool(self, call: JsonObj) -> list[bytes]:
        index = call.get("index", 0)
        index = index if isinstance(index, int) else 0
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        out: list[bytes] = []
        if index not in self._tools:
            name = function.get("name")
            out += self._begin(("tool", index), {
                "type": "tool_use", "id": self._ids(call.get("id")),
                "name": name if isinstance(name, str) else "", "input": {}})
            self._tools[index] = self._blocks - 1
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            self._deltas += 1
            out.append(_event("content_block_delta", {
                "index": self._tools[index],
                "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return out
