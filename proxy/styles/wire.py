"""The upstream side of chat: what OpenAI-compatible servers (vLLM, TGI, OpenAI) get and send. Pure.

Requests: the style's OpenAI-style body minus nulls and fields a backend kind does not take,
with `stream_options.include_usage` forced on streams so every stream can be metered.

Responses: vLLM and OpenAI already speak the client's dialect, so their stream chunks pass through
as bytes, parsed only when they may carry usage or an error. TGI's Messages API has quirks
(protocols.md §2.4) that are fixed here: an empty `id`, `finish_reason: "stop_sequence"`, tool
calls that finish with `stop`, its own `model` name.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

# Fields only the gateway reads; never sent upstream.
GATEWAY_FIELDS = frozenset({"mode", "async"})
# vLLM's request extensions (protocols.md §3.1): sent only to vLLM backends, since OpenAI
# rejects unknown fields and the others ignore or misread them.
VLLM_ONLY_FIELDS = frozenset({
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "use_beam_search", "length_penalty",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "echo", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "priority", "request_id",
    "mm_processor_kwargs", "cache_salt", "return_tokens_as_token_ids", "include_reasoning",
})

_CAP_FIELDS = frozenset({"max_tokens", "max_completion_tokens"})
_FINISH_FIXES = {"stop_sequence": "stop", "eos_token": "stop"}


class UpstreamStreamError(Exception):
    """The upstream reported an error inside a stream that had already started (HTTP 200).

    `reported`: the upstream sent an error event (else its stream could not be read or
    translated); `busy` when it said so (code 429 or 503): vLLM can refuse a stream in-band when
    its queue fills between its admission check and the request reaching the engine."""

    def __init__(self, message: str, *, reported: bool = False, busy: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.reported = reported
        self.busy = busy


def upstream_body(body: dict[str, Any], stream: bool, kind: str, cap: int,
                  priority: int | None = None, session: str | None = None) -> bytes:
    """The JSON to POST to an OpenAI-compatible backend of `kind`.

    `cap` is the completion cap the credit hold was computed with: it always goes upstream,
    whatever the client named (or did not), so no token is ever generated beyond the hold.
    OpenAI itself wants `max_completion_tokens` (its reasoning models refuse `max_tokens`); the
    servers behind the other kinds all read `max_tokens`.

    A client's own `priority` never goes upstream (it would jump the tier order in an engine
    that schedules by priority); `priority` is the gateway's, for a vLLM backend that does
    (`priority_scheduling`): lower runs earlier there. `session` names the prompt for a vLLM
    backend that publishes its KV-cache events (proxy.upstream.kv_blocks): its `session_id`
    (a client cannot send one: the OpenAI schema refuses unknown fields)."""
    drop = GATEWAY_FIELDS if kind == "vllm" else GATEWAY_FIELDS | VLLM_ONLY_FIELDS
    out = {key: value for key, value in body.items() if value is not None and key not in drop
           and key not in _CAP_FIELDS and key != "priority"}
    out["max_completion_tokens" if kind == "openai" else "max_tokens"] = cap
    if priority is not None and kind == "vllm":
        out["priority"] = priority
    if session is not None and kind == "vllm":
        out["session_id"] = session
    if stream:
        options = dict(out.get("stream_options") or {})
        options["include_usage"] = True
        out["stream_options"] = options
    # A copy: orjson hands back its whole 4 KB working buffer, and this body is kept as long
    # as the request runs (a stream's whole life); copied, a small body costs its own size.
    return bytes(memoryview(orjson.dumps(out)))


def fix_response(body: dict[str, Any], kind: str, model: str) -> dict[str, Any]:
    """Normalise a non-streaming chat completion to what OpenAI clients expect."""
    if kind == "tgi":
        if not body.get("id"):
            body["id"] = new_completion_id()
        body["model"] = model
        for choice in body.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            message = choice.get("message")
            has_tools = isinstance(message, dict) and bool(message.get("tool_calls"))
            if isinstance(message, dict) and has_tools:
                message.setdefault("content", None)
                for call in message["tool_calls"]:
                    if isinstance(call, dict):
                        call["id"] = new_call_id()  # TGI numbers every call "0"
            choice["finish_reason"] = _finish(choice.get("finish_reason"), has_tools)
    return body


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish(reason: object, saw_tool_calls: bool) -> object:
    if saw_tool_calls and reason in ("stop", "eos_token"):
        return "tool_calls"
    if isinstance(reason, str):
        return _FINISH_FIXES.get(reason, reason)
    return reason


class ChunkFilter:
    """Turns each upstream stream event's data into what the client gets (or nothing).

    Also keeps what metering needs: the usage chunk (hidden from a client that did not ask for
    it) and how many content chunks were delivered, for an estimate when a stream is cut.
    """

    __slots__ = ("_call_ids", "_completion_id", "_kind", "_model", "_tool_choices", "chunks",
                 "finished", "reasons", "text", "usage", "want_usage")

    def __init__(self, kind: str, model: str, want_usage: bool, capture: bool = False) -> None:
        self._kind = kind
        self._model = model
        self._completion_id = new_completion_id() if kind == "tgi" else ""  # TGI sends ""
        self._tool_choices: set[int] = set()
        self._call_ids: dict[tuple[int, object], str] = {}
        self.want_usage = want_usage
        self.usage: dict[str, Any] | None = None
        self.chunks = 0
        self.finished = False
        self.reasons: list[str] = []  # each choice's finish_reason, as the engine gave it
        # The first choice's text as it streams, when a trace captures content ([telemetry]).
        self.text: list[str] | None = [] if capture else None

    def feed(self, data: bytes) -> bytes | None:
        """The JSON to send for this event, or None to drop it. Raises UpstreamStreamError."""
        if self._kind == "tgi":
            return self._fix_tgi(parse_chunk(data))
        if b'"error"' in data:
            _raise_if_error(parse_chunk(data))
        if b'"usage":{' in data or b'"usage": {' in data:
            chunk = parse_chunk(data)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                self.usage = usage
                if not chunk.get("choices"):
                    return data if self.want_usage else None
        if carries_tokens(data):
            self.chunks += 1
            if self.text is not None:
                self._keep_text(parse_chunk(data))
        if b'"finish_reason":"' in data or b'"finish_reason": "' in data:
            self.finished = True
            self.reasons.extend(_finish_reasons(data))
        return data

    def _fix_tgi(self, chunk: dict[str, Any]) -> bytes | None:
        _raise_if_error(chunk)
        chunk["id"] = self._completion_id
        chunk["model"] = self._model
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if not choices and not self.want_usage:
                return None
        tokens = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                tokens = tokens or any(delta.get(k) for k in ("content", "reasoning",
                                                              "reasoning_content", "tool_calls"))
            if isinstance(delta, dict) and delta.get("tool_calls") and isinstance(index, int):
                self._tool_choices.add(index)
                self._name_tool_calls(index, delta["tool_calls"])
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finished = True
                choice["finish_reason"] = _finish(reason, index in self._tool_choices)
                self.reasons.append(str(choice["finish_reason"]))
        if tokens:
            self.chunks += 1
            if self.text is not None:
                self._keep_text(chunk)
        return orjson.dumps(chunk)

    def _keep_text(self, chunk: dict[str, Any]) -> None:
        assert self.text is not None
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                delta = choice.get("delta")
                content = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(content, str):
                    self.text.append(content)


    def _name_tool_calls(self, choice: int, calls: object) -> None:
        """TGI repeats id "0" for every call and fragment: one fresh id per (choice, call)."""
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict) and "id" in call:
                key = (choice, call.get("index", 0))
                if key not in self._call_ids:
                    self._call_ids[key] = new_call_id()
                call["id"] = self._call_ids[key]


def _finish_reasons(data: bytes) -> list[str]:
    """The finish reasons in a chunk, read off its bytes (a parse per stream end is spared)."""
    found = []
    for part in data.split(b'"finish_reason":')[1:]:
        part = part.lstrip()
        if part[:1] == b'"':
            found.append(part[1:part.find(b'"', 1)].decode("utf-8", "replace"))
    return found


def finish_reasons(completion: dict[str, Any]) -> list[str]:
    """A whole completion's finish reasons, one per choice that has one."""
    return [str(choice["finish_reason"]) for choice in completion.get("choices") or ()
            if isinstance(choice, dict) and choice.get("finish_reason") is not None]


def first_choice(choices: object) -> dict[str, Any]:
    """Choice 0 of a completion or chunk (the styles without `n` answer that one)."""
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


def reasoning_text(message: dict[str, Any]) -> str:
    """A message's or delta's reasoning (vLLM's `reasoning`, or the older `reasoning_content`)."""
    text = message.get("reasoning") or message.get("reasoning_content")
    return text if isinstance(text, str) else ""


def token_count(usage: object, name: str) -> int | None:
    """One count of an OpenAI-style `usage` object; None when absent or not an integer."""
    value = usage.get(name) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def first_text(completion: dict[str, Any]) -> list[str]:
    """A whole completion's first choice's text (a trace that captures content)."""
    message = first_choice(completion.get("choices")).get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return [content] if isinstance(content, str) else []


# A delta that carries generated text or a tool call (a role-only or empty chunk does not).
_TOKEN_MARKERS = tuple(
    field + sep for field in (b'"content"', b'"reasoning"', b'"reasoning_content"')
    for sep in (b':"', b': "')
)


def carries_tokens(data: bytes) -> bool:
    """True when a chunk delivers content (what a cut stream is charged by). Pure, on bytes."""
    if b'"tool_calls":[{' in data or b'"tool_calls": [{' in data:
        return True
    for marker in _TOKEN_MARKERS:
        at = data.find(marker)
        if at >= 0 and data[at + len(marker):at + len(marker) + 1] != b'"':
            return True
    return False


def parse_chunk(data: bytes) -> dict[str, Any]:
    """One stream event's JSON object; UpstreamStreamError when it is not one."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise UpstreamStreamError("the model server sent a malformed stream event") from None
    if not isinstance(value, dict):
        raise UpstreamStreamError("the model server sent a malformed stream event")
    return value


def _raise_if_error(chunk: dict[str, Any]) -> None:
    error = chunk.get("error")
    if error is None:
        return
    message = error.get("message") if isinstance(error, dict) else error
    text = message[:300] if isinstance(message, str) else "generation failed"
    busy = isinstance(error, dict) and error.get("code") in (429, 503)
    raise UpstreamStreamError(f"the model server failed mid-stream: {text}", reported=True,
                              busy=busy)
