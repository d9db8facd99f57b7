"""Each task family's part of the request path (proxy.pipeline.task runs the rest).

A family reads its request (`parse`: 422), names its pool (`pool`: 404), states the worst case
its hold covers (`Job.worst`), and, once admitted, produces the answer (`produce`): fetch what
the client named, call the upstream, check or convert the answer, and count what was used. The
request path sends it (`run`); an async task stores it (proxy.tasks) — the same work either way,
so `produce` needs no client connection, only a `Ctx`.

    tts    preset or random voice (or a fetched sample) -> /v1/audio/speech -> WAV checked and
           converted to 16-bit PCM mono 24 kHz -> charged per character
    asr    audio_url fetched under the SSRF rules, its format and length read from its content
           -> multipart to /v1/audio/transcriptions (or whisper.cpp's /inference) -> normalised
           answer -> charged per second of the decoded audio
    image  body passed through to /v1/images/generations -> charged per image delivered
    video  body passed through to /v1/videos/generations -> charged per second of video decoded
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

from proxy import ids
from proxy.appkeys import FETCHER, LIVE, REQUEST_ID, RESPONSE_HEADERS, UPSTREAMS
from proxy.config import Policies
from proxy.credits.pricing import Units
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.families import asr, generation, openai_audio, tts
from proxy.families.openai_audio import Speech, Transcription
from proxy.http.body import Form, read_form, read_json
from proxy.media.audio import NotAudio, probe
from proxy.media.wav import SPEECH_RATE, BadAudio, to_speech_wav, wav_bytes
from proxy.outcome import Outcome
from proxy.upstream import http1
from proxy.upstream.client import read_answer
from proxy.upstream.fetch import PUBLIC_MESSAGE, FetchRefused
from proxy.upstream.pool import Backend, Pool, Router
from proxy.validate import RequestInvalid

ANSWER_MAX_BYTES = 16 * 1024 * 1024  # a transcription or an image list as JSON
FORM_SLACK = 256 * 1024  # an upload's form: the audio's cap plus its text fields
JSON = "application/json"
SPEECH_HEADER = 44  # the canonical WAV header to_speech_wav writes
_WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})


@dataclass(slots=True)
class Job:
    """A parsed request of one family: what admission and routing need."""

    request: Any  # the family's parsed request (Speech, Transcription, or the passed body)
    model: str | None
    mode: str
    async_: bool
    worst: Units  # what the hold covers
    provider: str | None = None  # image and video: the route's <provider>


@dataclass(frozen=True, slots=True)
class Ctx:
    """What producing an answer needs of the request: the app's long-lived objects, the request
    id (sent upstream), and the client's headers (backends' `forward_headers` pick from them)."""

    app: web.Application
    request_id: str
    client_headers: Mapping[str, str]

    @classmethod
    def of(cls, request: web.Request) -> Ctx:
        return cls(request.app, request[REQUEST_ID], request.headers)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer and what it used."""

    body: bytes
    content_type: str
    used: Units
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class TaskResult:
    status: Outcome = Outcome.FAILED
    used: Units = field(default_factory=Units)


class Family(abc.ABC):
    """One task family's steps on the request path (proxy.pipeline.task calls them in order)."""

    name: str  # as tiers.toml `families` names it

    @abc.abstractmethod
    def max_body_bytes(self, policies: Policies) -> int: ...

    async def read(self, request: web.Request, policies: Policies) -> Any:
        """The body: a JSON object (415, 413, 408, 400 as proxy.http.body says)."""
        return await read_json(request, self.max_body_bytes(policies))

    @abc.abstractmethod
    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        """The request as the family reads it (`params`: the route's path parameters); 422
        (GatewayError) when it is not one."""

    @abc.abstractmethod
    def model(self, job: Job, policies: Policies) -> str | None:
        """The model it names (or the default); None when a provider's pool decides."""

    def pool(self, router: Router, job: Job, policies: Policies, mode: str = "direct") -> Pool:
        """The backends that serve it in `mode`; 404 for a model no backend serves (so)."""
        return router.pool(self.name, self.model(job, policies) or "", mode)

    @abc.abstractmethod
    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        """Admitted: do it; the answer and what it used."""

    async def run(self, request: web.Request, job: Job, pool: Pool, result: TaskResult
                  ) -> web.StreamResponse:
        """Produce the answer and send it; it is charged once it is out (or the client left
        while it went)."""
        result.status = Outcome.UPSTREAM_ERROR  # until an answer is delivered
        answer = await self.produce(Ctx.of(request), job, pool)
        headers = {**_reply_headers(request), **answer.headers,
                   "Content-Type": answer.content_type}
        response = web.Response(body=answer.body, headers=headers)
        result.status, result.used = Outcome.CLIENT_GONE, answer.used
        await response.prepare(request)
        await response.write_eof()
        result.status = Outcome.COMPLETED
        return response


def _parsed(parse: Any, *args: Any) -> Any:
    try:
        return parse(*args)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None


def _reply_headers(request: web.Request, mode: str = "direct") -> dict[str, str]:
    """Sent with the answer (which goes out before the middleware sees it)."""
    return {**request.get(RESPONSE_HEADERS, {}), "X-Request-Id": request[REQUEST_ID],
            "X-Task-Id": ids.task_id(mode)}


async def _fetch_audio(ctx: Ctx, url: str, loc: tuple[str, ...]) -> bytes:
    """Audio a client named by URL: one answer for every way it can fail (reliability F6)."""
    fetcher = ctx.app[FETCHER]
    fetcher.follow(ctx.app[LIVE].current.policies.requests.fetch)
    try:
        fetched = await fetcher.fetch(url)
    except FetchRefused:
        raise _unfetchable(loc) from None
    return fetched.data


def _unfetchable(loc: tuple[str, ...]) -> GatewayError:
    return validation_failed([{"loc": ["body", *loc], "type": "url_unusable",
                               "msg": f"{PUBLIC_MESSAGE} (it must be a public http(s) URL of a "
                                      "WAV, MP3, M4A, WEBM, FLAC or OGG file)"}])


class SpeechSynthesis(Family):
    name = "tts"

    def max_body_bytes(self, policies: Policies) -> int:
        return policies.requests.tts.max_body_bytes

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        req: tts.TtsRequest = _parsed(tts.parse_tts, body, policies.requests.tts.max_characters)
        return _speech_job(Speech(req))

    def model(self, job: Job, policies: Policies) -> str | None:
        return job.model or policies.requests.tts.default_model

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        speech: Speech = job.request
        req = speech.req
        app = ctx.app
        sample = None
        if req.custom_voice is not None:
            sample = await _fetch_audio(ctx, req.custom_voice.url, ("custom_voice", "url"))
            try:
                probe(sample)
            except NotAudio:
                raise _unfetchable(("custom_voice", "url")) from None
        preset = tts.pick_voice(req)
        headers = {"Content-Type": "application/json", "Accept": "audio/wav",
                   "X-Request-Id": ctx.request_id}
        reply = {"X-Voice": "custom" if sample else preset}
        cap = app[LIVE].current.policies.requests.tts.max_audio_bytes
        limit = min(b.spec.max_input_chars for b in pool.backends)

        async def use(backend: Backend, upstream: http1.Response) -> bytes:
            return speech_wav(await read_answer(upstream, cap), upstream.headers)

        pieces = []
        for text in tts.split_text(req.text, limit):  # one piece, unless the server's limit
            def body_for(backend: Backend, text: str = text) -> bytes:
                voice = tts.server_voice(preset, backend.spec.voices)
                return orjson.dumps(tts.speech_body(req, text, pool.model, voice, sample,
                                                    speech.speed))

            pieces.append(await app[UPSTREAMS].call(pool, tts.SPEECH_PATH, body_for, headers,
                                                    ctx.client_headers, use))
        audio = pieces[0] if len(pieces) == 1 else join_speech(pieces)
        used = Units(characters=len(req.text))
        if speech.response_format == "pcm":  # OpenAI's raw 16-bit mono 24 kHz
            return Answer(audio[SPEECH_HEADER:], "audio/pcm", used, reply)
        return Answer(audio, "audio/wav", used, reply)


class OpenAISpeech(SpeechSynthesis):
    """`/v2/compat/v1/audio/speech`: OpenAI's spelling of the same request."""

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        return _speech_job(_parsed(openai_audio.parse_speech, body,
                                   policies.requests.tts.max_characters))


def _speech_job(speech: Speech) -> Job:
    req = speech.req
    return Job(speech, req.model, req.mode or "auto", bool(req.async_),
               Units(characters=len(req.text)))


def join_speech(wavs: list[bytes]) -> bytes:
    """Speech WAVs (canonical headers, same format) as one."""
    return wav_bytes(b"".join(w[SPEECH_HEADER:] for w in wavs), SPEECH_RATE)


def speech_wav(raw: bytes, headers: Any) -> bytes:
    """A TTS server's answer as the spec's WAV (16-bit PCM, mono, 24 kHz); 502 if not audio."""
    media, _, params = headers.get("Content-Type", "").partition(";")
    media = media.strip().lower()
    try:
        if media in ("audio/pcm", "audio/l16"):
            rate = 24000
            for param in params.split(";"):
                key, _, value = param.strip().partition("=")
                if key.lower() == "rate" and value.isdigit():
                    rate = int(value)
            return to_speech_wav(raw, source="pcm", pcm_rate=rate)
        if media in _WAV_TYPES or raw[:4] == b"RIFF":
            return to_speech_wav(raw, source="wav")
    except BadAudio:
        pass
    raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the speech server sent unusable audio")


class SpeechRecognition(Family):
    name = "asr"

    def max_body_bytes(self, policies: Policies) -> int:
        return policies.requests.asr.max_body_bytes

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        return _transcription_job(Transcription(_parsed(asr.parse_asr, body)), policies)

    def model(self, job: Job, policies: Policies) -> str | None:
        return job.model or policies.requests.asr.default_model

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        job_: Transcription = job.request
        req = job_.req
        app = ctx.app
        where = ("audio_url",) if job_.upload is None else ("file",)
        if job_.upload is None:
            audio = await _fetch_audio(ctx, req.audio_url, where)
        else:
            audio = job_.upload
        try:
            info = probe(audio)
        except NotAudio:
            if job_.upload is None:
                raise _unfetchable(where) from None
            raise validation_failed([{"loc": ["body", "file"], "type": "not_audio",
                                      "msg": "the file is not WAV, MP3, M4A, WEBM, FLAC or OGG "
                                             "audio"}]) from None
        longest = job.worst.audio_ms / 1000
        if info.duration_s is not None and info.duration_s > longest:
            raise validation_failed([{"loc": ["body", *where], "type": "audio_too_long",
                                      "msg": f"the audio is longer than {longest:g} s"}])
        content_type, forms = _forms(job_, pool, audio, info.format)
        headers = {"Content-Type": content_type, "Accept": "application/json",
                   "X-Request-Id": ctx.request_id}

        async def use(backend: Backend, upstream: http1.Response) -> Answer:
            raw = await read_answer(upstream, ANSWER_MAX_BYTES)
            try:
                transcript = asr.read_transcript(orjson.loads(raw), req, info.duration_s)
            except (orjson.JSONDecodeError, asr.UnusableAnswer):
                raise GatewayError(ErrorKind.UPSTREAM_ERROR,
                                   "the speech recognition server sent an unusable answer"
                                   ) from None
            used = Units(audio_ms=min(math.ceil(transcript.duration_s * 1000),
                                      job.worst.audio_ms))
            if job_.response_format == "spec":
                body, content_type = orjson.dumps(asr.answer(transcript, req)), JSON
            else:
                body, content_type = openai_audio.render_transcription(transcript, job_)
            return Answer(body, content_type, used)

        return await app[UPSTREAMS].call(
            pool, lambda b: asr.upstream_path(req, b.spec.api), lambda b: forms[b.spec.api],
            headers, ctx.client_headers, use)


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
        return _transcription_job(_parsed(openai_audio.parse_transcription, form.fields, files,
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


class Generation(Family):
    """Image (`name = "image"`) or video (`"video"`) generation by a named provider."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path

    def max_body_bytes(self, policies: Policies) -> int:
        return policies.requests.generation.max_body_bytes

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        limits = policies.requests.generation
        req: generation.ImageRequest | generation.VideoRequest
        if self.name == "image":
            image, sent = _parsed(generation.parse_image, body, limits.max_images)
            req, worst = image, Units(images=image.n or 1)
        else:
            video, sent = _parsed(generation.parse_video, body, limits.max_video_s)
            seconds = generation.video_seconds_asked(video, limits.max_video_s)
            req, worst = video, Units(video_ms=seconds * 1000)
        return Job(generation.forwarded(sent), req.model, req.mode or "auto", bool(req.async_),
                   worst, params["provider"])

    def model(self, job: Job, policies: Policies) -> str | None:
        return None  # the provider's pool names it

    def pool(self, router: Router, job: Job, policies: Policies, mode: str = "direct") -> Pool:
        if mode != "direct":
            raise GatewayError(ErrorKind.NOT_FOUND, f"{self.name} providers are not offered "
                               "in network mode")
        return router.provider_pool(self.name, job.provider or "", job.model)

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        app = ctx.app
        body = orjson.dumps({**job.request, "model": pool.model})
        headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        cap = app[LIVE].current.policies.requests.generation.max_media_bytes

        async def use(backend: Backend, upstream: http1.Response) -> Answer:
            raw = await read_answer(upstream, cap)
            content_type = upstream.headers.get("Content-Type", "application/octet-stream")
            media = content_type.partition(";")[0].strip().lower()
            try:
                answer = orjson.loads(raw) if media == "application/json" else None
            except orjson.JSONDecodeError:
                answer = None
            if self.name == "image":
                used = Units(images=generation.images_in(answer, media))
            else:
                ms = generation.video_ms_in(raw, answer, media)
                used = Units(video_ms=job.worst.video_ms if ms is None else ms)
            if not used.counts():
                raise GatewayError(ErrorKind.UPSTREAM_ERROR,
                                   f"the {self.name} provider sent an unusable answer")
            return Answer(raw, content_type, used)

        return await app[UPSTREAMS].call(pool, self.path, lambda b: body, headers,
                                         ctx.client_headers, use)


TTS = SpeechSynthesis()
ASR = SpeechRecognition()
OPENAI_SPEECH = OpenAISpeech()
OPENAI_TRANSCRIPTIONS = OpenAITranscription("transcribe")
OPENAI_TRANSLATIONS = OpenAITranscription("translate")
IMAGE = Generation("image", "/v1/images/generations")
VIDEO = Generation("video", "/v1/videos/generations")
