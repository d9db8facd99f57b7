"""Speech synthesis on the request path: a preset, random or cloned voice (its sample fetched
under the SSRF rules) -> `/v1/audio/speech` -> the WAV checked and converted to 16-bit PCM mono
24 kHz -> charged per character. The request's schema and rules are in proxy.families.tts.

A cloned voice's sample is bounded (requests.toml [tts]): the fetch stops past
`max_voice_sample_bytes`, and a sample longer than `max_voice_sample_s` (by what it carries,
proxy.media.measure, or by its headers) is refused before the server is called. Each of its
seconds is priced as `voice_sample_characters_per_s` characters: held at the longest sample,
charged as measured (docs/media.md)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import orjson

from proxy.config import Policies
from proxy.config.policies import TtsRequestPolicy
from proxy.credits.pricing import Units
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.families import openai_audio, tts
from proxy.families.base import Answer, Ctx, Family, Job, parsed
from proxy.families.fetched import fetch_audio, unfetchable
from proxy.families.openai_audio import Speech
from proxy.media.audio import NotAudio
from proxy.media.measure import measure
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
        return _speech_job(Speech(req), policies.requests.tts)

    def model(self, job: Job, policies: Policies) -> str | None:
        return job.model or policies.requests.tts.default_model

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        speech: Speech = job.request
        req = speech.req
        policy = ctx.policies.requests.tts
        sample, sample_chars = None, 0
        if req.custom_voice is not None:
            sample, sample_chars = await _voice_sample(ctx, req.custom_voice.url, policy)
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
                                                   ctx.client_headers, use, ticket=ctx.ticket,
                                                   early=ctx.early))
        audio = pieces[0] if len(pieces) == 1 else join_speech(pieces)
        used = Units(characters=min(len(req.text) + sample_chars, job.worst.characters))
        if speech.response_format == "pcm":  # OpenAI's raw 16-bit mono 24 kHz
            return Answer(audio[SPEECH_HEADER:], "audio/pcm", used, reply)
        return Answer(audio, "audio/wav", used, reply)


class OpenAISpeech(SpeechSynthesis):
    """`/v2/compat/v1/audio/speech`: OpenAI's spelling of the same request."""

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        return _speech_job(parsed(openai_audio.parse_speech, body,
                                  policies.requests.tts.max_characters), policies.requests.tts)


def _speech_job(speech: Speech, policy: TtsRequestPolicy) -> Job:
    """Held: the text's characters, and the longest voice sample's when one is named."""
    req = speech.req
    sample = 0 if req.custom_voice is None else \
        policy.max_voice_sample_s * policy.voice_sample_characters_per_s
    return Job(speech, req.model, req.mode or "auto", bool(req.async_),
               Units(characters=len(req.text) + sample))


_SAMPLE_LOC = ("custom_voice", "url")


async def _voice_sample(ctx: Ctx, url: str, policy: TtsRequestPolicy) -> tuple[bytes, int]:
    """The sample, fetched within its byte cap and measured; and its price in characters."""
    limits = (f", of at most {policy.max_voice_sample_bytes} bytes and "
              f"{policy.max_voice_sample_s} s")
    sample = await fetch_audio(ctx, url, _SAMPLE_LOC, policy.max_voice_sample_bytes, limits)
    longest = policy.max_voice_sample_s
    try:
        measured = await asyncio.to_thread(measure, sample, longest)
    except NotAudio:
        raise unfetchable(_SAMPLE_LOC, limits) from None
    if max(measured.seconds, measured.claimed_s or 0.0) > longest:
        raise validation_failed([{"loc": ["body", *_SAMPLE_LOC], "type": "voice_sample_too_long",
                                  "msg": f"the voice sample is longer than {longest} s"}])
    seconds = math.ceil(round(measured.seconds * 1000, 6)) / 1000
    return sample, math.ceil(round(seconds * policy.voice_sample_characters_per_s, 6))


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
