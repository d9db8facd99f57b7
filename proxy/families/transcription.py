"""Speech recognition on the request path: the audio (fetched from `audio_url` under the SSRF
rules, or uploaded) identified and measured by its content -> multipart to
`/v1/audio/transcriptions` (or whisper.cpp's `/inference`) -> the answer normalised -> charged
per second of the decoded audio. The request's schema and rules are in proxy.families.asr.

The audio's length is the gateway's own measure (proxy.media.measure: the frames present, never
less than its bytes at the codec's highest bitrate), not what its headers claim: longer than
`max_audio_s` by that measure or by its headers is refused before any server is called. The
charge is the longer of that measure and the server's reported duration, capped at the hold
(`max_audio_s`): a server that reports more than the limit ran the request, and is charged the
cap (docs/media.md)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from aiohttp import web

from proxy.config import Policies
from proxy.credits.pricing import Units
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.families import asr, openai_audio
from proxy.families.base import Answer, Ctx, Family, Job, parsed
from proxy.families.fetched import fetch_audio, unfetchable
from proxy.families.openai_audio import Transcription
from proxy.http.body import Form, read_form
from proxy.media.audio import NotAudio
from proxy.media.measure import measure
from proxy.upstream import http1
from proxy.upstream.client import read_answer
from proxy.upstream.pool import Backend, Pool

ANSWER_MAX_BYTES = 16 * 1024 * 1024  # a transcription as JSON
FORM_SLACK = 256 * 1024  # an upload's form: the audio's cap plus its text fields
JSON = "application/json"
log = logging.getLogger(__name__)


class SpeechRecognition(Family):
    name = "asr"

    def max_body_bytes(self, policies: Policies) -> int:
        return policies.requests.asr.max_body_bytes

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        return _transcription_job(Transcription(parsed(asr.parse_asr, body)), policies)

    def model(self, job: Job, policies: Policies) -> str | None:
        return job.model or policies.requests.asr.default_model

    def early_slot(self, job: Job) -> bool:
        upload: bytes | None = job.request.upload
        return upload is not None  # audio_url: fetched first

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        job_: Transcription = job.request
        req = job_.req
        where = ("audio_url",) if job_.upload is None else ("file",)
        if job_.upload is None:
            audio = await fetch_audio(ctx, req.audio_url, where)
        else:
            audio = job_.upload
        longest = job.worst.audio_ms / 1000
        try:
            info = await asyncio.to_thread(measure, audio, longest)
        except NotAudio:
            if job_.upload is None:
                raise unfetchable(where) from None
            raise validation_failed([{"loc": ["body", "file"], "type": "not_audio",
                                      "msg": "the file is not WAV, MP3, M4A, WEBM, FLAC or OGG "
                                             "audio"}]) from None
        if max(info.seconds, info.claimed_s or 0.0) > longest:
            raise validation_failed([{"loc": ["body", *where], "type": "audio_too_long",
                                      "msg": f"the audio is longer than {longest:g} s"}])
        content_type, forms = _forms(job_, pool, audio, info.format)
        headers = {"Content-Type": content_type, "Accept": "application/json",
                   "X-Request-Id": ctx.request_id}

        async def use(backend: Backend, upstream: http1.Response) -> Answer:
            raw = await read_answer(upstream, ANSWER_MAX_BYTES)
            try:
                transcript = asr.read_transcript(orjson.loads(raw), req, info.seconds)
            except (orjson.JSONDecodeError, asr.UnusableAnswer):
                raise GatewayError(ErrorKind.UPSTREAM_ERROR,
                                   "the speech recognition server sent an unusable answer"
                                   ) from None
            heard_ms = math.ceil(round(transcript.duration_s * 1000, 6))
            if heard_ms > job.worst.audio_ms:  # the server heard more than the limit: the cap
                log.warning("asr: %s reported %.3f s, over the %g s limit; charged the limit",
                            backend.spec.name, transcript.duration_s, longest)
            used = Units(audio_ms=min(heard_ms, job.worst.audio_ms))
            if job_.response_format == "spec":
                body, content_type = orjson.dumps(asr.answer(transcript, req)), JSON
            else:
                body, content_type = openai_audio.render_transcription(transcript, job_)
            return Answer(body, content_type, used)

        return await ctx.upstreams.call(
            pool, lambda b: asr.upstream_path(req, b.spec.api), lambda b: forms[b.spec.api],
            headers, ctx.client_headers, use, ticket=ctx.ticket, early=ctx.early)


class OpenAITranscription(SpeechRecognition):
    """`/v2/compat/v1/audio/transcriptions` and `/translations`: OpenAI's spelling, the audio
    uploaded rather than fetched."""

    def __init__(self, task: Literal["transcribe", "translate"]) -> None:
        self.task = task

    async def read(self, request: web.Request, policies: Policies) -> Any:
        return await read_form(request, policies.requests.fetch.max_bytes + FORM_SLACK)

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        form: Form = body
        files = {name: upload.data for name, upload in form.files.items()}
        return _transcription_job(parsed(openai_audio.parse_transcription, form.fields, files,
                                         self.task), policies)


def _transcription_job(t: Transcription, policies: Policies) -> Job:
    """Held: the longest audio the policy takes, until the audio is measured."""
    req = t.req
    return Job(t, req.model, req.mode or "auto", bool(req.async_),
               Units(audio_ms=policies.requests.asr.max_audio_s * 1000))


def _forms(t: Transcription, pool: Pool, audio: bytes, audio_format: str
           ) -> tuple[str, dict[str, bytes]]:
    """One multipart body per wire the pool's servers speak, all under one boundary (the
    Content-Type header is the same for every backend)."""
    boundary = asr.new_boundary()
    extra = [("prompt", t.prompt)] if t.prompt is not None else []
    forms: dict[str, bytes] = {
        api: asr.multipart(asr.form_fields(t.req, api, pool.model) + extra, audio,
                           audio_format, boundary)
        for api in {b.spec.api for b in pool.backends}}
    return f"multipart/form-data; boundary={boundary}", forms


ASR = SpeechRecognition()
OPENAI_TRANSCRIPTIONS = OpenAITranscription("transcribe")
OPENAI_TRANSLATIONS = OpenAITranscription("translate")
