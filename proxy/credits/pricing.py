"""Credit arithmetic: holds, costs, usage, and credit amounts as people write them. Pure.

Money is integer micro-credits (1 credit = 1,000,000). Rounding has one rule: a request's cost
is computed exactly as (tokens * price per 1k) summed over its parts, then divided by 1000 and
rounded UP once, per request. A charge never exceeds the request's hold. Prompt tokens the
engine served from its prefix cache (`usage.prompt_tokens_details.cached_tokens`) are one part
with their own price (`cached_prompt_per_1k_tokens`, by default the prompt price).

The hold is the worst case: an upper bound on the prompt (its UTF-8 byte count: no tokenizer
makes more tokens than bytes, plus an allowance for each media part, `media_tokens`) plus the
completion cap for each of the `n` choices.
When a stream is cut before the upstream reports usage, the charge is an estimate that is never
below the truth for the prompt: its upper bound (the engine got all of it), and one completion
token per content chunk delivered.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import msgspec
import orjson

from proxy.config import Rates

MICRO = 1_000_000
PER_MESSAGE_OVERHEAD = 8  # role and separators around each message


@dataclass(frozen=True, slots=True)
class ChatUsage:
    prompt_tokens: int
    completion_tokens: int
    estimated: bool = False  # True when counted by the gateway rather than reported upstream
    cached_tokens: int = 0  # of the prompt tokens, served from the engine's prefix cache


def cached_prompt_price(rates: Rates) -> int:
    cached = rates.cached_prompt_per_1k_tokens
    return rates.prompt_per_1k_tokens if cached is None else cached


def chat_cost(rates: Rates, usage: ChatUsage) -> int:
    return chat_price(rates, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


def chat_price(rates: Rates, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int = 0) -> int:
    """`chat_cost` of bare counts (a replay prices a day's requests without a `ChatUsage` each)."""
    cached = min(cached_tokens, prompt_tokens)
    exact = ((prompt_tokens - cached) * rates.prompt_per_1k_tokens
             + cached * cached_prompt_price(rates)
             + completion_tokens * rates.completion_per_1k_tokens)
    return -(-exact // 1000)


def chat_worst(body: dict[str, Any], max_tokens: int) -> ChatUsage:
    """The most a chat request can use: a bound on its prompt, and its cap for each of its
    `n` choices (one walk of the body for its hold and its token reservation)."""
    choices = body.get("n")
    n = choices if isinstance(choices, int) and choices > 0 else 1
    return ChatUsage(prompt_upper_bound(body), max_tokens * n)


def worst_cost(rates: Rates, worst: ChatUsage) -> int:
    """The hold for `worst`: every prompt token at the dearer of the two prompt prices."""
    exact = (worst.prompt_tokens * max(rates.prompt_per_1k_tokens, cached_prompt_price(rates))
             + worst.completion_tokens * rates.completion_per_1k_tokens)
    return -(-exact // 1000)


def chat_hold(rates: Rates, body: dict[str, Any], max_tokens: int) -> int:
    return worst_cost(rates, chat_worst(body, max_tokens))


def chat_tokens(body: dict[str, Any], max_tokens: int) -> int:
    """What the tier's token limits reserve at admission."""
    worst = chat_worst(body, max_tokens)
    return worst.prompt_tokens + worst.completion_tokens


def prompt_upper_bound(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    return (sum(len(text.encode()) for text in _texts(body)) + PER_MESSAGE_OVERHEAD * count
            + sum(media_tokens(part) for part in media_parts(body)))


# ---- media parts: what the engine may fetch or decode (images, audio, video, files) ----------

# Prompt tokens one media part may make, at most (docs/chat-styles.md, "Media parts"):
# - an image: a fixed allowance, whatever its size: vLLM's vision processors resize to a pixel
#   ceiling (Qwen2-VL's default max_pixels, 12,845,056 = 16,384 patches of 28x28, is the
#   largest of the common ones);
# - audio: its decoded bytes (audio encoders make at most ~50 tokens a second, and no codec
#   stores a second of audio in fewer bytes than that);
# - a video: a fixed allowance of a 128k context (frames are sampled to fit the context);
# - a file: its decoded bytes, at least an image's allowance.
IMAGE_PROMPT_TOKENS = 16_384
VIDEO_PROMPT_TOKENS = 131_072
# The keys of an OpenAI/vLLM content part that carry media (vLLM also reads a part by its key
# alone, without `type`), and the kind of media each carries.
MEDIA_KEYS = {"image_url": "image", "audio_url": "audio", "input_audio": "audio",
              "video_url": "video", "file": "file", "image_embeds": "embeds",
              "audio_embeds": "embeds", "video_embeds": "embeds", "image_pil": "embeds"}


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One media part of an OpenAI-style body, as the engine would read it."""

    loc: tuple[str | int, ...]  # in the OpenAI-style body: ("messages", i, "content", j, key)
    kind: str  # image | audio | video | file | embeds
    url: str | None  # the URL it names (a data: URL included); None when it names none
    size: int  # decoded bytes of its inline data (a data: URL's or a base64 field's)
    file_id: bool = False  # a `file_id` reference (to storage the engine has, or not)


def media_parts(body: dict[str, Any]) -> Iterator[MediaPart]:
    """Every media part of every message's content, in order."""
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict):
                continue
            if part.get("type") == "prompt_embeds":  # vLLM: embeddings in `data`
                yield MediaPart(("messages", i, "content", j, "type"), "embeds", None, 0)
            for key, value in part.items():
                if (kind := MEDIA_KEYS.get(key)) is not None:
                    yield _media_part(("messages", i, "content", j, key), kind, value)


def _media_part(loc: tuple[str | int, ...], kind: str, value: object) -> MediaPart:
    if isinstance(value, str):  # vLLM's short form: {"image_url": "<url>"}
        return MediaPart(loc, kind, value, data_url_size(value))
    fields = value if isinstance(value, dict) else {}
    url = fields.get("url")
    if isinstance(url, str):
        return MediaPart((*loc, "url"), kind, url, data_url_size(url))
    if isinstance(data := fields.get("file_data"), str):  # a file: a data: URL or base64
        if data.startswith("data:"):
            return MediaPart((*loc, "file_data"), kind, data, data_url_size(data))
        return MediaPart((*loc, "file_data"), kind, None, base64_size(data))
    if isinstance(data := fields.get("data"), str):  # input_audio: base64
        return MediaPart((*loc, "data"), kind, None, base64_size(data))
    return MediaPart(loc, kind, None, 0, file_id="file_id" in fields)


def base64_size(data: str) -> int:
    """Decoded bytes of base64 text, at most (padding and line breaks counted as data)."""
    return -(-len(data) * 3 // 4)


def data_url_size(url: str) -> int:
    """Decoded bytes of a data: URL's payload, at most; 0 for any other URL."""
    if url[:5].lower() != "data:":
        return 0
    header, _, payload = url.partition(",")
    return base64_size(payload) if header.lower().endswith(";base64") else len(payload)


def media_tokens(part: MediaPart) -> int:
    """The most prompt tokens `part` can make (the allowances above)."""
    if part.kind == "image":
        return IMAGE_PROMPT_TOKENS
    if part.kind == "video":
        return VIDEO_PROMPT_TOKENS
    if part.kind == "file":
        return max(part.size, IMAGE_PROMPT_TOKENS)
    return part.size  # audio (embeds never reach an engine: refused)


def usage_from(reported: object) -> ChatUsage | None:
    """The upstream's OpenAI-style usage (`completion_tokens` already includes reasoning)."""
    if not isinstance(reported, dict):
        return None
    prompt, completion = reported.get("prompt_tokens"), reported.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return ChatUsage(max(0, prompt), max(0, completion), cached_tokens=cached_tokens(reported))


def cached_tokens(usage: object) -> int:
    """`usage.prompt_tokens_details.cached_tokens` (OpenAI's and vLLM's), 0 when absent."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached > 0 else 0


def parse_credits(text: str) -> int:
    """'12.5' credits -> 12_500_000 micro-credits; exact (no floats); at most 6 decimals."""
    try:
        amount = Decimal(text.strip())
    except InvalidOperation:
        raise ValueError(f"not a number of credits: {text!r}") from None
    micro = amount * MICRO
    if not amount.is_finite() or micro != micro.to_integral_value():
        raise ValueError("credits have at most 6 decimal places")
    return int(micro)


def format_credits(micro: int) -> str:
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(micro), MICRO)
    return f"{sign}{whole}.{frac:06d}"


def _texts(body: dict[str, Any]) -> Iterable[str]:
    """Every piece of text the prompt carries: message contents, tool calls, tool schemas."""
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]
        calls = message.get("tool_calls")
        if calls:
            yield orjson.dumps(calls).decode()
    tools = body.get("tools")
    if tools:
        yield orjson.dumps(tools).decode()  # its JSON: no recursion of ours, bytes >= tokens


@dataclass(frozen=True, slots=True)
class Units:
    """What a speech, transcription, image, video or embeddings request used (or may use, for
    its hold). Seconds are kept as milliseconds so the ledger stays in integers."""

    characters: int = 0  # TTS input
    prompt_tokens: int = 0  # embeddings' input (priced as a chat prompt's)
    audio_ms: int = 0  # ASR input, from the decoded audio
    images: int = 0
    video_ms: int = 0

    def counts(self) -> dict[str, int]:
        """The non-zero units, as the running totals and the journal name them."""
        return {name: value for name in self.__slots__ if (value := getattr(self, name))}


class Used(msgspec.Struct, frozen=True, gc=False):
    """What a request used, under the names the meter gives its units (the access log's
    `units`; others ignored), for pricing it again at other prices (a shadow, a replay)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    characters: int = 0
    audio_ms: int = 0
    images: int = 0
    video_ms: int = 0

    def __bool__(self) -> bool:
        return any(msgspec.structs.astuple(self))


def used_cost(rates: Rates, family: str, used: Used) -> int:
    """What `used` costs at `rates`, by the meter's rules for the `family` (micro-credits)."""
    if family == "chat":
        return chat_price(rates, used.prompt_tokens, used.completion_tokens, used.cached_tokens)
    return units_price(rates, used.characters, used.prompt_tokens, used.audio_ms, used.images,
                       used.video_ms)


def units_cost(rates: Rates, units: Units) -> int:
    return units_price(rates, units.characters, units.prompt_tokens, units.audio_ms,
                       units.images, units.video_ms)


def units_price(rates: Rates, characters: int = 0, prompt_tokens: int = 0, audio_ms: int = 0,
                images: int = 0, video_ms: int = 0) -> int:
    """Exact sum over the units, rounded up once: per 1k characters, per 1k input tokens, per
    audio second, per image, per video second (`units_cost` of bare counts)."""
    exact = (characters * rates.per_1k_characters
             + prompt_tokens * rates.prompt_per_1k_tokens
             + audio_ms * rates.per_audio_second
             + images * rates.per_image * 1000
             + video_ms * rates.per_video_second)
    return -(-exact // 1000)
