"""OpenAI's audio routes, for the official `openai` client: `audio.speech.create` and
`audio.transcriptions.create` / `translations.create` against `/v2/compat/v1/audio/...`. Pure.

They are other spellings of the spec's TTS and ASR requests, on the same path: `voice` names a
preset (`alice` or `Alice`); the answer is WAV unless `response_format` is "pcm" (raw 16-bit mono
24 kHz; the gateway does not encode mp3, opus, aac or flac: 422). A transcription's file is uploaded
(multipart, counted against `[fetch] max_bytes` as it arrives) instead of fetched by URL, and the
answer is OpenAI's: `json` ({text, usage}), `text`, or `verbose_json` (segments, and words with
`timestamp_granularities[]=word`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import msgspec
import orjson
from msgspec import Meta

from proxy.families.asr import LANGUAGE_PATTERN, AsrRequest, Transcript
from proxy.families.languages import LANGUAGES
from proxy.families.tts import TEXT_MAX, Preset, TtsRequest
from proxy.validate import ErrorItem, RequestInvalid, validate, validate_with, value_error

SpeechFormat = Literal["wav", "pcm"]
_PRESETS: dict[str, Preset] = {p.lower(): p for p in get_args(Preset)}
# A preset as OpenAI clients write voices (lower case), or as the spec does.
Voice = Literal["alice", "avery", "brock", "chloe", "ella", "emma", "grace", "karen", "kevin",
                "lucas", "matt", "william", "Alice", "Avery", "Brock", "Chloe", "Ella", "Emma",
                "Grace", "Karen", "Kevin", "Lucas", "Matt", "William"]


class SpeechRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                    forbid_unknown_fields=True):
    """OpenAI's CreateSpeechRequest, as far as the gateway serves it."""

    model: Annotated[str, Meta(min_length=1)]
    input: Annotated[str, Meta(min_length=1, max_length=TEXT_MAX)]
    voice: Annotated[Voice, Meta(description="A preset, as `alice` or `Alice`")]
    response_format: Annotated[
        Literal["wav", "pcm"] | None,
        Meta(description="wav (the default here) or pcm (raw 16-bit mono 24 kHz); mp3, opus, "
                         "aac and flac are not offered")] = None
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] | None = None
    stream_format: Literal["audio"] | None = None


@dataclass(frozen=True, slots=True)
class Speech:
    """What a speech request asks, in either spelling."""

    req: TtsRequest
    response_format: SpeechFormat = "wav"
    speed: float | None = None


def parse_speech(body: object, max_characters: int) -> Speech:
    def rules(r: SpeechRequest) -> list[ErrorItem]:
        faults: list[ErrorItem] = []
        if len(r.input) > max_characters:
            faults.append({"loc": ["body", "input"], "type": "string_too_long",
                           "msg": f"String should have at most {max_characters} characters"})
        return faults

    r = validate_with(body, SpeechRequest, rules)
    fmt: SpeechFormat = "pcm" if r.response_format == "pcm" else "wav"
    return Speech(TtsRequest(text=r.input, model=r.model, preset_voice=_PRESETS[r.voice.lower()]),
                  fmt, r.speed)


class TranscriptionForm(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's CreateTranscriptionRequest (its text fields; `file` is the upload)."""

    model: Annotated[str, Meta(min_length=1)]
    language: Annotated[str, Meta(pattern=LANGUAGE_PATTERN)] | None = None
    prompt: Annotated[str, Meta(max_length=10_000)] | None = None
    response_format: Literal["json", "text", "verbose_json"] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    timestamp_granularities: list[Literal["word", "segment"]] | None = None


@dataclass(frozen=True, slots=True)
class Transcription:
    """What a transcription asks, in either spelling: the spec's request (by URL), or OpenAI's
    (an upload, its prompt and answer format)."""

    req: AsrRequest
    upload: bytes | None = None
    prompt: str | None = None
    response_format: Literal["spec", "json", "text", "verbose_json"] = "spec"


def parse_transcription(fields: Mapping[str, list[str]], files: Mapping[str, bytes],
                        task: Literal["transcribe", "translate"]) -> Transcription:
    """A multipart form's text fields (repeatable names as lists) and files."""
    upload = files.get("file")
    if upload is None or len(files) > 1:
        raise RequestInvalid([{"loc": ["body", "file"], "type": "missing",
                               "msg": "Field required: one audio file, as `file`"}])
    values: dict[str, Any] = {}
    for name, texts in fields.items():
        key = name.removesuffix("[]")
        if key == "timestamp_granularities":
            values[key] = texts
        elif len(texts) > 1:
            raise RequestInvalid([value_error(("body", name), "given more than once")])
        else:
            values[key] = _number(texts[0]) if key == "temperature" else texts[0]
    f = validate(values, TranscriptionForm)
    granularities = set(f.timestamp_granularities or ())
    timestamps: bool | Literal["word"] = "word" if "word" in granularities else bool(
        granularities)
    if f.response_format != "verbose_json":
        timestamps = False  # as OpenAI: timestamps come with verbose_json only
    req = AsrRequest(audio_url="", model=f.model, task=task, language=f.language,
                     return_timestamps=timestamps, temperature=f.temperature)
    return Transcription(req, upload, f.prompt, f.response_format or "json")


def _number(text: str) -> object:
    try:
        value = float(text)
    except ValueError:
        return text  # the schema says what is wrong with it
    return value if math.isfinite(value) else text


def render_transcription(t: Transcript, job: Transcription) -> tuple[bytes, str]:
    """OpenAI's answer: json, text or verbose_json."""
    if job.response_format == "text":
        return t.text.encode(), "text/plain; charset=utf-8"
    if job.response_format == "json":
        return orjson.dumps({"text": t.text, "usage": {
            "type": "duration", "seconds": math.ceil(t.duration_s)}}), "application/json"
    out: dict[str, Any] = {"task": job.req.task or "transcribe",
                           "language": LANGUAGES.get(t.language, t.language),
                           "duration": round(t.duration_s, 3), "text": t.text,
                           "segments": t.segments}
    if job.req.return_timestamps == "word":
        out["words"] = t.words
    return orjson.dumps(out), "application/json"
