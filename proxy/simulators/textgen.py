"""Deterministic text generation and token counting for the upstream simulators.

Pure: no aiohttp, no I/O. The gateway reuses `count_tokens` and `prompt_tokens` for its
worst-case estimates, so the rule is deliberately simple and documented:

    a token is one match of the regex ``\\w+|[^\\w\\s]`` (a run of word characters, or one
    punctuation character); whitespace is free.

Every generated token is one vocabulary word with a leading space (" lorem"), so the
generated text always counts back to exactly the number of tokens generated.
"""

from __future__ import annotations

import hashlib
import random
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
# One streamed tool-argument fragment per token, leading whitespace attached.
_FRAGMENT_RE = re.compile(r"\s*(?:\w+|[^\w\s])")

VOCAB: tuple[str, ...] = tuple(
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua enim ad minim veniam quis nostrud "
    "exercitation ullamco laboris nisi aliquip ex ea commodo consequat duis aute irure "
    "in reprehenderit voluptate velit esse cillum fugiat nulla pariatur excepteur sint "
    "occaecat cupidatat non proident sunt culpa qui officia deserunt mollit anim id est "
    "laborum".split()
)
REASONING_TOKENS = 8  # vLLM thinking models: fixed-length reasoning before the answer
MESSAGE_OVERHEAD = 4  # per-message template tokens (role markers), as OpenAI's cookbook rule

# Internal finish reasons use TGI's names; each dialect maps them (see openai_chat.Dialect).
EOS, LENGTH, STOP_SEQUENCE, TOOL_CALLS = "eos_token", "length", "stop_sequence", "tool_calls"


def count_tokens(text: str) -> int:
    """Number of matches of ``\\w+|[^\\w\\s]`` in `text`."""
    return sum(1 for _ in _TOKEN_RE.finditer(text))


def content_text(content: object) -> str:
    """Text of an OpenAI message `content`: a string, or the `text` of its text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def tool_call_tokens(name: str, arguments: str) -> int:
    return count_tokens(name + arguments)


def prompt_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """Σ over messages of 4 + tokens of the text content + tokens of each tool call."""
    total = 0
    for message in messages:
        total += MESSAGE_OVERHEAD + count_tokens(content_text(message.get("content")))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                name, args = function.get("name"), function.get("arguments")
                total += tool_call_tokens(
                    name if isinstance(name, str) else "", args if isinstance(args, str) else ""
                )
    return total


def prompt_key(model: str, prompt: object) -> bytes:
    """Stable digest of (model, canonical JSON of messages or inputs) seeding generation."""
    canonical = orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(model.encode() + b"\0" + canonical).digest()


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON-encoded object, as OpenAI sends it

    @property
    def tokens(self) -> int:
        return tool_call_tokens(self.name, self.arguments)

    def fragments(self) -> list[str]:
        """Argument pieces for streaming, one token each; they concatenate to `arguments`."""
        return _FRAGMENT_RE.findall(self.arguments)


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: tuple[str, ...]
    finish: str  # EOS | LENGTH | STOP_SEQUENCE | TOOL_CALLS
    stop: str | None = None  # the stop string that matched
    reasoning: tuple[str, ...] = ()
    tool_call: ToolCall | None = None

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    @property
    def completion_tokens(self) -> int:
        tool = self.tool_call.tokens if self.tool_call else 0
        return len(self.tokens) + len(self.reasoning) + tool


def pick_tool(tools: Sequence[Any] | None, tool_choice: object) -> Mapping[str, Any] | None:
    """The tool's `function` object to call: the named one, else the first; None for "none"."""
    if not tools or tool_choice == "none":
        return None
    functions = [t["function"] for t in tools if isinstance(t, dict) and isinstance(
        t.get("function"), dict)]
    if not functions:
        return None
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        for function in functions:
            if function.get("name") == wanted:
                return function  # type: ignore[no-any-return]
    return functions[0]  # type: ignore[no-any-return]


def _argument_value(schema: object, rng: random.Random) -> object:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # e.g. ["string", "null"]
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return rng.choice(VOCAB)
    if kind in ("integer", "number"):
        return rng.randrange(100)
    if kind == "boolean":
        return True
    return None


def _tool_call(function: Mapping[str, Any], rng: random.Random) -> ToolCall:
    params = function.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    args = {key: _argument_value(schema, rng) for key, schema in (props or {}).items()}
    return ToolCall(str(function.get("name", "")), orjson.dumps(args).decode())


def _cut_at_stop(tokens: list[str], stops: Sequence[str]) -> tuple[list[str], str | None]:
    """Truncate before the earliest stop string; a partly kept word stays one token."""
    text = "".join(tokens)
    hits = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    if not hits:
        return tokens, None
    cut, stop = min(hits)
    kept: list[str] = []
    pos = 0
    for token in tokens:
        if pos + len(token) > cut:
            if text[pos:cut].strip():
                kept.append(text[pos:cut])
            break
        kept.append(token)
        pos += len(token)
    return kept, stop


def generate(
    key: bytes,
    seed: int,
    *,
    natural: int,
    limit: int | None = None,
    stop: Sequence[str] = (),
    tool: Mapping[str, Any] | None = None,
    reasoning: bool = False,
) -> Generation:
    """One deterministic completion for (key, seed).

    `natural` is the length the "model" wants; `limit` the request's max tokens (reasoning
    counts against it, as on vLLM). A tool, when given, replaces the text answer.
    """
    rng = random.Random(key + seed.to_bytes(8, "big", signed=True))
    budget = limit if limit is not None else natural + (REASONING_TOKENS if reasoning else 0)
    thoughts = tuple(" " + rng.choice(VOCAB) for _ in range(
        min(REASONING_TOKENS, budget) if reasoning else 0))
    if tool is not None:
        return Generation((), TOOL_CALLS, reasoning=thoughts, tool_call=_tool_call(tool, rng))
    room = budget - len(thoughts)
    count = min(natural, room)
    tokens = [" " + rng.choice(VOCAB) for _ in range(count)]
    tokens, matched = _cut_at_stop(tokens, stop)
    if matched is not None:
        finish = STOP_SEQUENCE
    else:
        finish = LENGTH if room < natural else EOS
    return Generation(tuple(tokens), finish, matched, thoughts)


def token_id(token: str) -> int:
    """A stable fake vocabulary id (TGI details and generate_stream show ids)."""
    return 1000 + zlib.crc32(token.encode()) % 30000


def token_logprob(token: str) -> float:
    return -round((zlib.crc32(token.encode()) % 2000) / 1000, 3)


def top_alternatives(token: str, n: int) -> list[tuple[str, float]]:
    """`n` (token, logprob) candidates, best first; the sampled token leads."""
    if n <= 0:
        return []
    best = token_logprob(token)
    start = zlib.crc32(token.encode()) % len(VOCAB)
    others = [w for k in range(n) if (w := " " + VOCAB[(start + k) % len(VOCAB)]) != token]
    ranked = [(alt, round(best - 0.5 * k, 3)) for k, alt in enumerate(others[: n - 1], 1)]
    return [(token, best), *ranked]
