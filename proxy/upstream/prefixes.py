"""Which replica holds how much of a prompt in its prefix cache, as the gateway can tell: block
by block, from what it sent each replica. No I/O.

    blocks   a chat request's messages (and tools), rendered canonically, cut into blocks of
             `BLOCK_CHARS`, each named by a 64-bit checksum of the whole rendering up to its
             end (CRC-32 and Adler-32, carried from block to block: a chain, as vLLM names its
             KV blocks, at a tenth of a cryptographic hash's cost; a rare collision costs a
             placement, nothing else), so two prompts share their leading names exactly as far
             as they begin alike: every conversation that shares a system prompt finds its
             blocks, and every later turn of one conversation finds the earlier turns'
    index    per replica, the block names sent to it, least recently sent first, forgotten
             beyond what its KV cache can hold (in tokens, at the bytes per token its usage
             shows), each prompt from its end (its own `vllm:cache_config_info`, else
             `[routing] cache_tokens`); a prompt's match on a replica is its leading blocks found
             there
    session  an `X-Session-Id` seeds the chain: that conversation's turns follow one another
             whatever their messages, and share no blocks with other conversations

Only the checksums (8 bytes each) are kept; nothing keeps the prompt's text.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.upstream.routing import PromptView

BLOCK_CHARS = 256  # bytes of the canonical rendering per block (about 64 tokens)
MAX_BLOCKS = 512  # a prompt's first 128 KiB are matched; beyond, replicas tie anyway
# Bytes of the rendering per engine token, until the engines' usage tells (`learn`): what
# turns a KV cache's size into blocks, and unmatched bytes into tokens to prefill.
CHARS_PER_TOKEN = 4.0
SESSION_HEADER = "X-Session-Id"
EXPECTED_KEPT = 4096  # placements awaiting the engine's word on them
LAST_SENT_KEPT = 16_384  # prompts whose last replica is remembered past the room (~2 MB)
FIT_MIN, FIT_MAX = 0.5, 1.5  # how far the engines' word may move a replica's room


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the index sees it."""

    blocks: tuple[int, ...]  # chained checksums of its full blocks, first first
    chars: int  # the length of its canonical rendering


def prompt_of(body: Mapping[str, Any], session: str | None = None) -> Prompt | None:
    """The blocks of an OpenAI-shaped chat body (None when it has no messages list)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    tools = body.get("tools")
    try:
        parts = [orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)] if tools else []
        # Message by message, so a conversation's rendering only grows at its end.
        parts += [orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages]
    except orjson.JSONEncodeError:  # e.g. an integer past 64 bits: nothing to match
        return None
    text = memoryview(b"\x1e".join(parts))
    crc, adler = 0, 1
    if session:
        seed = b"session\0" + session.encode("utf-8", "replace") + b"\0"
        crc, adler = zlib.crc32(seed), zlib.adler32(seed)
    full = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    blocks = []
    for start in range(0, full * BLOCK_CHARS, BLOCK_CHARS):
        block = text[start:start + BLOCK_CHARS]
        crc, adler = zlib.crc32(block, crc), zlib.adler32(block, adler)
        blocks.append(crc << 32 | adler)
    return Prompt(tuple(blocks), len(text))


class PrefixIndex:
    """One pool's picture of its replicas' prefix caches (one per worker; other workers'
    placements arrive through `add` too: proxy.upstream.prefix_share)."""

    __slots__ = ("_expected", "_fit", "_held", "_last_sent", "_reported", "_room",
                 "chars_per_token", "default_tokens")

    def __init__(self, cache_tokens: int) -> None:
        self.default_tokens = cache_tokens
        self.chars_per_token = CHARS_PER_TOKEN
        self._held: dict[str, OrderedDict[int, float]] = {}  # block -> when last sent
        self._room: dict[str, int] = {}
        # Per replica, how much of its KV cache holds prompts, learned from what it reports
        # it found (`confirm`): running requests' own blocks take the rest.
        self._fit: dict[str, float] = {}
        # (replica, a placed prompt's last block) -> blocks the index expected it to find
        self._expected: OrderedDict[tuple[str, int], int] = OrderedDict()
        # Replicas whose engines report their evictions (proxy.upstream.kv_blocks).
        self._reported: set[str] = set()
        # A prompt's first block -> the replica it was last sent to, kept after the index
        # forgets the blocks themselves (`last_sent`).
        self._last_sent: OrderedDict[int, str] = OrderedDict()

    def learn(self, chars: int, tokens: int) -> None:
        """An engine counted `tokens` prompt tokens for a prompt of `chars` bytes (its usage):
        the bytes-per-token ratio follows its tokenizer (smoothed)."""
        if chars > 0 and tokens > 0:
            ratio = min(16.0, max(1.0, chars / tokens))
            self.chars_per_token += 0.1 * (ratio - self.chars_per_token)

    def resize(self, replica: str, cache_tokens: int | None) -> None:
        """The replica's KV cache, in tokens, as its engine reports it (None: not known)."""
        room = max(1, int((cache_tokens or self.default_tokens) * self.chars_per_token
                          * self._fit.get(replica, 1.0)) // BLOCK_CHARS)
        if self._room.get(replica) != room:
            self._room[replica] = room
            self._trim(replica)

    def tokens(self, prompt: Prompt) -> float:
        """The prompt's length in the engines' tokens (estimated)."""
        return prompt.chars / self.chars_per_token

    def uncached_tokens(self, replica: str, prompt: Prompt) -> float:
        """Tokens of `prompt` the replica would have to prefill: past its matched blocks."""
        return self.tokens_past(prompt, self.matched(replica, prompt))

    def tokens_past(self, prompt: Prompt, blocks: int) -> float:
        """Tokens of `prompt` past its first `blocks` blocks."""
        return max(0, prompt.chars - blocks * BLOCK_CHARS) / self.chars_per_token

    def matched(self, replica: str, prompt: Prompt) -> int:
        """How many leading blocks of `prompt` the replica was last seen to hold."""
        held = self._held.get(replica)
        if held is None:
            return 0
        count = 0
        for block in prompt.blocks:
            if block not in held:
                break
            count += 1
        return count

    def expect(self, replica: str, prompt: Prompt, matched: int) -> None:
        """`prompt` goes to `replica`, where the index holds its first `matched` blocks:
        remember it, for `confirm` to compare with what the engine reports finding."""
        if prompt.blocks:
            self._expected[(replica, prompt.blocks[-1])] = matched
            if len(self._expected) > EXPECTED_KEPT:
                self._expected.popitem(last=False)

    def reported(self, replica: str) -> None:
        """The replica's engine tells what it evicts (its KV-cache events): those leave the
        index as they go, and the index's own room, only a backstop now, is the most it
        allows (FIT_MAX), so it does not forget blocks the engine still holds (hit rate +1
        point over events alone on loadtests.routing's sessions, 2026-11-28)."""
        if replica not in self._reported:
            self._reported.add(replica)
            self._fit[replica] = FIT_MAX
            self._room.pop(replica, None)  # recomputed at the next `resize`

    def confirm(self, replica: str, prompt: Prompt, cached_tokens: int) -> None:
        """The engine reports having found `cached_tokens` of `prompt` in its cache: where the
        index expected more, the engine had already evicted them and holds less than the
        index thinks (its room shrinks a little); where less, it holds more (it grows)."""
        if not prompt.blocks or replica in self._reported:
            return
        expected = self._expected.pop((replica, prompt.blocks[-1]), None)
        if expected is None:
            return
        found = cached_tokens * self.chars_per_token / BLOCK_CHARS
        fit = self._fit.get(replica, 1.0)
        if expected > found + 1:
            fit *= 0.98
        elif expected < found - 1:
            fit *= 1.02
        self._fit[replica] = min(FIT_MAX, max(FIT_MIN, fit))

    def add(self, replica: str, blocks: Sequence[int], at: float) -> None:
        """The replica was sent these blocks at `at` (monotonic seconds): it holds them now,
        most recently used; the first the most recent of all, so a prompt is forgotten from
        its end, as vLLM evicts (a chain that lost its first block would match nothing)."""
        held = self._held.setdefault(replica, OrderedDict())
        for block in reversed(blocks):
            held[block] = at
            held.move_to_end(block)
        self._trim(replica)
        if blocks:
            self._last_sent[blocks[0]] = replica
            self._last_sent.move_to_end(blocks[0])
            if len(self._last_sent) > LAST_SENT_KEPT:
                self._last_sent.popitem(last=False)

    def last_sent(self, prompt: Prompt) -> str | None:
        """The replica that was last sent a prompt beginning as `prompt` does, remembered after
        the index forgot its blocks there: vLLM evicts a prompt from its end, so its beginning
        may still be cached; and placing it anew elsewhere would copy it and evict another."""
        return self._last_sent.get(prompt.blocks[0]) if prompt.blocks else None

    def forget(self, replica: str, blocks: Sequence[int]) -> None:
        """The replica's engine evicted these blocks (proxy.upstream.kv_blocks)."""
        held = self._held.get(replica)
        if held is not None:
            for block in blocks:
                held.pop(block, None)

    def forget_all(self, replica: str) -> None:
        """The replica's engine holds nothing any more (its cache cleared, or restarted):
        until its events are heard again, the index goes by its own estimate."""
        self._held.pop(replica, None)
        if replica in self._reported:
            self._reported.discard(replica)
            self._fit.pop(replica, None)
            self._room.pop(replica, None)

    def idle_s(self, replica: str, now: float) -> float:
        """How long ago the block the replica would evict next was last sent (infinite while
        its cache has room): what new blocks there would cost the blocks already there."""
        held = self._held.get(replica)
        room = self._room.get(replica)
        if not held or room is None or len(held) < room:
            return math.inf
        return now - next(iter(held.values()))

    def size(self, replica: str) -> int:
        return len(self._held.get(replica, ()))

    def prompt_view(self, prompt: Prompt, replicas: Sequence[str], backlog_s: Sequence[float],
                    now: float) -> PromptView:
        """What the index knows of `prompt` on each of `replicas` (at monotonic `now`), with
        the prefill work each was sent and has not finished: for routing.by_first_token."""
        last = self.last_sent(prompt)
        return PromptView(uncached_tokens=[self.uncached_tokens(r, prompt) for r in replicas],
                          tokens=self.tokens(prompt), backlog_s=backlog_s,
                          idle_s=[self.idle_s(r, now) for r in replicas],
                          held=[self.size(r) for r in replicas],
                          last_sent=[r == last for r in replicas])

    def view(self) -> dict[str, object]:
        """What it holds, for /admin/backends: per replica, blocks known and room for them."""
        return {"bytes_per_token": round(self.chars_per_token, 2), "block_bytes": BLOCK_CHARS,
                "replicas": {name: {"blocks": len(held), "room": self._room.get(name),
                                    "fit": round(self._fit.get(name, 1.0), 3),
                                    "engine_reports_evictions": name in self._reported}
                             for name, held in self._held.items()}}

    def _trim(self, replica: str) -> None:
        held = self._held.get(replica)
        if held is None:
            return
        room = self._room.get(replica)
        while room is not None and len(held) > room:
            held.popitem(last=False)


def pack(blocks: Sequence[int]) -> bytes:
    """Block names as one string (for sharing placements)."""
    return array("Q", blocks).tobytes()


def unpack(raw: bytes) -> tuple[int, ...]:
    names = array("Q")
    names.frombytes(raw[:len(raw) - len(raw) % names.itemsize])
    return tuple(names)
