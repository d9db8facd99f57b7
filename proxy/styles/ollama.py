"""The Ollama style (`/v2/native/api/chat`): Ollama's chat API over OpenAI-compatible upstreams.

Pure. protocols.md §4 is the wire reference; decisions the gateway makes on this route:

- Unknown fields are ignored, as Ollama's own server does (see `proxy.styles.ollama_schema`).
- An empty `messages` list is Ollama's "load the model" call. The gateway keeps models loaded
  itself and every chat goes upstream, so it is refused with a 422 that says so.
- `keep_alive` and `options.num_ctx` are accepted and ignored: residency and context length
  belong to the operator. `options.num_predict` <= 0 means unlimited (Ollama treats -1, -2 and 0
  so); the tier's cap, if any, still applies.
- `think: true` or a level turns thinking on through vLLM's `chat_template_kwargs`; a level is
  also sent as `reasoning_effort`. Earlier turns' `thinking` is not sent back: OpenAI messages
  have no field for it, and thinking models' templates drop old reasoning anyway.
- Tool calls without an id get a deterministic one (`call_<message>_<call>`), so a conversation
  re-sent each turn renders the same prompt (prefix caching) and its `tool` answers can be
  matched: by `tool_call_id`, else by `tool_name`, else to the first unanswered call.
- Durations are nanoseconds measured by the gateway from the validated request:
  `total_duration` to the answer's end; `prompt_eval_duration` to the first generated token
  (queueing + prefill as seen from here; 0 without a stream, where that instant is invisible);
  `eval_duration` the rest; `load_duration` 0, since models are never loaded on demand.
"""

from __future__ import annotations

import binascii
import time
from typing import Any

import orjson

from proxy.errors import ErrorKind, GatewayError
from proxy.styles.base import ChatCall, ChatStyle, StreamEncoder
from proxy.styles.ollama_schema import OllamaChatRequest, OllamaMessage, OllamaOptions, usage_rules
from proxy.styles.wire import UpstreamStreamError, parse_chunk
from proxy.validate import validate_with

JsonObj = dict[str, Any]
STARTED_NS = "started_ns"  # ChatCall.extras: monotonic ns when the request was validated
NDJSON = "application/x-ndjson"
BAD_ARGUMENTS = "the model server sent tool-call arguments that are not a JSON object"
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
                (b"GIF8", "image/gif"), (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


class OllamaStyle(ChatStyle):
    name = "ollama"
    error_family = "ollama"

    def parse(self, body: dict[str, Any]) -> ChatCall:
        request = validate_with(body, OllamaChatRequest, usage_rules)
        stream = request.stream is not False  # Ollama streams unless told not to
        return ChatCall(
            model=request.model,
            openai_body=to_openai(request, body, stream),
            stream=stream,
            mode=request.mode or "auto",
            max_tokens=_max_tokens(request.options),
            cap_loc=("body", "options", "num_predict"),
            extras={STARTED_NS: time.monotonic_ns()},
        )

    def response(self, completion: dict[str, Any], call: ChatCall, task_id: str, mode: str
                 ) -> dict[str, Any]:
        choices = completion.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        choice = choice if isinstance(choice, dict) else {}
        try:
            message = ollama_message(choice.get("message"))
        except ValueError:
            raise GatewayError(ErrorKind.UPSTREAM_ERROR, BAD_ARGUMENTS) from None
        out: JsonObj = {
            "model": call.model, "created_at": created_at(), "message": message, "done": True,
            "done_reason": done_reason(choice.get("finish_reason")),
            **metrics(completion.get("usage"), call.extras.get(STARTED_NS), None),
        }
        logprobs = _logprobs(choice.get("logprobs"))
        if logprobs is not None:
            out["logprobs"] = logprobs
        out.update(task_id=task_id, mode=mode)
        return out

    def encoder(self, call: ChatCall, task_id: str) -> StreamEncoder:
        return OllamaEncoder(call.model, task_id, call.extras.get(STARTED_NS))

    def error_body(self, error: GatewayError) -> bytes:
        """Ollama's `{"error": "..."}`, plus the 422 list as `detail` for those who read it."""
        detail = {} if error.detail is None else {"detail": error.detail}
        return orjson.dumps({"error": error.message, **detail})


# ---- request -------------------------------------------------------------------------------


def to_openai(request: OllamaChatRequest, raw: JsonObj, stream: bool) -> JsonObj:
    """The OpenAI-style body for the upstream (protocols.md §4, Gateway notes)."""
    body: JsonObj = {"model": request.model, "messages": openai_messages(request.messages),
                     "stream": stream}
    if request.options is not None:
        body.update(_sampling(request.options))
    if request.format == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(request.format, dict):
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "format", "schema": request.format}}
    if request.tools:  # the client sends [] for "no tools"; OpenAI refuses an empty list
        body["tools"] = [{"type": "function", "function": tool["function"]}
                         for tool in raw["tools"]]
    if request.think is not None:
        body["chat_template_kwargs"] = {"enable_thinking": request.think is not False}
        if isinstance(request.think, str):
            body["reasoning_effort"] = "high" if request.think == "max" else request.think
    for name in ("logprobs", "top_logprobs"):
        if (value := getattr(request, name)) is not None:
            body[name] = value
    return body


def _max_tokens(options: OllamaOptions | None) -> int | None:
    limit = options.num_predict if options is not None else None
    return limit if limit is not None and limit > 0 else None


def _sampling(options: OllamaOptions) -> JsonObj:
    out: JsonObj = {}
    if (limit := _max_tokens(options)) is not None:
        out["max_tokens"] = limit
    for name in ("temperature", "top_p", "seed", "stop", "presence_penalty",
                 "frequency_penalty", "min_p"):
        value = getattr(options, name)
        if value is not None:
            out[name] = value
    if options.top_k is not None and options.top_k > 0:  # <= 0 is "off" in both dialects
        out["top_k"] = options.top_k
    if options.repeat_penalty is not None:
        out["repetition_penalty"] = options.repeat_penalty  # vLLM's name; others drop it
    return out


def openai_messages(messages: list[OllamaMessage]) -> list[JsonObj]:
    out: list[JsonObj] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of the latest turn's open calls
    by_name: dict[str, str] = {}  # tool name -> id of its latest call
    for i, message in enumerate(messages):
        if message.role == "tool":
            call_id = _answered_call(message, unanswered, by_name, i)
            out.append({"role": "tool", "tool_call_id": call_id, "content": message.content})
            continue
        item: JsonObj = {"role": message.role, "content": _content(message)}
        if message.tool_calls:
            calls = []
            unanswered = []
            for j, call in enumerate(message.tool_calls):
                call_id = call.id or f"call_{i}_{j}"
                name = call.function.name
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": name, "arguments": orjson.dumps(call.function.arguments).decode()}})
                unanswered.append((call_id, name))
                by_name[name] = call_id
            item["tool_calls"] = calls
            if not message.content:
                item["content"] = None
        out.append(item)
    return out


def _answered_call(message: OllamaMessage, unanswered: list[tuple[str, str]],
                   by_name: dict[str, str], position: int) -> str:
    """The id of the call a `tool` message answers (the client may send only the tool name)."""
    named = [c[0] for c in unanswered if c[1] == message.tool_name]
    if message.tool_call_id:
        found = message.tool_call_id
    elif named:
        found = named[0]
    elif message.tool_name in by_name:
        found = by_name[message.tool_name]
    elif unanswered:
        found = unanswered[0][0]
    else:
        found = f"call_{position}"  # answers no call we know of; the upstream decides
    unanswered[:] = [c for c in unanswered if c[0] != found]
    return found


def _content(message: OllamaMessage) -> str | list[JsonObj]:
    if not message.images:
        return message.content
    parts: list[JsonObj] = [{"type": "text", "text": message.content}] if message.content else []
    for image in message.images:
        data = image.replace("\r", "").replace("\n", "")
        url = f"data:{_image_type(data)};base64,{data}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _image_type(data: str) -> str:
    try:
        head = binascii.a2b_base64(data[:16])
    except binascii.Error:
        head = b""
    return next((kind for magic, kind in _IMAGE_MAGIC if head.startswith(magic)), "image/png")


# ---- response ------------------------------------------------------------------------------


def created_at() -> str:
    """Now as RFC 3339 in UTC with nanoseconds, as Ollama's Go server writes it."""
    seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos:09d}Z"


def done_reason(finish: object) -> str:
    return "length" if finish == "length" else "stop"  # Ollama knows no other; tools end "stop"


def metrics(usage: object, started: object, first: int | None) -> JsonObj:
    """Ollama's final counters; counts absent (not 0) when the upstream reported no usage."""
    now = time.monotonic_ns()
    total = now - started if isinstance(started, int) else 0
    prompt_eval = max(0, min(total, first - started)) if first and isinstance(started, int) else 0
    out: JsonObj = {"total_duration": total, "load_duration": 0}
    usage = usage if isinstance(usage, dict) else {}
    if isinstance(usage.get("prompt_tokens"), int):
        out["prompt_eval_count"] = usage["prompt_tokens"]
    out["prompt_eval_duration"] = prompt_eval
    if isinstance(usage.get("completion_tokens"), int):
        out["eval_count"] = usage["completion_tokens"]
    out["eval_duration"] = total - prompt_eval
    return out


def ollama_message(message: object) -> JsonObj:
    """An OpenAI assistant message as Ollama's. Raises ValueError on unusable tool arguments."""
    message = message if isinstance(message, dict) else {}
    content = message.get("content")
    out: JsonObj = {"role": "assistant", "content": content if isinstance(content, str) else ""}
    thinking = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(thinking, str) and thinking:
        out["thinking"] = thinking
    calls = [call for call in _list(message.get("tool_calls")) if isinstance(call, dict)]
    if calls:
        out["tool_calls"] = [
            ollama_tool_call(c.get("id"), _dict(c.get("function")).get("name"),
                             _dict(c.get("function")).get("arguments"), j)
            for j, c in enumerate(calls)]
    return out


def _dict(value: object) -> JsonObj:
    return value if isinstance(value, dict) else {}  # upstream JSON of the wrong shape


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def ollama_tool_call(call_id: object, name: object, arguments: object, index: int) -> JsonObj:
    return {"id": call_id if isinstance(call_id, str) and call_id else f"call_{index}",
            "function": {"index": index, "name": name if isinstance(name, str) else "",
                         "arguments": _arguments(arguments)}}


def _arguments(raw: object) -> JsonObj:
    """OpenAI's JSON-string arguments as an object (TGI may already send an object)."""
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}  # a function without parameters
    try:
        value = orjson.loads(raw) if isinstance(raw, str) else None
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(BAD_ARGUMENTS)
    return value


def _logprobs(raw: object) -> list[Any] | None:
    """OpenAI's per-token entries already have Ollama's shape (token, logprob, top_logprobs)."""
    content = raw.get("content") if isinstance(raw, dict) else None
    return content if isinstance(content, list) else None


class OllamaEncoder(StreamEncoder):
    """OpenAI chunks -> NDJSON lines; tool calls are collected and sent whole, as Ollama does."""

    content_type = NDJSON

    def __init__(self, model: str, task_id: str, started: object) -> None:
        self._model = model
        self._task_id = task_id
        self._started = started
        self._first: int | None = None  # monotonic ns of the first generated token
        self._reason = "stop"
        self._calls: dict[int, list[Any]] = {}  # tool index -> [id, name, argument pieces]

    def _line(self, message: JsonObj, **extra: Any) -> bytes:
        return orjson.dumps({"model": self._model, "created_at": created_at(),
                             "message": message, "done": False, **extra}) + b"\n"

    def chunk(self, data: bytes) -> bytes:
        choices = parse_chunk(data).get("choices")
        lines: list[bytes] = []
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # Ollama answers have one choice; n is not offered on this route
            delta = choice.get("delta")
            if isinstance(delta, dict):
                lines.append(self._delta(delta, choice.get("logprobs")))
            if choice.get("finish_reason") is not None:
                self._reason = done_reason(choice["finish_reason"])
                lines.append(self._tool_line())
        return b"".join(lines)

    def _delta(self, delta: JsonObj, logprobs: object) -> bytes:
        for call in _list(delta.get("tool_calls")):
            if isinstance(call, dict):
                self._collect(call)
        content = delta.get("content")
        thinking = delta.get("reasoning") or delta.get("reasoning_content")
        has_content = isinstance(content, str) and bool(content)
        has_thinking = isinstance(thinking, str) and bool(thinking)
        if not (has_content or has_thinking):
            return b""  # role chunks, empty finish deltas
        self._first = self._first or time.monotonic_ns()
        message: JsonObj = {"role": "assistant", "content": content if has_content else ""}
        if has_thinking:
            message["thinking"] = thinking
        extra = _logprobs(logprobs)
        return self._line(message) if extra is None else self._line(message, logprobs=extra)

    def _collect(self, call: JsonObj) -> None:
        self._first = self._first or time.monotonic_ns()
        index = call.get("index", 0)
        slot = self._calls.setdefault(index if isinstance(index, int) else 0, [None, None, []])
        function = _dict(call.get("function"))
        if isinstance(call.get("id"), str) and call["id"] and slot[0] is None:
            slot[0] = call["id"]
        if isinstance(function.get("name"), str) and function["name"] and slot[1] is None:
            slot[1] = function["name"]
        if isinstance(function.get("arguments"), str):
            slot[2].append(function["arguments"])
        elif isinstance(function.get("arguments"), dict):
            slot[2].append(orjson.dumps(function["arguments"]).decode())

    def _tool_line(self) -> bytes:
        """All collected tool calls in one line (b"" if none). Raises UpstreamStreamError."""
        if not self._calls:
            return b""
        calls, self._calls = sorted(self._calls.items()), {}
        try:
            out = [ollama_tool_call(c_id, name, "".join(pieces), j)
                   for j, (_, (c_id, name, pieces)) in enumerate(calls)]
        except ValueError:
            raise UpstreamStreamError(BAD_ARGUMENTS) from None
        return self._line({"role": "assistant", "content": "", "tool_calls": out})

    def end(self, usage: dict[str, Any] | None) -> bytes:
        try:
            tools = self._tool_line()  # calls of a stream that ended without finish_reason
        except UpstreamStreamError as exc:
            return self.error(GatewayError(ErrorKind.UPSTREAM_ERROR, exc.message))
        done = {"model": self._model, "created_at": created_at(),
                "message": {"role": "assistant", "content": ""}, "done": True,
                "done_reason": self._reason, **metrics(usage, self._started, self._first),
                "task_id": self._task_id, "mode": self._task_id.partition(":")[0]}
        return tools + orjson.dumps(done) + b"\n"

    def error(self, error: GatewayError) -> bytes:
        """Ollama's in-stream error: one `{"error": ...}` line and no done line."""
        return orjson.dumps({"error": error.message}) + b"\n"
