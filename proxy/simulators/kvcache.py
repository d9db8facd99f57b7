"""A simulated engine's KV cache: fixed-size blocks, prompt blocks shared by prefix hash.

As in vLLM's automatic prefix caching, each full block of a prompt is named by a hash chained
over every token before it, so two prompts that begin alike (a system prompt and first user
turn) share the blocks of their common beginning, and only those. Blocks a running request
holds are never evicted; blocks nobody holds stay cached until room is needed and then go in
LRU order, a request's last blocks before its first (vLLM frees them in that order), so a
shared beginning outlives the different endings. What the cache stored and forgot, as vLLM's
KV-cache events tell it (`Stored`, `Removed`), is the scheduler's to collect; `kv_events` puts
it on the wire. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

_LOW_64 = (1 << 64) - 1


def block_hashes(tokens: Sequence[str], block_size: int, blocks: int) -> list[bytes]:
    """Chained hashes of the first `blocks` full blocks of `tokens`."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, blocks * block_size, block_size):
        # Tokens never contain whitespace, so a newline-joined block is unambiguous.
        block = "\n".join(tokens[start:start + block_size]).encode()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def external_hash(block: bytes) -> int:
    """A block's hash as KV-cache events name it: vLLM's `maybe_convert_block_hash` (the hash
    as a big-endian integer, its low 64 bits)."""
    return int.from_bytes(block, "big") & _LOW_64


class Stored(NamedTuple):
    """A request's blocks cached in one step (vLLM's BlockStored): a chain continuing `parent`
    (None: from the prompt's first block), over `tokens` (theirs, a block's worth each)."""

    hashes: Sequence[bytes]
    parent: bytes | None
    tokens: Sequence[str]
    session_id: str | None


class Removed(NamedTuple):
    """A block evicted from the cache (vLLM's BlockRemoved, one a block)."""

    block: bytes


CacheEvent = Stored | Removed


def hittable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full blocks a prompt can find cached: all within its first n - 1 tokens (vLLM always
    computes the last prompt token, to sample the first output token from it)."""
    return max(0, prompt_tokens - 1) // block_size


class BlockPool:
    """`capacity` blocks: those running requests hold (shared prompt blocks counted once)
    and, in what is left, cached blocks nobody holds."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._held: dict[bytes, int] = {}  # prompt block -> running requests holding it
        self._free: OrderedDict[bytes, None] = OrderedDict()  # cached, unheld: LRU first

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def cached(self) -> int:
        """Blocks whose contents a prompt could reuse (held or not)."""
        return len(self._held) + len(self._free)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are cached."""
        count = 0
        for block in hashes:
            if block not in self._held and block not in self._free:
                break
            count += 1
        return count

    def unheld(self, hashes: Sequence[bytes]) -> int:
        """Blocks holding `hashes` would add to those in use."""
        return sum(block not in self._held for block in hashes)

    def acquire(self, hashes: Sequence[bytes]) -> int:
        """Hold the blocks of `hashes` (computing those not cached); the cached-prefix length."""
        hit = self.cached_prefix(hashes)
        for block in hashes:
            if block in self._free:  # cached, and nobody held it
                del self._free[block]
                self._held[block] = 1
            else:
                self._held[block] = self._held.get(block, 0) + 1
        return hit

    def release(self, hashes: Sequence[bytes]) -> None:
        """Let go of `hashes`; blocks nobody holds any more become the most recently used,
        the first block most recent of all."""
        for block in reversed(hashes):
            left = self._held[block] - 1
            if left:
                self._held[block] = left
            else:
                del self._held[block]
                self._free[block] = None

    def forget(self, private: int) -> list[bytes]:
        """Forget least recently used unheld blocks until they fit beside the held ones and
        `private` others (running requests' unshared blocks); those forgotten, in that order."""
        room = self.capacity - len(self._held) - private
        forgotten: list[bytes] = []
        while self._free and len(self._free) > room:
            forgotten.append(self._free.popitem(last=False)[0])
        return forgotten
