"""What the OpenAPI document says of each route: its answers' bodies, statuses and headers, its
parameters and request examples (the machinery that renders them is `proxy.api.openapi`).

Each constant is one route's `Doc`; the app's route table (`proxy.app.ROUTES`) pairs it with the
route, so a route cannot exist undescribed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from proxy.api.account import ENTRY_ID_PATTERN, PAGE_MAX
from proxy.api.admin import CreateKeyBody, CreditBody
from proxy.api.ollama_discovery import ShowRequest
from proxy.api.openapi import (
    ADMIN,
    EXAMPLE_MODEL,
    JSON,
    NDJSON,
    RATE_LIMIT,
    REPLAYED,
    RETRY_AFTER,
    SSE,
    TASK_ID,
    TEXT,
    Doc,
    ErrorBody,
    Family,
    Header,
    JSONObject,
    Param,
    Params,
    Response,
    Where,
    error,
    errors,
)
from proxy.credits.idempotency import HEADER as IDEMPOTENCY_KEY
from proxy.credits.idempotency import MAX_KEY_LENGTH
from proxy.families.asr import LANGUAGE_PATTERN, AsrRequest
from proxy.families.generation import ImageRequest, VideoRequest
from proxy.families.openai_audio import SpeechRequest
from proxy.families.tts import TtsRequest
from proxy.identity.apikeys import KEY_ID_HEX, KEY_ID_PREFIX
from proxy.identity.keystore import ACCOUNT_PATTERN
from proxy.styles.anthropic_schema import MessagesRequest
from proxy.styles.ollama_schema import OllamaChatRequest
from proxy.styles.openai_schema import AsyncAccepted, ChatRequest, ChatResponse
from proxy.styles.served_schema import ServedChatRequest

# ---- response bodies (documentation: extra properties are allowed everywhere) -----------------


class Health(msgspec.Struct, kw_only=True):
    status: Literal["ok"]


class ReadyChecks(msgspec.Struct, kw_only=True):
    accepting: bool
    redis: bool
    backends: bool


class Ready(msgspec.Struct, kw_only=True):
    status: Literal["ready", "not ready"]
    checks: ReadyChecks


class Money(msgspec.Struct, kw_only=True):
    credits: Annotated[str, Meta(description="Decimal credits, 6 places")]
    micro_credits: int


class KeyView(msgspec.Struct, kw_only=True):
    id: Annotated[str, Meta(description="Key id (`key_` + 12 hex digits); never the key")]
    account: str
    tier: str
    status: Literal["active", "revoked"]
    label: str
    created: Annotated[int, Meta(description="Unix seconds")]


class CreatedKey(KeyView, kw_only=True):
    key: Annotated[str, Meta(description="The API key; shown this once only")]


class KeyList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[KeyView]


class AccountKeys(msgspec.Struct, kw_only=True):
    account: str
    keys: list[KeyView]


class CreditsAdded(msgspec.Struct, kw_only=True):
    account: str
    added: Money
    available: Money


class Reloaded(msgspec.Struct, kw_only=True):
    status: Literal["reloaded"]
    version: int


class Balance(msgspec.Struct, kw_only=True):
    available: Money
    held: Money
    spent: Money
    credited: Money


class RateLimitView(msgspec.Struct, kw_only=True):
    limit: int
    remaining: int
    reset_s: int
    per: Literal["minute"]


class AccountView(msgspec.Struct, kw_only=True):
    account: str
    tier: str
    key_id: str | None
    balance: Balance
    rate_limit: RateLimitView
    price_version: str


class UsageTotals(msgspec.Struct, kw_only=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    characters: Annotated[int, Meta(description="Speech synthesis input")]
    audio_seconds: Annotated[float, Meta(description="Speech recognition input, decoded")]
    images: int
    video_seconds: float
    cost: Money


class JournalEntry(msgspec.Struct, kw_only=True):
    """One journal entry; the fields a charge carries, and more (route, mode, latency ...)."""

    id: Annotated[str, Meta(description="Its place in the journal: a `before` for paging")]
    type: Annotated[str, Meta(description="`charge` (a hold ended), `credit`, `usage` (guests)")]
    cost: Annotated[int | None, Meta(description="Micro-credits charged")] = None
    held: Annotated[int | None, Meta(description="Micro-credits the request held")] = None
    status: Annotated[str | None, Meta(description="How the request ended")] = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    estimated: Annotated[bool | None, Meta(description="Counted by the gateway (a cut "
                                                       "stream), not reported upstream")] = None
    request_id: str | None = None
    model: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    account: str
    totals: UsageTotals
    by_model: dict[str, UsageTotals]
    by_day: Annotated[dict[str, UsageTotals], Meta(description="Keyed by UTC date, YYYY-MM-DD")]
    entries: Annotated[list[JournalEntry], Meta(description="Journal entries, newest first")]
    next_before: Annotated[str | None, Meta(description="`before` for the next page; null at "
                                                        "the end")]


class ModelInfo(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    owned_by: str
    resource: Annotated[str, Meta(description="`mode.source.model` (its first mode)")]
    resources: Annotated[list[str], Meta(description="One per mode it is offered in")]
    task_family: str
    modes: list[str]
    tiers: Annotated[dict[str, list[str]], Meta(description="Mode -> tiers that may use it")]
    price: JSONObject
    healthy: bool


class AsrSegment(msgspec.Struct, kw_only=True):
    id: int
    start: float
    end: float
    text: str


class AsrWord(msgspec.Struct, kw_only=True):
    word: str
    start: float
    end: float


class AsrAnswer(msgspec.Struct, kw_only=True):
    """The spec's ASR response, plus segments or words when `return_timestamps` asks."""

    text: str
    language: Annotated[str, Meta(description="ISO 639-1 code")]
    duration: Annotated[float, Meta(description="Seconds of audio (as the gateway decoded it)")]
    segments: Annotated[list[AsrSegment] | None,
                        Meta(description="With return_timestamps: true")] = None
    words: Annotated[list[AsrWord] | None,
                     Meta(description="With return_timestamps: \"word\"")] = None
    words_estimated: Annotated[bool | None, Meta(
        description="true: the server gave segments only; word times are spread over each "
                    "segment by character offset")] = None


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[ModelInfo]


class AnthropicMessage(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: Annotated[list[JSONObject], Meta(description="text, thinking and tool_use blocks")]
    stop_reason: str | None
    usage: JSONObject
    task_id: Annotated[str, Meta(description="`direct:<uuid>` or `network:<uuid>`")]


class OllamaAnswer(msgspec.Struct, kw_only=True):
    model: str
    created_at: str
    message: JSONObject
    done: Literal[True]
    done_reason: str
    task_id: Annotated[str, Meta(description="`direct:<uuid>` or `network:<uuid>`")]


class OllamaVersion(msgspec.Struct, kw_only=True):
    version: str


class OllamaModels(msgspec.Struct, kw_only=True):
    models: list[JSONObject]


# ---- the routes ------------------------------------------------------------------------------

_CHAT_HEADERS: Final[Params] = (
    ("header", Param(IDEMPOTENCY_KEY, {"type": "string", "minLength": 1,
                                       "maxLength": MAX_KEY_LENGTH},
                     "Retrying with the same key and body replays the first answer, charged "
                     "once; another body under the same key is refused (422)")),
)
_CHAT_ERRORS: Final = (400, 401, 402, 403, 404, 409, 413, 415, 422, 429, 502, 503, 504)
_ASYNC: Final = {202: Response("Async task accepted (`async: true`): poll `poll_url`",
                               AsyncAccepted)}
_INTEGERS: Final = ("An integer may be written 1.0 (JSON has one number); it is sent on as 1. "
                    "Integers without a bound of their own are 64-bit.")


def _sse_event(data: str, names: list[str] | None = None) -> JSONObject:
    """One Server-Sent Event as parsed: `event` ("message" when unnamed) and its `data`."""
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"enum": names} if names else {"const": "message"},
        "data": {"type": "string", "description": data}}}


OPENAI_EVENT: Final = _sse_event(
    "A `chat.completion.chunk` as JSON; `[DONE]` last. A stream that breaks after it began "
    "ends with one `{\"error\": {type, message, code}}` event, then `[DONE]`.")
ANTHROPIC_EVENT: Final = _sse_event(
    "A JSON object whose `type` repeats the event's name",
    ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
     "message_delta", "message_stop", "ping", "error"])


def _chat(summary: str, description: str, request: type, family: Family,
          ok: tuple[str, ...], example: JSONObject, ok_body: object = ChatResponse,
          extra: Mapping[int, Response] | None = None,
          event: Mapping[str, Any] | None = OPENAI_EVENT) -> Doc:
    return Doc(
        summary=summary, description=f"{description}\n\n{_INTEGERS}", request=request,
        example=example, tags=("chat",), params=_CHAT_HEADERS,
        responses={
            200: Response("The answer; a stream when asked for (see the media types)",
                          ok_body, ok, {"X-Task-Id": TASK_ID, "Idempotent-Replayed": REPLAYED,
                                        **RATE_LIMIT}, event=event),
            **(extra or {}),
            **errors(family, *_CHAT_ERRORS),
            400: error(family, 400, "The body is not JSON or not a JSON object (invalid_json), "
                                    "or the model server refused it (invalid_request)"),
            422: error(family, 422, "Schema or usage-rule failure (validation_error), every "
                                    "fault listed; also a completion cap beyond the model's "
                                    "context length, as its engines report it"),
            409: error(family, 409, headers={"Retry-After": RETRY_AFTER}),
        },
    )


_HELLO: Final = [{"role": "user", "content": "Hello!"}]

COMPAT_CHAT: Final = _chat(
    "Chat completion (OpenAI-compatible)",
    "With `stream: true` (direct mode only, not with `async`) the answer is a Server-Sent "
    "Events stream of `data: <json chunk>` lines ending with `data: [DONE]`. With `async: true` "
    "a task handle is returned (202); `GET /v2/tasks/{task_id}` gives the completion.",
    ChatRequest, "gateway", (JSON, SSE), {"model": EXAMPLE_MODEL, "messages": _HELLO},
    extra=_ASYNC,
)
SERVED_CHAT: Final = _chat(
    "Chat completion, vLLM style (OpenAI fields plus vLLM's extensions)",
    "The compat request plus vLLM's sampling, template and structured-output fields; they "
    "reach vLLM backends only. Streams as the compat route does.",
    ServedChatRequest, "gateway", (JSON, SSE), {"model": EXAMPLE_MODEL, "messages": _HELLO},
    extra=_ASYNC,
)
MESSAGES_CHAT: Final = _chat(
    "Chat, Anthropic Messages style",
    "Anthropic's Messages API (`x-api-key`, `anthropic-version` accepted); streams the full "
    "named-event sequence. Errors use Anthropic's shape.",
    MessagesRequest, "anthropic", (JSON, SSE),
    {"model": EXAMPLE_MODEL, "max_tokens": 64, "messages": _HELLO}, ok_body=AnthropicMessage,
    event=ANTHROPIC_EVENT, extra=_ASYNC,
)
NATIVE_CHAT: Final = _chat(
    "Chat, Ollama style (also at /api/native/chat)",
    "Ollama's /api/chat: NDJSON streaming on by default, the final line with `done`, "
    "`done_reason`, counts and durations in nanoseconds. Errors use Ollama's shape.",
    OllamaChatRequest, "ollama", (JSON, NDJSON),
    {"model": EXAMPLE_MODEL, "messages": _HELLO, "stream": False}, ok_body=OllamaAnswer,
    event=None,
)
MODELS: Final = Doc(
    summary="List current models",
    description="What the gateway serves, OpenAI list style, with each model's modes, task "
                "family, the tiers that may use it, its price and whether it is healthy.",
    responses={200: Response("Model list", ModelList), **errors("gateway", 401)},
    tags=("models",),
)
_TASK_ERRORS: Final = (400, 401, 402, 403, 404, 413, 415, 429, 502, 503, 504)
_TASK_HEADERS: Final = {"X-Task-Id": TASK_ID, **RATE_LIMIT}


def _task(summary: str, description: str, ok: Response, request: object,
          example: JSONObject | None, tag: str, *, async_ok: bool = True) -> Doc:
    return Doc(
        summary=summary, description=description, request=request, example=example,
        tags=(tag,),
        responses={
            200: ok,
            **(_ASYNC if async_ok else {}),
            **errors("gateway", *_TASK_ERRORS),
            422: error("gateway", 422, "Schema or usage-rule failure (validation_error), "
                                       "every fault listed"),
        },
    )


TTS: Final = _task(
    "Text to speech",
    "Speaks `text` with a preset voice, a cloned voice (`custom_voice`: the gateway fetches the "
    "sample itself, from public http(s) hosts only) or, with neither, a random preset (named in "
    "`X-Voice`). The answer is a WAV file: 16-bit PCM, mono, 24 kHz, whatever rate the model "
    "server used; a text longer than the server takes at once is spoken in pieces, split "
    "between sentences, and joined. Charged per character of `text`. With `async: true` "
    "(202) the finished task's result names the audio: `GET /v2/audio/media/{media_key}`.",
    Response("The speech, as WAV", None, "audio/wav",
             {**_TASK_HEADERS, "X-Voice": Header("The preset spoken with, or `custom`")}),
    TtsRequest, {"text": "Hello there.", "preset_voice": "Alice"}, "audio",
)
ASR: Final = _task(
    "Speech to text",
    "The gateway fetches `audio_url` (http or https, public hosts only, at most 3 redirects, "
    "25 MB and 20 s by default; every failure answers the same 422), reads its format from its "
    "content (WAV, MP3, M4A, WEBM, FLAC or OGG) and its length, and sends it to a Whisper "
    "server. Charged per second of the audio (the longer of the file's own length and the "
    "server's). ASR runs in direct mode only. No example here: a URL must answer with audio, "
    "e.g. `{\"audio_url\": \"https://media.example.com/hello.wav\"}`.",
    Response("The transcription", AsrAnswer, JSON, _TASK_HEADERS),
    AsrRequest, None, "audio",
)
IMAGE: Final = _task(
    "Image generation by a provider (Pro tier and up)",
    "The body goes to the provider as it is, minus `mode` and `async` (fields not listed here "
    "are the provider's to judge); `model` defaults to the provider's first model, `n` (1-10 "
    "by default) is the number of images held for. The provider's answer comes back as it is "
    "(OpenAI Images: `{created, data: [{b64_json}]}`). Charged per image delivered.",
    Response("The provider's answer", None, (JSON, "image/png")),
    ImageRequest, {"prompt": "a lighthouse at dusk", "n": 1}, "image",
)
VIDEO: Final = _task(
    "Text to video by a provider (Max tier)",
    "The body goes to the provider as it is, minus `mode` and `async`; `seconds` (or "
    "`duration`) is the length held for, at most 20 by default. The video comes back as the "
    "provider sent it. Charged per second of the video as decoded.",
    Response("The video", None, ("video/x-msvideo", "video/mp4", JSON)),
    VideoRequest, {"prompt": "waves on a beach", "seconds": 2}, "video",
)
OPENAI_SPEECH: Final = _task(
    "Text to speech, OpenAI style (`client.audio.speech.create`)",
    "The TTS route in OpenAI's spelling: `input`, `voice` (a preset), `speed`; the answer is WAV "
    "(16-bit PCM mono 24 kHz) or, with `response_format: \"pcm\"`, the raw samples. Charged "
    "per character.",
    Response("The speech", None, ("audio/wav", "audio/pcm"),
             {**_TASK_HEADERS, "X-Voice": Header("The preset spoken with")}),
    SpeechRequest, {"model": "acme/csm-1b", "input": "Hello there.", "voice": "alice"},
    "audio", async_ok=False,
)


def _transcription_form(task: str) -> JSONObject:
    return {
        "type": "object", "required": ["file", "model"], "additionalProperties": False,
        "properties": {
            "file": {"type": "string", "contentMediaType": "application/octet-stream",
                     "description": "WAV, MP3, M4A, WEBM, FLAC or OGG (read from the content); "
                                    "at most [fetch] max_bytes, 25 MB by default"},
            "model": {"type": "string", "minLength": 1},
            **({"language": {"type": "string", "pattern": LANGUAGE_PATTERN}}
               if task == "transcribe" else {}),
            "prompt": {"type": "string", "maxLength": 10_000},
            "response_format": {"enum": ["json", "text", "verbose_json"]},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "timestamp_granularities[]": {"type": "array",
                                          "items": {"enum": ["word", "segment"]}},
        },
    }


def _openai_transcription(task: str, summary: str) -> Doc:
    return Doc(
        summary=summary, tags=("audio",), form=_transcription_form(task),
        description="The ASR route in OpenAI's spelling, the audio uploaded (multipart) rather "
                    "than fetched. Answers `json` ({text, usage}), `text`, or `verbose_json` "
                    "(segments; words with `timestamp_granularities[]=word`). Charged per second "
                    "of audio.",
        responses={
            200: Response("The transcription", None, (JSON, TEXT), _TASK_HEADERS),
            **errors("gateway", *_TASK_ERRORS),
            422: error("gateway", 422, "A form field off OpenAI's table (validation_error), or "
                                       "a file that is not audio"),
        },
    )


OPENAI_TRANSCRIPTIONS: Final = _openai_transcription(
    "transcribe", "Speech to text, OpenAI style (`client.audio.transcriptions.create`)")
OPENAI_TRANSLATIONS: Final = _openai_transcription(
    "translate", "Speech to English text, OpenAI style (`client.audio.translations.create`)")
class TaskError(msgspec.Struct, kw_only=True):
    type: str
    message: str
    status: int


class TaskRecord(msgspec.Struct, kw_only=True):
    """A task as its owner polls it."""

    task_id: str
    status: Literal["running", "completed", "failed"]
    result: Annotated[Any, Meta(description="completed: what the synchronous call answers; "
                                            "audio and video as {media_key, media_url, "
                                            "content_type, bytes}")] = None
    error: Annotated[TaskError | None, Meta(description="failed: why")] = None
    created_at: int
    updated_at: int


TASK: Final = Doc(
    summary="Poll an async task",
    description="The task's owner only (anyone else: 404). `running` until it ends: `completed` "
                "with the result, or `failed` with the error the synchronous call would have "
                "answered. Results are kept [tasks] result_ttl_s (a day by default).",
    responses={200: Response("The task", TaskRecord), **errors("gateway", 401, 404, 503)},
    tags=("tasks",),
)
MEDIA: Final = Doc(
    summary="Fetch the audio (or video) of a finished task",
    description="The task's owner only (anyone else: 404); `Range: bytes=a-b` answers 206.",
    responses={200: Response("The media", None, ("audio/wav", "video/x-msvideo")),
               206: Response("Part of it", None, ("audio/wav", "video/x-msvideo")),
               416: Response("The range is outside the media", None, TEXT),
               **errors("gateway", 401, 404, 503)},
    tags=("tasks",),
)
TTS_PRESETS: Final = Doc(
    summary="List voice presets",
    description="The names `preset_voice` takes; open to guests and keys alike.",
    responses={200: Response("Preset names", list[str]), **errors("gateway", 401)},
    tags=("audio",),
)
_ACCOUNT_ERRORS: Final = {401: error("gateway", 401, "No key or token, or not a valid one "
                                                     "(invalid_api_key)"),
                          429: error("gateway", 429),  # counted like any request
                          503: error("gateway", 503, "The account store is unreachable")}
ACCOUNT: Final = Doc(
    summary="Your tier, balance and rate limit left",
    responses={200: Response("Account", AccountView, JSON, RATE_LIMIT), **_ACCOUNT_ERRORS},
    tags=("account",), auth_optional=False,
)
USAGE_BEFORE: Final = f"^({ENTRY_ID_PATTERN})?$"  # a journal entry id, or empty
ACCOUNT_USAGE: Final = Doc(
    summary="Usage: totals, per model, per day, and the journal (paginated)",
    responses={200: Response("Usage", Usage),
               400: error("gateway", 400, "`limit` or `before` is not valid (invalid_request)"),
               **_ACCOUNT_ERRORS},
    tags=("account",), auth_optional=False,
    params=(("query", Param("limit", {"type": "integer", "minimum": 1, "maximum": PAGE_MAX},
                            "Page size (default 50)")),
            ("query", Param("before", {"type": "string", "pattern": USAGE_BEFORE},
                            "The `next_before` of the previous page; empty or absent: the "
                            "newest page"))),
)
OPENAPI: Final = Doc(
    summary="This document", responses={200: Response("OpenAPI 3.1.0", JSONObject)},
    tags=("meta",), security=(),
)
HEALTHZ: Final = Doc(
    summary="Alive: the process answers", responses={200: Response("Alive", Health)},
    tags=("meta",), security=(), drains=False,
)
METRICS: Final = Doc(
    summary="Prometheus metrics of every worker (text exposition format; README: Monitoring)",
    responses={200: Response("The metrics", None, "text/plain; version=0.0.4")},
    tags=("meta",), security=(), drains=False,
)
READYZ: Final = Doc(
    summary="Ready: not draining, Redis answers, a backend may take traffic",
    responses={200: Response("Ready", Ready), 503: Response("Not ready", Ready)},
    tags=("meta",), security=(), drains=False,
)

_ADMIN_401: Final = Response(
    "No admin token or admin-role JWT, or not a valid one (invalid_api_key)", ErrorBody, JSON,
    {"WWW-Authenticate": Header("`Bearer`", required=True)})
_ACCOUNT_PARAM: Final[tuple[Where, Param]] = (
    "path", Param("account", {"type": "string", "pattern": ACCOUNT_PATTERN}, required=True))
_KEY_ID: Final = f"^{KEY_ID_PREFIX}[0-9a-f]{{{KEY_ID_HEX}}}$"
_KEY_ID_PARAM: Final[tuple[Where, Param]] = (
    "path", Param("key_id", {"type": "string", "pattern": _KEY_ID},
                  "The key's id (never the key)", required=True))


def _admin(summary: str, ok: Response, *errors_: int, request: object = None,
           when: Mapping[int, str] | None = None, params: Params = ()) -> Doc:
    status = 201 if request is not None else 200
    when = when or {}
    return Doc(summary=summary, request=request, params=params,
               responses={status: ok, 401: _ADMIN_401,
                          **{s: error("gateway", s, when.get(s)) for s in errors_}},
               tags=("admin",), security=(ADMIN,), auth_optional=False)


_BODY_ERRORS: Final = (400, 413, 415, 422)
# Follow-ups a client (or a stateful tester) can make with what creating a key returned.
_KEY_LINKS: Final = {
    "RevokeKey": {"operationId": "delete_admin_keys_key_id",
                  "parameters": {"key_id": "$response.body#/id"}},
    "ShowAccount": {"operationId": "get_admin_accounts_account",
                    "parameters": {"account": "$response.body#/account"}},
}
ADMIN_CREATE_KEY: Final = _admin(
    "Issue an API key (shown once)",
    Response("The key and its record", CreatedKey, JSON,
             {"Cache-Control": Header("`no-store`: the key is shown once", required=True)},
             _KEY_LINKS),
    *_BODY_ERRORS, request=CreateKeyBody,
    when={422: "Schema failure, or a tier the policies do not define (validation_error)"})
ADMIN_LIST_KEYS: Final = _admin(
    "List keys (never the keys themselves)", Response("Key records", KeyList),
    params=(("query", Param("account", {"type": "string"}, "Only this account's keys")),))
ADMIN_REVOKE_KEY: Final = _admin(
    "Revoke a key by id, everywhere at once (revoking it again changes nothing)",
    Response("The revoked record", KeyView), 404,
    when={404: "No key has this id (not_found)"}, params=(_KEY_ID_PARAM,))
ADMIN_ACCOUNT: Final = _admin(
    "An account and its keys", Response("The account", AccountKeys), 404,
    when={404: "No key was ever issued to this account (not_found)"}, params=(_ACCOUNT_PARAM,))
ADMIN_CREDITS: Final = _admin(
    "Add credits (negative: an adjustment), journaled",
    Response("Added; the balance now available", CreditsAdded), *_BODY_ERRORS, 409, 503,
    request=CreditBody, params=(_ACCOUNT_PARAM,),
    when={409: "The adjustment would take the balance below zero, or beyond what the "
               "ledger holds (conflict)", 503: "The credit store is unreachable"})
ADMIN_RELOAD: Final = Doc(
    summary="Reload policies/ (as SIGHUP does)", tags=("admin",), security=(ADMIN,),
    auth_optional=False,
    responses={200: Response("Reloaded", Reloaded), 401: _ADMIN_401,
               422: error("gateway", 422, "A policy file is invalid; the old policies stay "
                                          "(validation_error)", body=ErrorBody)})
ADMIN_BACKENDS: Final = _admin("Backends: state, health and load as this worker sees them",
                               Response("Backends", JSONObject))


def _ollama(summary: str, ok: Response, *statuses: int, request: object = None) -> Doc:
    return Doc(summary=summary, request=request, tags=("ollama",),
               responses={200: ok, **errors("ollama", 401, *statuses)})


OLLAMA_TAGS: Final = _ollama("Ollama: the chat models served", Response("Models", OllamaModels))
OLLAMA_SHOW: Final = Doc(
    summary="Ollama: one model's details", request=ShowRequest, example={"model": EXAMPLE_MODEL},
    tags=("ollama",), responses={200: Response("Details", JSONObject),
                                 **errors("ollama", 400, 401, 404, 413, 415, 422)})
OLLAMA_VERSION: Final = _ollama("Ollama: the API level these answers mirror",
                                Response("Version", OllamaVersion))
OLLAMA_PS: Final = _ollama("Ollama: loaded models (none: models stay loaded)",
                           Response("Loaded models", OllamaModels))
OLLAMA_ROOT: Final = _ollama("Ollama: \"Ollama is running\"", Response("Running", None, TEXT))
