"""The words every config file uses: backend kinds, task families, modes, the value types with
their bounds, and `Section`, the base of every table (frozen, keyword-only, unknown keys refused).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

BackendKind = Literal["tgi", "vllm", "openai", "ollama", "whisper", "tts", "image", "video",
                      "tei"]

Family = Literal["chat", "tts", "asr", "image", "video", "embed"]
# How a request is run (DESIGN §6 "Modes"): on one backend of the model's direct pool, or
# redundantly on several of its network pool, the answer a quorum agrees on returned.
Mode = Literal["direct", "network"]

# Backend kinds that serve OpenAI-compatible `/v1/chat/completions` (vLLM, TGI's Messages API,
# OpenAI itself, Ollama's OpenAI dialect).
CHAT_KINDS: frozenset[str] = frozenset({"tgi", "vllm", "openai", "ollama"})
FAMILY_OF_KIND: dict[str, Family] = {
    "tgi": "chat", "vllm": "chat", "openai": "chat", "ollama": "chat",
    "whisper": "asr", "tts": "tts", "image": "image", "video": "video", "tei": "embed"}
# Kinds that may serve an embedding model instead of chat (`family = "embed"`): vLLM with
# `--runner pooling`, OpenAI's /v1/embeddings. Text-embeddings-inference ("tei") serves nothing
# else.
EMBED_KINDS: frozenset[str] = frozenset({"vllm", "openai", "tei"})
# The spec's TTS voice presets (what `preset_voice` may name).
VOICE_PRESETS = ("Alice", "Avery", "Brock", "Chloe", "Ella", "Emma", "Grace", "Karen", "Kevin",
                 "Lucas", "Matt", "William")

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base for every config table: immutable, keyword-only, unknown keys refused."""
