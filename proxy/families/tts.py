"""Speech synthesis: the spec's TTS request, its usage rules, and the OpenAI-style
`/v1/audio/speech` body a TTS server gets. Pure.

Voice selection (spec): exactly one of a preset (`preset_voice`), a cloned voice
(`custom_voice`: the gateway fetches the sample itself, under the SSRF rules, and sends it as
`voice_sample`), or neither (a random preset, named in the `X-Voice` response header). A preset
is sent to a server as its `voices` entry in backends.toml says, else in lower case.
"""

from __future__ import annotations

import base64
import random
import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from proxy.config import VOICE_PRESETS
from proxy.validate import ErrorItem, validate_with, value_error

Preset = Literal["Alice", "Avery", "Brock", "Chloe", "Ella", "Emma", "Grace", "Karen", "Kevin",
                 "Lucas", "Matt", "William"]
assert Preset.__args__ == VOICE_PRESETS  # type: ignore[attr-defined]  # one list, two spellings
SPEECH_PATH = "/v1/audio/speech"
# The spec's schema bound; requests.toml [tts] max_characters may set a lower one (the spec
# also says 2,000 in one place).
TEXT_MAX = 10_000
URL_MAX = 2048


class CustomVoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    url: Annotated[str, Meta(min_length=1, max_length=URL_MAX,
                             description="URL of an audio sample of the voice (fetched by the "
                                         "gateway: http or https, public hosts only)")]
    context_text: Annotated[str, Meta(max_length=10_000,
                                      description="What the sample says")] | None = None


class TtsRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """The spec's TTS table, one field per row."""

    text: Annotated[str, Meta(min_length=1, max_length=TEXT_MAX,
                              description="Text to speak; the gateway may be set to allow "
                                          "fewer characters (requests.toml [tts])")]
    model: Annotated[str, Meta(min_length=1, description="Default <namespace>/csm-1b")] | None \
        = None
    preset_voice: Annotated[Preset | None, Meta(description="One of the presets")] = None
    custom_voice: Annotated[CustomVoice | None,
                            Meta(description="Voice cloning; not with preset_voice")] = None
    mode: Literal["auto", "network", "direct"] | None = None
    async_: Annotated[bool | None, Meta(description="Return a task handle (202)")] = \
        msgspec.field(default=None, name="async")

    # parse_tts's usage rule, as the OpenAPI document states it.
    json_schema_rules: ClassVar[dict[str, Any]] = {"allOf": [
        {"description": "preset_voice cannot be combined with custom_voice",
         "anyOf": [{"properties": {"preset_voice": {"type": "null"}}},
                   {"properties": {"custom_voice": {"type": "null"}}}]}]}


def parse_tts(body: object, max_characters: int) -> TtsRequest:
    """422 (RequestInvalid) for a body off the table, both voices, or text over the policy."""

    def rules(req: TtsRequest) -> list[ErrorItem]:
        faults: list[ErrorItem] = []
        if len(req.text) > max_characters:
            faults.append({"loc": ["body", "text"], "type": "string_too_long",
                           "msg": f"String should have at most {max_characters} characters"})
        if req.preset_voice is not None and req.custom_voice is not None:
            faults.append(value_error(("body", "custom_voice"),
                                      "preset_voice cannot be combined with custom_voice"))
        return faults

    return validate_with(body, TtsRequest, rules)


def pick_voice(req: TtsRequest, rng: random.Random | None = None) -> str:
    """The preset the request names, or a random one (neither voice given)."""
    if req.preset_voice is not None:
        return req.preset_voice
    return (rng or random).choice(VOICE_PRESETS)


def server_voice(preset: str, voices: dict[str, str]) -> str:
    return voices.get(preset, preset.lower())


_SENTENCE_END = re.compile(r"(?<=[.!?;:\u3002\uff01\uff1f])\s+")


def split_text(text: str, limit: int) -> list[str]:
    """Pieces of at most `limit` characters for servers that take no more at once: whole
    sentences packed together, a longer sentence split between words, a longer word cut."""
    if len(text) <= limit:
        return [text]  # as written, spaces and all
    pieces: list[str] = []
    current = ""
    for sentence in _SENTENCE_END.split(text):
        for part in _fit(sentence, limit):
            joined = f"{current} {part}" if current else part
            if len(joined) <= limit:
                current = joined
            else:
                pieces.append(current)
                current = part
    if current:
        pieces.append(current)
    return pieces


def _fit(sentence: str, limit: int) -> list[str]:
    if len(sentence) <= limit:
        return [sentence]
    parts: list[str] = []
    current = ""
    for word in sentence.split():
        while len(word) > limit:
            if current:
                parts.append(current)
                current = ""
            parts.append(word[:limit])
            word = word[limit:]
        joined = f"{current} {word}" if current else word
        if len(joined) <= limit:
            current = joined
        else:
            parts.append(current)
            current = word
    if current:
        parts.append(current)
    return parts


def speech_body(req: TtsRequest, text: str, model: str, voice: str, sample: bytes | None,
                speed: float | None = None) -> dict[str, Any]:
    """OpenAI's speech request for `text` (the request's, or a piece of it); WAV asked for (the
    gateway checks and converts what comes)."""
    body: dict[str, Any] = {"model": model, "input": text, "voice": voice,
                            "response_format": "wav"}
    if speed is not None:
        body["speed"] = speed
    if sample is not None:
        body["voice_sample"] = {"audio": base64.b64encode(sample).decode(),
                                "context_text": (req.custom_voice.context_text
                                                 if req.custom_voice else None) or ""}
    return body
