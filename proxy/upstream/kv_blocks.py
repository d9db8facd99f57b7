"""What a replica's engine says its KV cache holds (vLLM's KV-cache events), told in the prefix
index's blocks, so the index forgets a prompt when the engine evicts it rather than when its
own estimate of the cache's room says so. No I/O (proxy.upstream.kv_events reads the events).

    meeting   the index names a prompt's blocks by the gateway's rendering of it
              (proxy.upstream.prefixes); the engine names its blocks by token ids. They meet
              through the request: a request sent to a replica that publishes its events
              carries a `session_id` naming its prompt (`session_of`), and vLLM tags each block
              it stores with the session of the request that stored it
    depth     a stored block's depth in its chain is its parent's plus one (a chain's first
              block has none): the block holds tokens [d·B, (d+1)·B) of that prompt, about
              bytes [d·B·c, (d+1)·B·c) of the rendering (B the engine's block size, c the
              index's bytes per token); the index blocks that end inside it go with it
    evicted   a removed block takes those index blocks out of the index at once; a prompt
              matches only as far as its leading blocks are all there
    cleared   AllBlocksCleared, or an engine that started again (its sequence numbers start
              over: `restarted`), empties the index's picture of that replica

Blocks stored by requests that did not come through this gateway carry no session of ours:
their depth is kept (their children's depth follows from it), nothing else. Only block
names are kept, never the tokens.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from proxy.upstream.prefixes import BLOCK_CHARS, PrefixIndex, Prompt

SESSION_PREFIX = "igw-"
SENT_KEPT = 16_384  # prompts sent and not yet stored by the engine, per replica
BLOCKS_KEPT = 1 << 18  # engine blocks known per replica (bounds what lost removals leave)

EngineHash = int | bytes  # vLLM's 64-bit int by default, the digest's bytes when configured


def session_of(prompt: Prompt) -> str:
    """The `session_id` a request for `prompt` carries: its last block's name (the chain's,
    so it names the whole rendering up to there)."""
    return f"{SESSION_PREFIX}{prompt.blocks[-1]:016x}"


class _Stored(NamedTuple):
    depth: int
    owner: PrefixIndex | None  # whose blocks these are (None: not a prompt of ours)
    blocks: tuple[int, ...]  # the index blocks that end inside this engine block


class EngineBlocks:
    """One replica's engine blocks as its events report them (one per worker and backend)."""

    __slots__ = ("_blocks", "_indexes", "_sent", "cleared", "mapped", "name", "removed_blocks",
                 "stored_blocks")

    def __init__(self, name: str) -> None:
        self.name = name
        self._sent: OrderedDict[str, tuple[PrefixIndex, Prompt]] = OrderedDict()
        self._blocks: OrderedDict[EngineHash, _Stored] = OrderedDict()
        self._indexes: set[PrefixIndex] = set()  # those told of this replica's blocks
        self.stored_blocks = self.removed_blocks = self.mapped = self.cleared = 0

    def sent(self, index: PrefixIndex, prompt: Prompt) -> None:
        """`prompt` (of `index`'s pool) was sent to this replica, with `session_of(prompt)`."""
        if not prompt.blocks:
            return
        session = session_of(prompt)
        self._sent[session] = (index, prompt)
        self._sent.move_to_end(session)
        self._indexes.add(index)
        if len(self._sent) > SENT_KEPT:
            self._sent.popitem(last=False)

    def stored(self, hashes: Iterable[EngineHash], parent: EngineHash | None, block_size: int,
               session: str | None) -> None:
        """The engine stored `hashes`, a chain continuing `parent`, for `session`'s request."""
        if parent is None:
            depth = 0
        elif (known := self._blocks.get(parent)) is not None:
            depth = known.depth + 1
        else:
            return  # stored before this worker listened: where its tokens lie is unknown
        sent = self._sent.get(session) if session else None
        index, prompt = sent if sent is not None else (None, None)
        width = (block_size * index.chars_per_token / BLOCK_CHARS) if index is not None else 0.0
        for offset, block in enumerate(hashes):
            names: tuple[int, ...] = ()
            if prompt is not None:
                at = depth + offset
                names = prompt.blocks[math.floor(at * width):math.floor((at + 1) * width)]
                self.mapped += len(names)
            self._blocks[block] = _Stored(depth + offset, index, names)
            self._blocks.move_to_end(block)
            self.stored_blocks += 1
        if index is not None:  # its evictions will be heard too: the index may rely on them
            index.reported(self.name)
        while len(self._blocks) > BLOCKS_KEPT:
            self._blocks.popitem(last=False)

    def removed(self, hashes: Iterable[EngineHash]) -> None:
        """The engine evicted `hashes`: the index blocks inside them are gone too."""
        for block in hashes:
            stored = self._blocks.pop(block, None)
            self.removed_blocks += 1
            if stored is not None and stored.owner is not None and stored.blocks:
                stored.owner.forget(self.name, stored.blocks)

    def clear(self) -> None:
        """The engine's cache is empty (cleared, or a new engine process)."""
        self._blocks.clear()
        self._sent.clear()
        for index in self._indexes:
            index.forget_all(self.name)
        self.cleared += 1

    def lost(self) -> None:
        """Events were missed: stored blocks' depths can no longer be trusted; what the index
        holds stays (its own estimate of the room trims it)."""
        self._blocks.clear()

    def view(self) -> dict[str, int]:
        return {"blocks": len(self._blocks), "stored": self.stored_blocks,
                "removed": self.removed_blocks, "index_blocks_mapped": self.mapped,
                "cleared": self.cleared}
