"""Speech recognition: the spec's ASR request, the form an ASR server gets, and the answer the
client gets back. Pure.

Servers: OpenAI-style (`/v1/audio/transcriptions` and `/translations`: OpenAI, vLLM, speaches)
and whisper.cpp (`/inference`), both multipart (protocols.md §6). The gateway fetched the audio
itself (upstream.fetch) and sends it as the `file` part, named by the format it found inside.
Answers are normalised to the spec's `{text, language, duration}`, plus `segments` when
`return_timestamps` is true and `words` when it is "word": from the server's words (OpenAI's top
level, whisper.cpp's inside segments) or, when it gives none (vLLM leaves `words` null), spread
over each segment by character offset (`words_estimated: true`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from proxy.families.languages import LANGUAGES, language_code
from proxy.validate import validate

URL_MAX = 2048
MIME_OF_FORMAT = {"wav": "audio/wav", "mp3": "audio/mpeg", "m4a": "audio/mp4",
                  "webm": "audio/webm", "flac": "audio/flac", "ogg": "audio/ogg"}
# The codes Whisper knows, as a pattern: the schema (and so the OpenAPI document) lists them.
LANGUAGE_PATTERN = "^(" + "|".join(sorted(LANGUAGES)) + ")$"


class AsrRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """The spec's ASR table, one field per row."""

    audio_url: Annotated[str, Meta(min_length=1, max_length=URL_MAX,
                                   description="http(s) URL of a WAV, MP3, M4A, WEBM, FLAC or "
                                               "OGG file (fetched by the gateway; public hosts)")]
    model: Annotated[str, Meta(min_length=1, description="Default <namespace>/large-v3")] | None \
        = None
    task: Literal["transcribe", "translate"] | None = None
    language: Annotated[str, Meta(pattern=LANGUAGE_PATTERN,
                                  description="ISO 639-1 code; a hint")] | None = None
    return_timestamps: Annotated[
        bool | Literal["word"] | None,
        Meta(description="false: none; true: segments; \"word\": words")] = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    chunk_length_s: Annotated[int, Meta(ge=1, le=60, description="Default 30")] | None = None
    batch_size: Annotated[int, Meta(ge=1, le=32, description="Default 16")] | None = None
    mode: Annotated[Literal["auto", "direct"] | None,
                    Meta(description="ASR is direct-only")] = None
    async_: Annotated[bool | None, Meta(description="Return a task handle (202)")] = \
        msgspec.field(default=None, name="async")


def parse_asr(body: object) -> AsrRequest:
    return validate(body, AsrRequest)


def upstream_path(req: AsrRequest, api: str) -> str:
    if api == "whisper.cpp":
        return "/inference"
    return "/v1/audio/translations" if req.task == "translate" else "/v1/audio/transcriptions"


def form_fields(req: AsrRequest, api: str, model: str) -> list[tuple[str, str]]:
    """The form beside the file: always verbose_json (durations, segments, language)."""
    fields = [("response_format", "verbose_json")]
    if api == "whisper.cpp":
        fields += [("language", req.language or "auto"),
                   ("translate", "true" if req.task == "translate" else "false")]
        if req.temperature is not None:
            fields.append(("temperature", repr(req.temperature)))
        return fields
    fields.append(("model", model))
    if req.language is not None and req.task != "translate":
        fields.append(("language", req.language))
    if req.temperature is not None:
        fields.append(("temperature", repr(req.temperature)))
    if req.return_timestamps:
        fields.append(("timestamp_granularities[]", "segment"))
    if req.return_timestamps == "word":
        fields.append(("timestamp_granularities[]", "word"))
    # Not OpenAI's: chunked long-form servers (vLLM passes unknown fields by) read them.
    if req.chunk_length_s is not None:
        fields.append(("chunk_length_s", str(req.chunk_length_s)))
    if req.batch_size is not None:
        fields.append(("batch_size", str(req.batch_size)))
    return fields


def new_boundary() -> str:
    return "igw-" + secrets.token_hex(16)


def multipart(fields: list[tuple[str, str]], audio: bytes, audio_format: str, boundary: str
              ) -> bytes:
    """A multipart/form-data body: the fields, then the file."""
    parts = []
    for name, value in fields:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                     f"{value}\r\n".encode())
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                 f'filename="audio.{audio_format}"\r\nContent-Type: '
                 f"{MIME_OF_FORMAT[audio_format]}\r\n\r\n".encode())
    parts += [audio, f"\r\n--{boundary}--\r\n".encode()]
    return b"".join(parts)


class UnusableAnswer(ValueError):
    """The server's answer is not a transcription (whisper.cpp <= 1.8 sends errors with 200)."""


@dataclass(frozen=True, slots=True)
class Transcript:
    """A server's answer, read: what every rendering of it (the spec's, OpenAI's) needs."""

    text: str
    language: str  # ISO 639-1 (or "und")
    duration_s: float  # the longer of the gateway's measure and the server's
    segments: list[dict[str, Any]]  # {id, start, end, text}
    words: list[dict[str, Any]]  # {word, start, end}
    words_estimated: bool  # spread over segments: the server gave none


def read_transcript(raw: object, req: AsrRequest, duration_s: float | None) -> Transcript:
    """The server's verbose answer; `duration_s` is the gateway's measure of the audio (from
    the file's headers, which a client writes and may understate), the server's is from
    decoding it: the longer one counts."""
    if not isinstance(raw, dict) or "error" in raw or not isinstance(raw.get("text"), str):
        raise UnusableAnswer("not a transcription")
    reported = _number(raw.get("duration"))
    known = [d for d in (duration_s, reported) if d is not None and d >= 0]
    if not known:
        raise UnusableAnswer("no duration")
    segments = _segments(raw.get("segments"))
    words = _words(raw.get("words")) or [w for s in segments for w in _words(s["words"])]
    estimated = not words
    if estimated:
        words = [w for s in segments for w in spread_words(s)]
    return Transcript(raw["text"].strip(),
                      language_code(raw.get("language")) or req.language or "und", max(known),
                      [{k: v for k, v in s.items() if k != "words"} for s in segments],
                      words, estimated)


def answer(t: Transcript, req: AsrRequest) -> dict[str, Any]:
    """The spec's ASR response, with segments or words as `return_timestamps` asks."""
    out: dict[str, Any] = {"text": t.text, "language": t.language,
                           "duration": round(t.duration_s, 3)}
    if req.return_timestamps is True:
        out["segments"] = t.segments
    elif req.return_timestamps == "word":
        if t.words_estimated:
            out["words_estimated"] = True
        out["words"] = t.words
    return out


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _segments(raw: object) -> list[dict[str, Any]]:
    out = []
    for i, seg in enumerate(raw if isinstance(raw, list) else ()):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
            continue
        start, end = _number(seg.get("start")), _number(seg.get("end"))
        if start is None or end is None:
            continue
        out.append({"id": i, "start": start, "end": end, "text": seg["text"].strip(),
                    "words": seg.get("words")})
    return out


def _words(raw: object) -> list[dict[str, Any]]:
    out = []
    for word in raw if isinstance(raw, list) else ():
        if not isinstance(word, dict) or not isinstance(word.get("word"), str):
            continue
        start, end = _number(word.get("start")), _number(word.get("end"))
        if start is not None and end is not None and word["word"].strip():
            out.append({"word": word["word"].strip(), "start": start, "end": end})
    return out


def spread_words(segment: dict[str, Any]) -> list[dict[str, Any]]:
    """A segment's words with times in proportion to their character offsets."""
    text: str = segment["text"]
    start: float = segment["start"]
    span = max(0.0, segment["end"] - start)
    length = max(1, len(text))
    words, offset = [], 0
    for token in text.split():
        at = text.index(token, offset)
        offset = at + len(token)
        words.append({"word": token, "start": round(start + span * at / length, 3),
                      "end": round(start + span * offset / length, 3)})
    return words
