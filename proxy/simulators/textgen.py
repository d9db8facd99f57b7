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
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import orjson

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
# One streamed tool-argument fragment per token, leading whitespace attached.
_FRAGMENT_RE = re.compile(r"\s*(?:\w+|[^\w\s])")

_WORDS = """
    lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut
    labore et dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco laboris
    nisi aliquip ex ea commodo consequat duis aute irure in reprehenderit voluptate velit esse
    cillum fugiat nulla pariatur excepteur sint occaecat cupidatat non proident sunt culpa qui
    officia deserunt mollit anim id est laborum
"""
VOCAB: tuple[str, ...] = tuple(_WORDS.split())
_SPACED = tuple(" " + word for word in VOCAB)
_N_WORDS = len(_SPACED)
REASONING_TOKENS = 8  # vLLM thinking models: fixed-length reasoning before the answer
MESSAGE_OVERHEAD = 4  # per-message template tokens (role markers), as OpenAI's cookbook rule

# Internal finish reasons use TGI's names; each dialect maps them (see openai_chat.Dialect).
EOS, LENGTH, STOP_SEQUENCE, TOOL_CALLS = "eos_token", "length", "stop_sequence", "tool_calls"


def count_tokens(text: str) -> int:
    """Number of matches of ``\\w+|[^\\w\\s]`` in `text`."""
    return len(_TOKEN_RE.findall(text))


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


def text_tokens(text: str) -> list[str]:
    """The tokens `count_tokens` counts, in order."""
    return _TOKEN_RE.findall(text)


def prompt_token_list(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tokens `prompt_tokens` counts, in order (what the prefix cache hashes): each
    message's text and tool calls inside its 4 template tokens, as a chat template frames
    them, so prompts that begin with the same messages begin with the same tokens."""
    tokens: list[str] = []
    for message in messages:
        role = message.get("role")
        tokens += ("<|start|>", role if isinstance(role, str) else "", "<|content|>")
        tokens += _TOKEN_RE.findall(content_text(message.get("content")))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                name, args = function.get("name"), function.get("arguments")
                tokens += _TOKEN_RE.findall((name if isinstance(name, str) else "")
                                            + (args if isinstance(args, str) else ""))
        tokens.append("<|end|>")
    return tokens


def prompt_key(model: str, prompt: object) -> bytes:
    """Stable digest of (model, canonical JSON of messages or inputs) seeding generation."""
    canonical = orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(model.encode() + b"\0" + canonical).digest()


class ToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON-encoded object, as OpenAI sends it

    @property
    def tokens(self) -> int:
        return tool_call_tokens(self.name, self.arguments)

    def fragments(self) -> list[str]:
        """Argument pieces for streaming, one token each; they concatenate to `arguments`."""
        return _FRAGMENT_RE.findall(self.arguments)


class Generation(NamedTuple):  # a NamedTuple: built per request, and cheaper than a dataclass
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
    functions = [
        t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]
    if not functions:
        return None
    chosen = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(chosen, dict):
        wanted = chosen.get("name")
        for function in functions:
            if function.get("name") == wanted:
                return function  # type: ignore[no-any-return]
    return functions[0]  # type: ignore[no-any-return]


def _properties(function: Mapping[str, Any]) -> Mapping[str, Any]:
    params = function.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}


def _argument_value(schema: object, draw: int) -> object:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # e.g. ["string", "null"]
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return VOCAB[draw % len(VOCAB)]
    if kind in ("integer", "number"):
        return draw % 100
    if kind == "boolean":
        return True
    return None


def _tool_call(function: Mapping[str, Any], draws: bytes) -> ToolCall:
    props = _properties(function)
    pairs = zip(props.items(), draws, strict=True)
    args = {key: _argument_value(schema, draw) for (key, schema), draw in pairs}
    return ToolCall(str(function.get("name", "")), orjson.dumps(args).decode())


def _cut_at_stop(tokens: list[str], stops: Sequence[str]) -> tuple[list[str], str | None]:
    """Truncate before the earliest stop string; a partly kept word stays one token."""
    if not stops:
        return tokens, None
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
    budget = limit if limit is not None else natural + (REASONING_TOKENS if reasoning else 0)
    n_thoughts = min(REASONING_TOKENS, budget) if reasoning else 0
    room = budget - n_thoughts
    count = 0 if tool is not None else min(natural, room)
    n_args = len(_properties(tool)) if tool is not None else 0
    # One SHAKE-256 call yields every draw: much cheaper per request than random.Random.
    seed_bytes = (seed % 2**64).to_bytes(8, "big")  # any int, as JSON allows
    draws = hashlib.shake_256(key + seed_bytes).digest(n_thoughts + count + n_args)
    words = [_SPACED[d % _N_WORDS] for d in draws[: n_thoughts + count]]
    thoughts = tuple(words[:n_thoughts])
    if tool is not None:
        call = _tool_call(tool, draws[n_thoughts:])
        return Generation((), TOOL_CALLS, reasoning=thoughts, tool_call=call)
    tokens, matched = _cut_at_stop(words[n_thoughts:], stop)
    finish = STOP_SEQUENCE if matched is not None else LENGTH if room < natural else EOS
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
