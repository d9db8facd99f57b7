"""vLLM's Whisper routes: `POST /v1/audio/transcriptions` and `/v1/audio/translations`.

Matched to a real vLLM 0.32 serving Whisper (real-engines/whisper-wire.md and the real-engine
tier's tests/real_engine/test_asr_fidelity.py): `json` (and `text`, which vLLM also answers as
JSON) gives `{"text","usage":{"type":"duration","seconds":ceil}}` (translations: no usage);
`verbose_json` gives duration, ISO `language`, segments whose ids restart in each 30 s window
(`seek` = the window's start) and `"words": null` even when `timestamp_granularities[]=word`
is sent, as vLLM does; `--word-timestamps` adds OpenAI's top-level `words` instead.
`stream=true` sends vLLM's `transcription.chunk` events (`translation.chunk`, ids
`translate-...`, on translations): one finish chunk per 30 s window, then usage with
`stream_include_usage` (on every chunk too with `stream_continuous_usage_stats`, which alone
adds nothing). Errors are the real ones, word for word, pydantic's included (a translation
has no `timestamp_granularities[]` to check, nor `diarized_json`).

Durations are the decoder's: vLLM decodes uploads with libsndfile (WAV, FLAC, Ogg, MP3) or
else PyAV (FFmpeg), and its duration is the samples the decoder puts out at 16 kHz, which is
not always what the container states (`proxy.media.audio.decoded_length`): Ogg Opus counts its
packets' samples less pre-skip and end trimming, WebM Opus its blocks' less CodecDelay and
DiscardPadding, AAC in MP4 its frames whole less the edit list's skip, and what PyAV decodes
(MP4, WebM) loses 1 ms to vLLM's unflushed resampler unless it is 16 kHz already.

Difference kept on purpose: a stream's `completion_tokens` counts a token per word plus one
end-of-text per window (vLLM's BPE pieces and timestamp tokens differ).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence

import orjson
from aiohttp import web

from proxy.media.audio import NotAudio, decoded_length
from proxy.simulators.bodies import Form, json_response
from proxy.simulators.errors import HttpError
from proxy.simulators.exchange import EventWriter, Exchange
from proxy.simulators.speech import (
    LANGUAGES,
    MAX_CHUNK_S,
    VLLM_LANGUAGES,
    Heard,
    Segment,
    Undecodable,
    avg_logprob,
    compression_ratio,
    hear,
    segments,
    transcript,
    usage_seconds,
)
from proxy.simulators.vllm import VLLM_CHAT

MAX_FILE_MB = 25  # VLLM_MAX_AUDIO_CLIP_FILESIZE_MB
MAX_DURATION_S = 600  # VLLM_MAX_AUDIO_DECODE_DURATION_S
CORRUPTED = ("Invalid or corrupted audio data. Ensure the input is a valid audio or video file "
             "(e.g. a complete WAV, MP3, or MP4).")
FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
FORMS_ANSWERED = ("json", "text", "verbose_json")
_FORM_BASE_ITEMS = 13  # vLLM's pydantic input dict has 13 entries besides the form's keys
GRANULARITIES = "timestamp_granularities[]"
WHISPER_RATE = 16000  # what vLLM resamples every upload to
PYAV_FORMATS = ("m4a", "webm")  # what vLLM decodes with PyAV: libsndfile cannot read them


def bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, "BadRequestError", param)


def _literal(loc: str, value: str, options: Sequence[str]) -> dict[str, object]:
    quoted = [f"'{o}'" for o in options]
    expected = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + f" or {quoted[-1]}"
    return {"type": "literal_error", "loc": loc, "msg": f"Input should be {expected}",
            "input": value, "ctx": {"expected": expected}}


def _parse(form: Form, task: str) -> tuple[str, float, tuple[bool, bool, bool]]:
    """Pydantic's part of vLLM's validation: every problem in one 400, worded as pydantic.

    The two routes' models differ: a translation has no `timestamp_granularities[]` (the
    field is neither checked nor taken out of the input dict), and its `response_format` has
    no `diarized_json` branch. A transcription checks the list on its own, so a bad item's
    `loc` is `body.<index>`."""
    problems: list[dict[str, object]] = []
    transcribe = task == "transcribe"
    if form.get("file") is None:
        names = {f.name for f in form.fields}
        if transcribe:
            names.discard(GRANULARITIES)
        items = len(names) + (_FORM_BASE_ITEMS if transcribe else _FORM_BASE_ITEMS - 1)
        problems.append({"type": "missing", "loc": "body.file", "msg": "Field required",
                         "input": f"<dict of {items} items>"})
    fmt = form.text("response_format") or "json"
    if fmt not in FORMATS and (fmt != "diarized_json" or not transcribe):
        problems.append(_literal("body.response_format", fmt, FORMATS))
        if transcribe:
            problems.append(_literal("body.response_format", fmt, ("diarized_json",)))
    for i, value in enumerate(form.texts(GRANULARITIES) if transcribe else ()):
        if value not in ("word", "segment"):
            problems.append(_literal(f"body.{i}", value, ("word", "segment")))
    temperature = 0.0
    raw = form.text("temperature")
    try:
        temperature = float(raw) if raw is not None else 0.0
    except ValueError:
        problems.append({"type": "float_parsing", "loc": "body.temperature",
                         "msg": "Input should be a valid number, unable to parse string as a "
                                "number", "input": raw})
    flags = []
    for name in ("stream", "stream_include_usage", "stream_continuous_usage_stats"):
        raw = (form.text(name) or "false").strip().lower()
        if raw not in ("true", "1", "yes", "on", "t", "y", "false", "0", "no", "off", "f", "n"):
            problems.append({"type": "bool_parsing", "loc": f"body.{name}", "msg": "Input "
                             "should be a valid boolean, unable to interpret input",
                             "input": form.text(name)})
        flags.append(raw in ("true", "1", "yes", "on", "t", "y"))
    if problems:
        count = f"{len(problems)} validation error{'s' if len(problems) > 1 else ''}"
        lines = "".join(f"\n  {problem!r}" for problem in problems)
        raise HttpError(400, f"{count}:{lines}", "Bad Request", str(problems[0]["loc"]))
    return fmt, temperature, (flags[0], flags[1], flags[2])


def _resampled(seconds: float, rate: int) -> float:
    """What vLLM keeps of audio PyAV decodes (containers libsndfile cannot read: MP4, WebM):
    it resamples to 16 kHz frame by frame and never flushes the resampler, so the filter's
    tail is lost: 16 output samples (1 ms) when downsampling, 16 input samples' worth when
    upsampling (measured with libswresample's defaults). 3 s of 48 kHz Opus: 2.999 s."""
    if rate == WHISPER_RATE:
        return seconds
    lost = math.floor(16 * max(1.0, WHISPER_RATE / rate))
    return max(0, math.floor(seconds * WHISPER_RATE + 1e-9) - lost) / WHISPER_RATE


def _decoded_seconds(data: bytes, heard: Heard) -> float:
    """The duration vLLM's decoder finds: the container's, except where FFmpeg's decoded
    length differs (Opus in Ogg and WebM, AAC in MP4), less what PyAV's resampling loses."""
    try:
        decoded = decoded_length(data)
    except NotAudio:
        decoded = None
    if decoded is None:
        return heard.duration_s
    if heard.format in PYAV_FORMATS:
        return _resampled(decoded.seconds, decoded.rate)
    return decoded.seconds


def _decode(data: bytes) -> Heard:
    if len(data) / 1024**2 > MAX_FILE_MB:
        size = len(data) / 1024**2
        raise bad(f"Maximum file size exceeded (parameter=audio_filesize_mb, value={size})",
                  "audio_filesize_mb")
    try:
        heard = hear(data)
    except Undecodable as exc:
        raise bad("Invalid or unsupported audio file." if exc.broken_wav else CORRUPTED) from None
    heard = dataclasses.replace(heard, duration_s=_decoded_seconds(data, heard))
    if heard.duration_s > MAX_DURATION_S:
        raise bad(f"Audio exceeds maximum allowed duration of {MAX_DURATION_S}s (file contains "
                  f"{heard.duration_s:.1f}s at {heard.rate or WHISPER_RATE}Hz). Set "
                  "VLLM_MAX_AUDIO_DECODE_DURATION_S to increase this limit.")
    return heard


async def openai_audio(ex: Exchange, task: str) -> web.StreamResponse:
    form = Form(ex.fields)
    upload = form.get("file")
    if upload is not None and not upload.is_file:
        raise HttpError(422, "Expected 'file' to be a file-like object, not 'str'.",
                        "Unprocessable Entity")
    fmt, temperature, (stream, usage, continuous) = _parse(form, task)
    assert upload is not None
    if (usage or continuous) and not stream:
        raise bad("Stream options can only be defined when `stream=True`. "
                  "(parameter=stream_include_usage)", "stream_include_usage")
    models = ex.config.models
    ex.model = form.text("model") or models[0]
    if ex.model not in models:
        raise HttpError(404, f"The model `{ex.model}` does not exist. Valid aliases: "
                        f"{', '.join(models)}.", "NotFoundError", "model")
    if fmt == "diarized_json":  # a transcription's only (a translation's pydantic refuses it)
        raise bad(f"Currently do not support diarized_json for {ex.model}")
    if fmt not in FORMS_ANSWERED:
        raise bad("Currently only support response_format: `text`, `json`, `verbose_json` or "
                  "`diarized_json`")
    if stream and fmt == "verbose_json":
        raise bad("verbose_json format doesn't support streaming case")
    data = upload.value if isinstance(upload.value, bytes) else upload.value.encode()
    heard = _decode(data)
    if temperature < 0:
        raise bad(f"temperature must be non-negative, got {temperature}. (parameter="
                  f"temperature, value={temperature})", "temperature")
    if temperature > 2:
        raise bad(f"temperature must be in [0, 2], got {temperature}. (parameter=temperature, "
                  f"value={temperature})", "temperature")
    language = form.text("language")
    if language is not None and language not in VLLM_LANGUAGES and language not in LANGUAGES:
        raise bad(f"Unsupported language: {language!r}.  Must be one of {list(VLLM_LANGUAGES)}.")
    await ex.processing()
    text, duration = transcript(data, heard)
    segs = segments(text, duration)
    if stream:
        # Continuous usage stats are a detail of the usage option: alone, no usage at all.
        return await _stream(ex, task, text, segs, duration, usage, usage and continuous)
    if fmt != "verbose_json":
        body: dict[str, object] = {"text": text}
        if task == "transcribe":
            body["usage"] = {"type": "duration", "seconds": usage_seconds(duration)}
        return json_response(body)
    words = None
    if ex.config.word_timestamps and "word" in form.texts(GRANULARITIES):
        words = [{"word": w.text.strip(".,!?;:\"'()") or w.text, "start": w.start, "end": w.end}
                 for seg in segs for w in seg.words]
    return json_response({"duration": duration, "language": language or "en", "text": text,
                          "segments": _vllm_segments(segs, temperature), "words": words})


def _vllm_segments(segs: Sequence[Segment], temperature: float) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    index = 0
    for i, seg in enumerate(segs):
        index = 0 if i == 0 or segs[i - 1].chunk != seg.chunk else index + 1
        out.append({"id": index, "avg_logprob": avg_logprob(seg.text),
                    "compression_ratio": compression_ratio(seg.text), "end": seg.end,
                    "no_speech_prob": None, "seek": int(seg.chunk * MAX_CHUNK_S),
                    "start": seg.start, "temperature": temperature, "text": seg.text,
                    "tokens": [w.token for w in seg.words]})
    return out


async def _stream(ex: Exchange, task: str, text: str, segs: Sequence[Segment], duration: float,
                  usage: bool, continuous: bool) -> web.StreamResponse:
    """vLLM's transcription (or translation) stream: a word per event (with the whitespace
    before it), a finish chunk per 30 s window, then the optional usage chunk and `[DONE]`.
    Chunks are `transcription.chunk` with ids `transcribe-<id>`, or `translation.chunk` with
    `translate-<id>`."""
    writer = EventWriter(ex, b"data: ", VLLM_CHAT.error_events)
    await writer.open({"Content-Type": "text/event-stream; charset=utf-8"})
    rid = ex.request.headers.get("X-Request-Id") or os.urandom(8).hex()
    kind = "transcription" if task == "transcribe" else "translation"
    envelope = {"id": f"{task}-{rid}", "object": f"{kind}.chunk",
                "created": int(time.time()), "model": ex.model}
    prompt = 4 + math.ceil(round(duration * 100, 6))  # decoder prompt + 10 ms audio frames
    done = 0
    cursor = 0

    async def send(choices: list[dict[str, object]], with_usage: bool) -> None:
        extra = {"usage": {"prompt_tokens": prompt, "total_tokens": prompt + done,
                           "completion_tokens": done}} if with_usage else {}
        await writer.send(orjson.dumps({**envelope, "choices": choices, **extra}))

    windows = sorted({seg.chunk for seg in segs})
    for window in windows:
        words = [w for seg in segs if seg.chunk == window for w in seg.words]
        for word in words:
            end = text.index(word.text, cursor) + len(word.text)
            piece, cursor = text[cursor:end], end
            if word is words[-1] and window == windows[-1]:
                piece, cursor = piece + text[end:], len(text)  # trailing whitespace too
            done += 1
            await send([{"delta": {"content": piece}}], continuous)
        done += 1  # the window's end-of-text token
        await send([{"delta": {"content": ""}, "finish_reason": "stop", "stop_reason": None}],
                   continuous)
    if usage:
        await send([], True)
    await writer.send(b"[DONE]")
    return writer.response


async def transcriptions(ex: Exchange) -> web.StreamResponse:
    return await openai_audio(ex, "transcribe")


async def translations(ex: Exchange) -> web.StreamResponse:
    return await openai_audio(ex, "translate")
