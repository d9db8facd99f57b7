"""The engine loop the chat simulators imitate: a running batch, a waiting queue, prefill.

A request waits in arrival order until the batch has a free slot and the KV cache has room
for it: vLLM needs blocks for its prompt's uncached part; TGI reserves its whole token budget
(prompt plus max new tokens) up front. Once scheduled, its first token is due after the
prefill of its uncached prompt tokens plus `ttft_ms`. Prefills run one after another, since
they share the engine's compute; decoding runs in parallel at `tokens_per_s` per request
whatever the batch size. So time to first token grows with the queue ahead of a request and
with its uncached prompt, and a prefix-cache hit shortens it. `speed` divides every latency.
Nothing is preempted: a batch that outgrows the cache while decoding only fills it up.

With `on_events` set (vLLM's `--kv-events-config`), each scheduling step that changed the
cache hands it what changed, as vLLM's engine publishes one batch a step: for each request
started, the blocks evicted to make room and then the blocks it computed and cached.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

from proxy.simulators.config import SimConfig
from proxy.simulators.kvcache import (
    BlockPool,
    CacheEvent,
    Removed,
    Stored,
    block_hashes,
    hittable_blocks,
)


class EventLabels(NamedTuple):
    """What vLLM's KV-cache events tell of a request beyond its blocks: its session, and
    whether the blocks it found cached are reported too (vLLM's `kv_cache_report_mode`
    "full"; by default only the blocks a request computes are)."""

    session_id: str | None = None
    report_reused: bool = False


NO_LABELS = EventLabels()
# Set by the server's handler before it queues the request; `Scheduler.sequence` reads it in
# the same task. A context variable, so the request path the servers share carries no
# vLLM-only field.
EVENT_LABELS: ContextVar[EventLabels] = ContextVar("kv_event_labels", default=NO_LABELS)


@dataclass(eq=False, slots=True)
class Seq:
    """A request as the engine schedules it."""

    prompt_tokens: int
    hashes: list[bytes]  # the prompt's cacheable full blocks
    completions: tuple[int, ...]  # the tokens each choice generates
    budget: int  # what TGI reserves for it: prompt plus max new tokens
    cached_tokens: int = 0  # prompt tokens found in the prefix cache ...
    created_tokens: int = 0  # ... and written to it
    scheduled: float = math.inf  # loop time it was scheduled (left the waiting queue)
    # Loop time its own prefill began (after the prefills ahead of it): where vLLM's prefill
    # clock starts, since vLLM schedules a prompt's tokens only within a step's token budget,
    # and a request waiting for that budget is still in its queue, not in prefill.
    prefill_started: float = math.inf
    first_token: float = math.inf  # loop time its first token is due, once scheduled
    interval: float = 0.0  # seconds between its tokens
    priority: int = 0  # with --scheduling-policy priority: lower waits less (ties: arrival)
    tokens: Sequence[str] = ()  # the prompt, for the KV-cache events' token ids
    labels: EventLabels = NO_LABELS

    def private_blocks(self, block_size: int, now: float = -math.inf) -> int:
        """Blocks no other request shares: each choice's prompt tail and its output so far
        (at `now`; by default before it started)."""
        tail = self.prompt_tokens - len(self.hashes) * block_size
        return sum(-(-(tail + self._generated(total, now)) // block_size)
                   for total in self.completions)

    def peak_private_blocks(self, block_size: int) -> int:
        """`private_blocks` once every token is generated."""
        tail = self.prompt_tokens - len(self.hashes) * block_size
        return sum(-(-(tail + total) // block_size) for total in self.completions)

    def _generated(self, total: int, now: float) -> int:
        if now < self.first_token:
            return 0
        if self.interval <= 0:
            return total
        return min(total, 1 + int((now - self.first_token) / self.interval))


class Scheduler:
    """One engine's batch, queue, prefill lane and KV cache."""

    def __init__(self, config: SimConfig, reserve_whole: bool) -> None:
        self.slots = config.batch_size
        self.max_in_flight = config.max_concurrency  # TGI's admission limit (429 beyond)
        self.block_size = max(1, config.block_size)
        self.pool = BlockPool(config.kv_cache_blocks)
        self.reserve_whole = reserve_whole
        self.running: set[Seq] = set()
        self.waiting: deque[tuple[Seq, asyncio.Future[None]]] = deque()
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # prompt tokens found there
        self._ttft = config.ttft_s
        self._interval = config.token_interval_s
        self._prefill_per_token = config.prefill_s_per_token
        self._prefill_free = 0.0  # loop time the prefill lane is free again
        # Running requests' private blocks once all is generated: while the cache has room
        # even for that, neither admission nor eviction needs the exact count (O(batch)).
        self._peak_private = 0
        self._reserved = 0  # the running batch's token budgets (TGI)
        # vLLM's KV-cache events: called with each step's, if set (and only then collected).
        self.on_events: Callable[[list[CacheEvent]], None] | None = None
        self._events: list[CacheEvent] = []

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity * self.block_size

    def sequence(self, prompt: Sequence[str], completions: Sequence[int],
                 cap: int | None) -> Seq:
        """A request's work: its prompt tokens, each choice's length, its max new tokens."""
        size = len(prompt)
        hashes = block_hashes(prompt, self.block_size, hittable_blocks(size, self.block_size))
        lengths = tuple(completions) or (0,)
        return Seq(size, hashes, lengths, size + (max(lengths) if cap is None else cap),
                   tokens=prompt, labels=EVENT_LABELS.get())

    def kv_usage(self) -> float:
        """Blocks running requests hold, as a share of the cache (vLLM's 0..1 gauge)."""
        now = asyncio.get_running_loop().time()
        return min(1.0, (self.pool.held + self._private(now)) / self.pool.capacity)

    def reserved_tokens(self) -> int:
        """TGI's `batch_current_max_tokens`: the running batch's token budgets."""
        return self._reserved

    async def admit(self, seq: Seq) -> None:
        """Queue `seq`; return once it is scheduled."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Priority scheduling: before the first waiting request of a higher value (a plain
        # queue, first come first served, when every priority is 0).
        at = next((i for i, (queued, _) in enumerate(self.waiting)
                   if queued.priority > seq.priority), len(self.waiting))
        self.waiting.insert(at, (seq, ready))
        self._schedule()
        try:
            await ready
        except asyncio.CancelledError:
            self._withdraw(seq)
            raise

    def release(self, seq: Seq) -> None:
        """`seq` finished (or was dropped): its slot and blocks go to whoever waits."""
        self.running.remove(seq)
        self._peak_private -= seq.peak_private_blocks(self.block_size)
        self._reserved -= seq.budget
        self.pool.release(seq.hashes)
        self._schedule()

    def _withdraw(self, seq: Seq) -> None:
        if seq in self.running:  # scheduled just before its client left
            self.release(seq)
            return
        for index, (queued, _ready) in enumerate(self.waiting):
            if queued is seq:
                del self.waiting[index]
                break
        self._schedule()  # it may have held back those behind it

    def _schedule(self) -> None:
        """Start waiting requests in arrival order while there is room; the first that does
        not fit holds back the rest (first come, first served)."""
        now = asyncio.get_running_loop().time()
        while self.waiting and len(self.running) < self.slots:
            seq, ready = self.waiting[0]
            if ready.cancelled():  # its client left; _withdraw finds it gone
                self.waiting.popleft()
                continue
            # An empty batch takes any request: one too big for the cache must not wait forever.
            if self.running and not self._fits(seq, now):
                break
            self.waiting.popleft()
            self._start(seq, now)
            ready.set_result(None)
        if self._events and self.on_events is not None:
            events, self._events = self._events, []
            self.on_events(events)

    def _fits(self, seq: Seq, now: float) -> bool:
        if self.reserve_whole:
            return self._reserved + seq.budget <= self.capacity_tokens
        need = self.pool.unheld(seq.hashes) + seq.private_blocks(self.block_size)
        room = self.pool.capacity - self.pool.held - need
        return self._peak_private <= room or self._private(now) <= room

    def _start(self, seq: Seq, now: float) -> None:
        hit = self.pool.acquire(seq.hashes)
        seq.cached_tokens = hit * self.block_size
        seq.created_tokens = (len(seq.hashes) - hit) * self.block_size
        self.queries += seq.prompt_tokens
        self.hits += seq.cached_tokens
        ready = start = now
        prefill = (seq.prompt_tokens - seq.cached_tokens) * self._prefill_per_token
        if prefill > 0:  # after the prefills scheduled before it
            start = max(now, self._prefill_free)
            ready = self._prefill_free = start + prefill
        seq.scheduled, seq.prefill_started, seq.first_token = now, start, ready + self._ttft
        seq.interval = self._interval
        self.running.add(seq)
        self._peak_private += seq.peak_private_blocks(self.block_size)
        self._reserved += seq.budget
        forgotten: list[bytes] = []
        if self.pool.cached + self._peak_private > self.pool.capacity:
            forgotten = self.pool.forget(self._private(now))
        if self.on_events is not None:
            self._events += self._cache_events(seq, hit, forgotten)

    def _cache_events(self, seq: Seq, hit: int, forgotten: Sequence[bytes]) -> list[CacheEvent]:
        """What starting `seq` did to the cache, in vLLM's order: the reused blocks (if it asked
        for them), the blocks evicted for room, then the blocks it computed (a chain after the
        last block it hit)."""
        size, hashes, labels = self.block_size, seq.hashes, seq.labels
        events: list[CacheEvent] = []
        if labels.report_reused and hit:
            events.append(Stored(hashes[:hit], None, seq.tokens[:hit * size], labels.session_id))
        events += (Removed(block) for block in forgotten)
        if hit < len(hashes):
            events.append(Stored(hashes[hit:], hashes[hit - 1] if hit else None,
                                 seq.tokens[hit * size:len(hashes) * size], labels.session_id))
        return events

    def _private(self, now: float) -> int:
        return sum(seq.private_blocks(self.block_size, now) for seq in self.running)
