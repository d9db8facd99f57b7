"""What the OpenAPI document says of each route: its answers' bodies, statuses and headers, its
parameters and request examples (the machinery that renders them is `proxy.api.openapi`).

Each constant is one route's `Doc`; the app's route table (`proxy.app.ROUTES`) pairs it with the
route, so a route cannot exist undescribed. The inference routes (chat in its four styles,
speech, transcription, images, video) are described here; the gateway's own routes (models,
tasks, account, admin, Ollama discovery, probes) in service_docs.py, re-exported here so that
the route table takes every `Doc` from this one module. The answers' bodies are in
response_bodies.py, the error answers in error_docs.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from proxy.api.doc_types import (
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
    Family,
    Header,
    JSONObject,
    Param,
    Params,
    Response,
)
from proxy.api.error_docs import error, errors
from proxy.api.response_bodies import (
    AnthropicMessage,
    AsrAnswer,
    EmbeddingsAnswer,
    OllamaAnswer,
    ResponseObject,
)
from proxy.api.service_docs import (
    ACCOUNT,
    ACCOUNT_USAGE,
    ADMIN_ACCOUNT,
    ADMIN_ADD_WEBHOOK,
    ADMIN_ALERT,
    ADMIN_ALERTS,
    ADMIN_BACKENDS,
    ADMIN_BUDGETS,
    ADMIN_CREATE_KEY,
    ADMIN_CREDITS,
    ADMIN_LIST_KEYS,
    ADMIN_LIST_WEBHOOKS,
    ADMIN_OVERVIEW,
    ADMIN_RELOAD,
    ADMIN_REMOVE_WEBHOOK,
    ADMIN_REVOKE_KEY,
    ADMIN_SHADOW,
    COMPAT_MODELS,
    HEALTHZ,
    MEDIA,
    METRICS,
    MODELS,
    OLLAMA_PS,
    OLLAMA_ROOT,
    OLLAMA_SHOW,
    OLLAMA_TAGS,
    OLLAMA_VERSION,
    OPENAPI,
    READYZ,
    TASK,
    TTS_PRESETS,
)
from proxy.credits.idempotency import HEADER as IDEMPOTENCY_KEY
from proxy.credits.idempotency import MAX_KEY_LENGTH
from proxy.families.asr import LANGUAGE_PATTERN, AsrRequest
from proxy.families.embed import EmbeddingsRequest
from proxy.families.generation import ImageRequest, VideoRequest
from proxy.families.openai_audio import SpeechRequest
from proxy.families.tts import TtsRequest
from proxy.styles.anthropic_schema import MessagesRequest
from proxy.styles.ollama_schema import OllamaChatRequest
from proxy.styles.openai_schema import AsyncAccepted, ChatRequest, ChatResponse
from proxy.styles.responses_schema import ResponsesRequest
from proxy.styles.served_schema import ServedChatRequest

# Every route's Doc, the gateway's own routes' from service_docs.py.
__all__ = [
    "ACCOUNT",
    "ACCOUNT_USAGE",
    "ADMIN_ACCOUNT",
    "ADMIN_ADD_WEBHOOK",
    "ADMIN_ALERT",
    "ADMIN_ALERTS",
    "ADMIN_BACKENDS",
    "ADMIN_BUDGETS",
    "ADMIN_CREATE_KEY",
    "ADMIN_CREDITS",
    "ADMIN_LIST_KEYS",
    "ADMIN_LIST_WEBHOOKS",
    "ADMIN_OVERVIEW",
    "ADMIN_RELOAD",
    "ADMIN_REMOVE_WEBHOOK",
    "ADMIN_REVOKE_KEY",
    "ADMIN_SHADOW",
    "ASR",
    "COMPAT_CHAT",
    "COMPAT_MODELS",
    "EMBEDDINGS",
    "HEALTHZ",
    "IMAGE",
    "MEDIA",
    "MESSAGES_CHAT",
    "METRICS",
    "MODELS",
    "NATIVE_CHAT",
    "OLLAMA_PS",
    "OLLAMA_ROOT",
    "OLLAMA_SHOW",
    "OLLAMA_TAGS",
    "OLLAMA_VERSION",
    "OPENAI_SPEECH",
    "OPENAI_TRANSCRIPTIONS",
    "OPENAI_TRANSLATIONS",
    "OPENAPI",
    "READYZ",
    "RESPONSES_CHAT",
    "SERVED_CHAT",
    "TASK",
    "TTS",
    "TTS_PRESETS",
    "VIDEO",
]

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

RESPONSES_EVENT: Final = _sse_event(
    "A JSON object whose `type` repeats the event's name, with a `sequence_number`",
    ["response.created", "response.in_progress", "response.output_item.added",
     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
     "response.content_part.done", "response.reasoning_text.delta",
     "response.reasoning_text.done", "response.function_call_arguments.delta",
     "response.function_call_arguments.done", "response.output_item.done",
     "response.completed", "response.incomplete", "response.failed"])


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
RESPONSES_CHAT: Final = _chat(
    "Responses API (OpenAI-compatible), answered through the chat path",
    "OpenAI's Responses API: `input` as text or items (messages, function calls and their "
    "outputs), `instructions`, `max_output_tokens`, function tools. Nothing is stored: "
    "`previous_response_id` is refused (send the conversation in `input`), `store` is answered "
    "false. With `stream: true` the answer is the named-event stream the official client "
    "parses, ending with `response.completed` (or `response.incomplete`, `response.failed`).",
    ResponsesRequest, "gateway", (JSON, SSE), {"model": EXAMPLE_MODEL, "input": "Hello!"},
    ok_body=ResponseObject, event=RESPONSES_EVENT, extra=_ASYNC,
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
    "between sentences, and joined. Charged per character of `text`, and a cloned voice's "
    "sample as `voice_sample_characters_per_s` characters a second of it (requests.toml [tts] "
    "bounds its bytes and seconds). With `async: true` "
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


EMBEDDINGS: Final = _task(
    "Embeddings, OpenAI style (`client.embeddings.create`)",
    "Vectors for a text, a list of texts, a list of token ids or a list of token-id lists, "
    "from vLLM embedding models or text-embeddings-inference servers, in the order of the "
    "inputs. `encoding_format: base64` (what the OpenAI client asks for) sends each vector as "
    "little-endian float32 bytes; `dimensions` shortens vectors of models trained for it. "
    "Charged per input token as the server counted them (`usage.prompt_tokens`, the prompt "
    "price in prices.toml) and counted in the tier's token limits. Direct mode only.",
    Response("The vectors", EmbeddingsAnswer, JSON, _TASK_HEADERS),
    EmbeddingsRequest, {"model": "acme/embed-small", "input": ["Hello there.", "Goodbye."]},
    "embeddings", async_ok=False,
)
