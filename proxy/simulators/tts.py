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

Validators, envelope and the routes around `/v1/audio/speech` are `openai_facade`'s, shared
with the image and video facades, so all three word their 400s alike.

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
from proxy.simulators.bodies import json_object
from proxy.simulators.exchange import Exchange
from proxy.simulators.faults import StreamEnded, before_event
from proxy.simulators.openai_facade import (
    add_facade_routes,
    check_length,
    choice,
    invalid,
    known_model,
    number,
    string,
    wrong_type,
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
    check_length("input", text, MAX_INPUT)
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
    await ex.processing()
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
    add_facade_routes(app, "/v1/audio/speech", speech)
