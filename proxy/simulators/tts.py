"""CSM-1B behind an OpenAI TTS facade (protocols.md §7.1, §7.3): `POST /v1/audio/speech`.

The request is OpenAI's (`model`, `input` up to 4096 characters, `voice`, `response_format`,
`speed` 0.25-4.0) and errors use OpenAI's envelope. The audio is real: 16-bit mono PCM at
`--sample-rate` (24 kHz, CSM's rate; 22050 emulates Piper), as `wav` (canonical 44-byte
header) or `pcm` (raw s16le, `Content-Type: audio/pcm;rate=N` as openedai-speech labels it),
sent with `Transfer-Encoding: chunked` in a few chunks. It lasts 60 ms a character over
`speed` (at least 0.3 s), is the same for the same (text, voice, speed), and carries the text
as a watermark the whisper simulator transcribes back (`speech`).

Extension, as community CSM servers offer voice cloning: `voice_sample: {"audio": <base64
WAV>, "context_text": str}` picks the speaker from the clip instead of from `voice`.

The OpenAI-style validators here (`string`, `number`, `integer`, `choice`, `known_model`)
also serve the image and video facades, so all three word their 400s alike.

Decisions where OpenAI's docs are silent:
- `response_format` defaults to `mp3` as OpenAI's does, and the compressed formats (mp3, opus,
  aac, flac) get a 400 `unsupported_value`: a gateway test must ask for wav or pcm.
- `stream_format: "sse"` is refused the same way; `instructions` is accepted and ignored.
- `--ttft-ms` delays the first audio chunk; `x-sim-cut-after` / `x-sim-hang-after` count
  audio chunks (the first carries the WAV header), `x-sim-error-after` cuts as well (audio
  has no in-band error).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from typing import Any

from aiohttp import web

from proxy.media.wav import BadAudio, read_wav, wav_bytes
from proxy.simulators.faults import StreamEnded, before_event, pause
from proxy.simulators.runtime import (
    Exchange,
    HttpError,
    health_status,
    inference,
    json_object,
    openai_error,
    openai_models,
)
from proxy.simulators.speech import (
    DEFAULT_VOICES,
    Speaker,
    sample_speaker,
    synthesize,
    voice_speaker,
)

MAX_INPUT = 4096  # OpenAI's limit on `input`
RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
SUPPORTED_FORMATS = ("wav", "pcm")
MIN_SPEED, MAX_SPEED = 0.25, 4.0
CHUNKS = 4  # the body goes out in this many chunked-encoding chunks

_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


def invalid(message: str, param: str | None, code: str | None = "invalid_value") -> HttpError:
    return HttpError(400, message, param=param, code=code)


def missing(param: str) -> HttpError:
    return invalid(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def wrong_type(param: str, expected: str, value: object) -> HttpError:
    got = _KIND_NAMES.get(type(value), "null")
    return invalid(f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
                   param, "invalid_type")


def string(body: dict[str, Any], key: str, *, required: bool = False) -> str | None:
    """`body[key]` as OpenAI validates a string field (null counts as absent)."""
    value = body.get(key)
    if value is None:
        if required:
            raise missing(key)
        return None
    if not isinstance(value, str):
        raise wrong_type(key, "a string", value)
    return value


def number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong_type(key, "a decimal", value)
    if value < low:
        raise invalid(f"Invalid '{key}': decimal below minimum value. Expected a value >= "
                      f"{low:g}, but got {value:g} instead.", key, "decimal_below_min_value")
    if value > high:
        raise invalid(f"Invalid '{key}': decimal above maximum value. Expected a value <= "
                      f"{high:g}, but got {value:g} instead.", key, "decimal_above_max_value")
    return float(value)


def integer(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(key, "an integer", value)
    if value < low:
        raise invalid(f"Invalid '{key}': integer below minimum value. Expected a value >= "
                      f"{low}, but got {value} instead.", key, "integer_below_min_value")
    if value > high:
        raise invalid(f"Invalid '{key}': integer above maximum value. Expected a value <= "
                      f"{high}, but got {value} instead.", key, "integer_above_max_value")
    return value


def known_model(ex: Exchange, model: str) -> None:
    if model not in ex.config.models:
        raise HttpError(404, f"The model `{model}` does not exist or you do not have access to "
                        "it.", "invalid_request_error", code="model_not_found")


def choice(body: dict[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = string(body, key) or default
    if value not in allowed:
        names = ", ".join(f"'{a}'" for a in allowed[:-1]) + f", and '{allowed[-1]}'"
        raise invalid(f"Invalid value: '{value}'. Supported values are: {names}.", key)
    return value


def _cloned(body: dict[str, Any]) -> Speaker | None:
    sample = body.get("voice_sample")
    if sample is None:
        return None
    if not isinstance(sample, dict):
        raise wrong_type("voice_sample", "an object", sample)
    audio, context = sample.get("audio"), sample.get("context_text")
    if not isinstance(audio, str) or not isinstance(context, str | None):
        # context_text is only type-checked: it would condition the real model's prosody.
        raise invalid("Invalid 'voice_sample': expected {\"audio\": <base64 WAV>, "
                      "\"context_text\": <string>}.", "voice_sample")
    try:
        pcm = read_wav(base64.b64decode(audio, validate=True))
    except (binascii.Error, ValueError, BadAudio) as exc:
        raise invalid(f"Invalid 'voice_sample.audio': expected a base64-encoded WAV file "
                      f"({exc}).", "voice_sample") from None
    if pcm.frames == 0:
        raise invalid("Invalid 'voice_sample.audio': the WAV file has no samples.",
                      "voice_sample")
    return sample_speaker(pcm.data)


async def speech(ex: Exchange) -> web.StreamResponse:
    body = json_object(ex.record.body)
    model = string(body, "model", required=True)
    text = string(body, "input", required=True)
    voice = string(body, "voice", required=True)
    assert model is not None and text is not None and voice is not None
    known_model(ex, model)
    ex.model = model
    if not text:
        raise invalid("Invalid 'input': empty string. Expected a string with minimum length 1, "
                      "but got an empty string instead.", "input", "empty_string")
    if len(text) > MAX_INPUT:
        raise invalid(f"Invalid 'input': string too long. Expected a string with maximum "
                      f"length {MAX_INPUT}, but got a string with length {len(text)} instead.",
                      "input", "string_above_max_length")
    voices = ex.config.voices or DEFAULT_VOICES
    if voice not in voices:
        raise invalid(f"Invalid value for 'voice': '{voice}'. Supported voices are: "
                      f"{', '.join(voices)}.", "voice")
    fmt = choice(body, "response_format", "mp3", RESPONSE_FORMATS)
    if fmt not in SUPPORTED_FORMATS:
        raise invalid(f"response_format '{fmt}' is not supported by this simulator; use 'wav' "
                      "or 'pcm'.", "response_format", "unsupported_value")
    if choice(body, "stream_format", "audio", ("audio", "sse")) == "sse":
        raise invalid("stream_format 'sse' is not supported by this simulator.",
                      "stream_format", "unsupported_value")
    speed = number(body, "speed", 1.0, MIN_SPEED, MAX_SPEED)
    string(body, "instructions")
    speaker = _cloned(body) or voice_speaker(voice)
    rate = ex.config.sample_rate
    # Up to 16 minutes of audio (4096 characters at speed 0.25) takes seconds of numpy work:
    # in a thread, so the server keeps answering meanwhile.
    loop = asyncio.get_running_loop()
    samples = await loop.run_in_executor(None, synthesize, text, speaker, speed, rate)
    ex.prompt_tokens = len(text)
    if fmt == "wav":
        payload, content_type = wav_bytes(samples, rate), "audio/wav"
    else:
        payload, content_type = samples, f"audio/pcm;rate={rate}"
    return await send_chunked(ex, payload, content_type)


async def send_chunked(ex: Exchange, payload: bytes, content_type: str) -> web.StreamResponse:
    """Write `payload` in CHUNKS chunks (after `--ttft-ms`), honouring the stream faults."""
    request = ex.request
    if ex.config.ttft_s > 0:
        await pause(request, ex.config.ttft_s)
    response = web.StreamResponse(headers={"Content-Type": content_type})
    response.enable_chunked_encoding()
    ex.stream = response
    await response.prepare(request)
    step = -(-len(payload) // CHUNKS) or 1
    for sent, offset in enumerate(range(0, len(payload), step)):
        if await before_event(request, ex.faults, sent):
            if request.transport is not None:
                request.transport.close()
            raise StreamEnded("cut")
        await response.write(payload[offset : offset + step])
        if ex.first_token is None:
            ex.first_token = time.monotonic()
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", inference(speech, errors=openai_error))
    app.router.add_get("/v1/models", openai_models)
    app.router.add_get("/health", health_status)
