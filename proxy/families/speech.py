"""Speech synthesis on the request path: a preset, random or cloned voice (its sample fetched
under the SSRF rules) -> `/v1/audio/speech` -> the WAV checked and converted to 16-bit PCM mono
24 kHz -> charged per character. The request's schema and rules are in proxy.families.tts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.config import Policies
from proxy.credits.pricing import Units
from proxy.errors import ErrorKind, GatewayError
from proxy.families import openai_audio, tts
from proxy.families.base import Answer, Ctx, Family, Job, parsed
from proxy.families.fetched import fetch_audio, unfetchable
from proxy.families.openai_audio import Speech
from proxy.media.audio import NotAudio, probe
from proxy.media.wav import SPEECH_RATE, BadAudio, to_speech_wav, wav_bytes
from proxy.upstream import http1
from proxy.upstream.client import read_answer
from proxy.upstream.pool import Backend, Pool

SPEECH_HEADER = 44  # the canonical WAV header to_speech_wav writes
_WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})


class SpeechSynthesis(Family):
    name = "tts"

    def max_body_bytes(self, policies: Policies) -> int:
        return policies.requests.tts.max_body_bytes

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        req: tts.TtsRequest = parsed(tts.parse_tts, body, policies.requests.tts.max_characters)
        return _speech_job(Speech(req))

    def model(self, job: Job, policies: Policies) -> str | None:
        return job.model or policies.requests.tts.default_model

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        speech: Speech = job.request
        req = speech.req
        sample = None
        if req.custom_voice is not None:
            sample = await fetch_audio(ctx, req.custom_voice.url, ("custom_voice", "url"))
            try:
                probe(sample)
            except NotAudio:
                raise unfetchable(("custom_voice", "url")) from None
        preset = tts.pick_voice(req)
        headers = {"Content-Type": "application/json", "Accept": "audio/wav",
                   "X-Request-Id": ctx.request_id}
        reply = {"X-Voice": "custom" if sample else preset}
        cap = ctx.policies.requests.tts.max_audio_bytes
        limit = min(b.spec.max_input_chars for b in pool.backends)

        async def use(backend: Backend, upstream: http1.Response) -> bytes:
            return speech_wav(await read_answer(upstream, cap), upstream.headers)

        pieces = []
        for text in tts.split_text(req.text, limit):  # one piece, unless the server's limit
            def body_for(backend: Backend, text: str = text) -> bytes:
                voice = tts.server_voice(preset, backend.spec.voices)
                return orjson.dumps(tts.speech_body(req, text, pool.model, voice, sample,
                                                    speech.speed))

            pieces.append(await ctx.upstreams.call(pool, tts.SPEECH_PATH, body_for, headers,
                                                   ctx.client_headers, use))
        audio = pieces[0] if len(pieces) == 1 else join_speech(pieces)
        used = Units(characters=len(req.text))
        if speech.response_format == "pcm":  # OpenAI's raw 16-bit mono 24 kHz
            return Answer(audio[SPEECH_HEADER:], "audio/pcm", used, reply)
        return Answer(audio, "audio/wav", used, reply)


class OpenAISpeech(SpeechSynthesis):
    """`/v2/compat/v1/audio/speech`: OpenAI's spelling of the same request."""

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        return _speech_job(parsed(openai_audio.parse_speech, body,
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


TTS = SpeechSynthesis()
OPENAI_SPEECH = OpenAISpeech()
