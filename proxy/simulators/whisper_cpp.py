"""whisper.cpp's `POST /inference` (v1.8/1.9), on the Whisper simulator's port.

`{"text"}` with whisper.cpp's leading space, `verbose_json` with a full language name and
per-token words inside segments, text, srt and vtt; errors are `{"error": ...}`, 400 (v1.9)
or 200 with `--whisper-cpp-errors-200` (v1.8, recorded in /_sim/requests as "completed", as
HTTP sees them); a `temperature` that is not a number is a bare 500 (std::stof throws); one
request at a time (whisper.cpp's mutex). Without --convert it reads only WAV, MP3 and FLAC.

Difference kept on purpose: given an unknown `language` it answers
`{"error": "unknown language 'xx'"}` (the words of its startup check; the request path is not
documented).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.simulators.bodies import Form, json_response
from proxy.simulators.errors import HttpError
from proxy.simulators.exchange import Exchange
from proxy.simulators.speech import (
    LANGUAGES,
    Undecodable,
    avg_logprob,
    hear,
    segments,
    transcript,
)

CPP_AUDIO = ("wav", "mp3", "flac")  # what whisper.cpp's miniaudio reads without --convert
ONE_AT_A_TIME = web.AppKey("whisper_cpp_mutex", asyncio.Lock)


def cpp_error(exc: HttpError) -> web.Response:
    """whisper.cpp's error body: `{"error": message}`."""
    return json_response({"error": exc.message}, status=exc.status)


def _flag(form: Form, name: str) -> bool:
    return (form.text(name) or "").strip().lower() in ("true", "1", "yes")


def _stamp(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    hours, minutes, secs = ms // 3_600_000, ms // 60_000 % 60, ms // 1000 % 60
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{sep}{ms % 1000:03d}"


async def whisper_cpp(ex: Exchange) -> web.StreamResponse:
    async with ex.request.app[ONE_AT_A_TIME]:  # whisper.cpp serves one request at a time
        return await _whisper_cpp(ex)


async def _whisper_cpp(ex: Exchange) -> web.StreamResponse:
    form = Form(ex.fields)
    status = 200 if ex.config.whisper_cpp_errors_200 else 400
    upload = form.get("file")
    if upload is None:
        raise HttpError(status, "no 'file' field in the request")
    try:
        temperature = float(form.text("temperature") or 0.0)
    except ValueError:
        # std::stof throws; cpp-httplib answers an escaped exception with a bare 500.
        return web.Response(status=500, headers={"EXCEPTION_WHAT": "stof"})
    language = (form.text("language") or "en").strip().lower()
    names = {name: code for code, name in LANGUAGES.items()}
    if language != "auto" and language not in LANGUAGES and language not in names:
        raise HttpError(status, f"unknown language '{language}'")
    data = upload.value if isinstance(upload.value, bytes) else upload.value.encode()
    try:
        heard = hear(data)
    except Undecodable:
        heard = None
    if heard is None or heard.format not in CPP_AUDIO:
        raise HttpError(status, "failed to read audio data")
    await ex.processing()
    text, duration = transcript(data, heard)
    segs = segments(text, duration)
    fmt = form.text("response_format") or "json"
    spoken = "".join(f" {seg.text}" for seg in segs)  # whisper.cpp's segments start with " "
    if fmt == "text":
        return web.Response(text=spoken + "\n", content_type="text/html", charset="utf-8")
    if fmt in ("srt", "vtt"):
        sep = "," if fmt == "srt" else "."
        cues = [f"{_stamp(s.start, sep)} --> {_stamp(s.end, sep)}\n {s.text}\n\n" for s in segs]
        if fmt == "srt":
            body = "".join(f"{i + 1}\n{cue}" for i, cue in enumerate(cues))
            return web.Response(body=body.encode(), content_type="application/x-subrip")
        return web.Response(text="WEBVTT\n\n" + "".join(cues), content_type="text/vtt")
    if fmt != "verbose_json":
        return json_response({"text": spoken})  # whisper.cpp's fallback for any other value
    language = names.get(language, language)
    full_name = LANGUAGES.get("en" if language == "auto" else language, "english")
    timed = not _flag(form, "no_timestamps")
    out = []
    for i, seg in enumerate(segs):
        entry: dict[str, object] = {"id": i, "text": f" {seg.text}"}
        if timed:
            entry |= {"start": seg.start, "end": seg.end}
        words = []
        for word in seg.words:
            token: dict[str, object] = {"word": f" {word.text}"}
            if timed:
                token |= {"start": word.start, "end": word.end, "t_dtw": -1}
            token["probability"] = round(0.5 + word.token % 490 / 1000, 3)
            words.append(token)
        entry |= {"tokens": [w.token for w in seg.words], "words": words,
                  "temperature": temperature, "avg_logprob": avg_logprob(seg.text),
                  "no_speech_prob": 0.0}
        out.append(entry)
    task = "translate" if _flag(form, "translate") else "transcribe"
    return json_response({"task": task, "language": full_name, "duration": duration,
                          "text": spoken, "segments": out})
