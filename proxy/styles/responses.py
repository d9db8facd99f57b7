"""The Responses style (`POST /v2/compat/v1/responses`): OpenAI's Responses API <-> chat. Pure.

The request's schema and chat form are in `proxy.styles.responses_schema`. Here: the answer, a
`response` object, whole or as the named-event stream the official client parses
(`response.created`, `response.in_progress`, per output item `response.output_item.added`, its
deltas and `.done` events, then `response.completed`, or `response.incomplete` when the
completion cap cut it short), and errors in the gateway's (OpenAI's) shape.

- Output items: reasoning (vLLM's `reasoning`/`reasoning_content`) as a `reasoning` item, the
  text as one `message` item with one `output_text` part, each tool call as a `function_call`
  item (`call_id` the engine's own call id). Ids are `resp_`, `msg_`, `rs_`, `fc_` + the
  completion's id (and the item's index), so gateway and engine logs correlate.
- Usage: `input_tokens` (with `input_tokens_details.cached_tokens`, the engine's cached prompt
  tokens), `output_tokens`, `total_tokens`; in the final event of a stream.
- A stream that fails after its 200 ends with `response.failed`: the response with `status:
  "failed"` and `error: {code: "server_error", message, type}` (`type` the gateway's error
  type).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from proxy.errors import GatewayError
from proxy.http.sse import frame
from proxy.styles.base import ChatCall, ChatStyle, StreamEncoder
from proxy.styles.responses_schema import ResponsesRequest, to_openai, usage_rules
from proxy.styles.wire import first_choice, parse_chunk, reasoning_text, token_count
from proxy.validate import validate_with

JsonObj = dict[str, Any]


class ResponsesStyle(ChatStyle):
    name = "responses"

    def parse(self, body: dict[str, Any]) -> ChatCall:
        request = validate_with(body, ResponsesRequest, usage_rules)
        return ChatCall(
            model=request.model, openai_body=to_openai(request), stream=bool(request.stream),
            mode=request.mode or "auto", async_=bool(request.async_), want_usage=False,
            max_tokens=request.max_output_tokens, cap_loc=("body", "max_output_tokens"),
            extras={"echo": _echo(body)})

    def response(self, completion: dict[str, Any], call: ChatCall, task_id: str, mode: str
                 ) -> dict[str, Any]:
        base = _base(completion.get("id"), call, task_id)
        choice = first_choice(completion.get("choices"))
        message = choice.get("message")
        message = message if isinstance(message, dict) else {}
        output: list[JsonObj] = []
        if reasoning := reasoning_text(message):
            output.append(_reasoning_item(base["id"], reasoning))
        text = message.get("content")
        if isinstance(text, str) and text:
            output.append(_message_item(base["id"], text))
        calls = message.get("tool_calls")
        for index, tool_call in enumerate(calls if isinstance(calls, list) else ()):
            function = tool_call.get("function") if isinstance(tool_call, dict) else None
            if isinstance(function, dict):
                output.append(_call_item(base["id"], index, tool_call.get("id"),
                                         function.get("name"),
                                         arguments_text(function.get("arguments"))))
        created = completion.get("created")
        return _finished(base, output, choice.get("finish_reason"), completion.get("usage"),
                         mode, created if isinstance(created, int) else None)

    def encoder(self, call: ChatCall, task_id: str) -> StreamEncoder:
        return ResponsesEncoder(call, task_id)


# ---- the response object ---------------------------------------------------------------------


def _echo(body: JsonObj) -> JsonObj:
    """What a response repeats of its request, as the client sent it."""
    return {name: body.get(name) for name in (
        "instructions", "max_output_tokens", "metadata", "temperature", "top_p", "user")} | {
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}}}


def _id(completion_id: object) -> str:
    if isinstance(completion_id, str) and completion_id.removeprefix("chatcmpl-"):
        return completion_id.removeprefix("chatcmpl-")
    return ""


def _base(completion_id: object, call: ChatCall, task_id: str) -> JsonObj:
    # A task id is unique where an engine's completion id may not be (TGI: "").
    key = _id(completion_id) or task_id.partition(":")[2].replace("-", "")
    return {"id": f"resp_{key}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": call.model, "output": [], "error": None,
            "incomplete_details": None, "previous_response_id": None, "store": False,
            "truncation": "disabled", "usage": None, **call.extras.get("echo", {}),
            "task_id": task_id, "mode": task_id.partition(":")[0], "task_address": None}


def _finished(base: JsonObj, output: list[JsonObj], finish: object, usage: object, mode: str,
              created: int | None = None) -> JsonObj:
    cut = finish == "length"
    return {**base, **({"created_at": created} if created else {}), "output": output,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": _usage(usage), "mode": mode}


def _usage(usage: object) -> JsonObj | None:
    if not isinstance(usage, dict):
        return None
    prompt = token_count(usage, "prompt_tokens") or 0
    completion = token_count(usage, "completion_tokens") or 0
    cached = token_count(usage.get("prompt_tokens_details"), "cached_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def arguments_text(arguments: object) -> str:
    """A tool call's arguments as the Responses API carries them: JSON text."""
    if isinstance(arguments, str):
        return arguments
    return orjson.dumps(arguments if arguments is not None else {}).decode()


def _suffix(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def _message_item(response_id: str, text: str, status: str = "completed") -> JsonObj:
    return {"id": f"msg_{_suffix(response_id)}", "type": "message", "role": "assistant",
            "status": status, "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> JsonObj:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(response_id: str, text: str) -> JsonObj:
    return {"id": f"rs_{_suffix(response_id)}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(response_id: str, index: int, call_id: object, name: object, arguments: str,
               status: str = "completed") -> JsonObj:
    return {"id": f"fc_{_suffix(response_id)}_{index}", "type": "function_call",
            "status": status, "arguments": arguments,
            "call_id": call_id if isinstance(call_id, str) and call_id
            else f"call_{_suffix(response_id)}_{index}",
            "name": name if isinstance(name, str) else ""}


# ---- streams ---------------------------------------------------------------------------------


class ResponsesEncoder(StreamEncoder):
    """OpenAI chunks -> the Responses API's named events. One output item is open at a time:
    reasoning, the message's text, or one tool call (by the chunks' tool index)."""

    def __init__(self, call: ChatCall, task_id: str) -> None:
        self._call = call
        self._task_id = task_id
        self._base: JsonObj | None = None
        self._sequence = 0
        self._output: list[JsonObj] = []  # finished items
        self._open: JsonObj | None = None  # the item being streamed
        self._open_key: object = None  # "reasoning" | "text" | ("tool", index)
        self._finish: object = None

    def chunk(self, data: bytes) -> bytes:
        chunk = parse_chunk(data)
        out = [] if self._base is not None else self._start(chunk.get("id"))
        choice = first_choice(chunk.get("choices"))
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        if reasoning := reasoning_text(delta):
            out += self._reasoning(reasoning)
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._text(text)
        calls = delta.get("tool_calls")
        for tool_call in calls if isinstance(calls, list) else ():
            if isinstance(tool_call, dict):
                out += self._tool(tool_call)
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
        return b"".join(out)

    def end(self, usage: dict[str, Any] | None) -> bytes:
        out = [] if self._base is not None else self._start(None)
        out += self._close()
        assert self._base is not None
        final = _finished(self._base, self._output, self._finish, usage,
                          self._task_id.partition(":")[0])
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, {"response": final}))
        return b"".join(out)

    def error(self, error: GatewayError) -> bytes:
        out = [] if self._base is not None else self._start(None)
        assert self._base is not None
        # `code` from the Responses API's closed list (a stream breaks for the server's
        # reasons only); the gateway's own error type beside it.
        failed = {**self._base, "status": "failed", "output": self._output,
                  "error": {"code": "server_error", "message": error.message,
                            "type": error.kind.type}}
        out.append(self._event("response.failed", {"response": failed}))
        return b"".join(out)

    def _event(self, name: str, payload: JsonObj) -> bytes:
        data = orjson.dumps({"type": name, **payload, "sequence_number": self._sequence})
        self._sequence += 1
        return frame(data, event=name)

    def _start(self, completion_id: object) -> list[bytes]:
        self._base = _base(completion_id, self._call, self._task_id)
        return [self._event("response.created", {"response": self._base}),
                self._event("response.in_progress", {"response": self._base})]

    def _begin(self, key: object, item: JsonObj) -> list[bytes]:
        out = self._close()
        self._open, self._open_key = item, key
        out.append(self._event("response.output_item.added",
                               {"output_index": len(self._output), "item": item}))
        return out

    def _close(self) -> list[bytes]:
        item = self._open
        if item is None:
            return []
        self._open, self._open_key = None, None
        index = len(self._output)
        out = []
        if item["type"] == "message":
            text = item.pop("_text")
            part = _text_part(text)
            out.append(self._event("response.output_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "text": text, "logprobs": []}))
            out.append(self._event("response.content_part.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": part}))
            item["content"] = [part]
        elif item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "name": item["name"],
                "arguments": item["arguments"]}))
        elif item["type"] == "reasoning":
            text = item.pop("_text")
            out.append(self._event("response.reasoning_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "text": text}))
            item["content"] = [{"type": "reasoning_text", "text": text}]
        item["status"] = "completed"
        self._output.append(item)
        out.append(self._event("response.output_item.done",
                               {"output_index": index, "item": item}))
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        assert self._base is not None
        out: list[bytes] = []
        if self._open_key != "reasoning":
            item = {**_reasoning_item(self._base["id"], ""), "status": "in_progress",
                    "content": []}
            out += self._begin("reasoning", item)
            item["_text"] = ""
        assert self._open is not None
        self._open["_text"] += text
        out.append(self._event("response.reasoning_text.delta", {
            "item_id": self._open["id"], "output_index": len(self._output),
            "content_index": 0, "delta": text}))
        return out

    def _text(self, text: str) -> list[bytes]:
        assert self._base is not None
        out: list[bytes] = []
        if self._open_key != "text":
            item = _message_item(self._base["id"] + f"_{len(self._output)}", "", "in_progress")
            out += self._begin("text", item)
            item["_text"] = ""
            out.append(self._event("response.content_part.added", {
                "item_id": item["id"], "output_index": len(self._output), "content_index": 0,
                "part": _text_part("")}))
        assert self._open is not None
        self._open["_text"] += text
        out.append(self._event("response.output_text.delta", {
            "item_id": self._open["id"], "output_index": len(self._output),
            "content_index": 0, "delta": text, "logprobs": []}))
        return out

    def _tool(self, tool_call: JsonObj) -> list[bytes]:
        assert self._base is not None
        index = tool_call.get("index", 0)
        index = index if isinstance(index, int) else 0
        function = tool_call.get("function")
        function = function if isinstance(function, dict) else {}
        out: list[bytes] = []
        if self._open_key != ("tool", index):
            out += self._begin(("tool", index), _call_item(
                self._base["id"], index, tool_call.get("id"), function.get("name"), "",
                "in_progress"))
        assert self._open is not None
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            self._open["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", {
                "item_id": self._open["id"], "output_index": len(self._output),
                "delta": arguments}))
        return out
