"""The engines' KV-cache events, read: one ZMQ SUB socket per worker and backend with
`kv_events` (vLLM `--kv-events-config`), each message handed to the backend's
`EngineBlocks` (proxy.upstream.kv_blocks) as it comes.

    wire      vLLM's ZmqEventPublisher: (topic, sequence number as 8 bytes big-endian,
              msgpack of [ts, [event, ...], data_parallel_rank?]), each event a map tagged by
              "type": BlockStored, BlockRemoved, AllBlocksCleared (docs/simulators.md has one
              as captured). Every topic is read; an event of a type not known here is
              skipped, and so are the blocks of a hybrid model's sliding-window groups
    gone      the engine's socket closing (its process ended: the connection drops) empties
              the index's picture of that replica, as do sequence numbers that start over (a
              new process, met without a drop seen): a new engine's cache is empty. ZMQ
              reconnects by itself; until then the index goes by its own estimate, as for a
              backend without events
    lost      a number skipped means events missed (the publisher's high-water mark, or the
              first messages of a new process, sent before the reconnection): the depths
              known are dropped, what the index holds stays

Off the request path: nothing a request does waits for an event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proxy.store.background import stop_task
from proxy.upstream.kv_blocks import EngineBlocks, EngineHash
from proxy.upstream.pool import Backend


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    block_size: int
    session_id: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[EngineHash]
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]  # each decoded alone: an unknown type skips only itself


FULL_ATTENTION = "full_attention"
_batch = msgspec.msgpack.Decoder(Batch)
_event = msgspec.msgpack.Decoder(Event)


class Follower:
    """What one worker reads of one backend's events (and how far it got)."""

    __slots__ = ("blocks", "connected", "endpoint", "gaps", "groups", "messages", "next_seq",
                 "restarts")

    def __init__(self, endpoint: str, blocks: EngineBlocks) -> None:
        self.endpoint = endpoint
        self.blocks = blocks
        self.next_seq: int | None = None
        self.connected = False
        self.messages = self.gaps = self.restarts = 0
        # The KV-cache groups of full attention: a hybrid model's sliding-window groups drop
        # blocks as the window moves, which says nothing of the prefix the engine can reuse.
        self.groups: set[int | None] = set()

    def dropped(self) -> None:
        """The engine's socket closed: that process is gone, and its cache with it."""
        self.connected = False
        self.next_seq = None
        self.restarts += 1
        self.blocks.clear()

    def take(self, frames: Sequence[bytes]) -> None:
        """One published message: (topic, sequence, payload)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.next_seq is not None and seq != self.next_seq:
            if seq < self.next_seq:
                self.restarts += 1
                self.blocks.clear()
            else:
                self.gaps += 1
                self.blocks.lost()
        self.next_seq = seq + 1
        self.messages += 1
        try:
            batch = _batch.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        for raw in batch.events:
            try:
                event = _event.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a type (or shape) of a later vLLM
            if isinstance(event, BlockStored):
                if event.kv_cache_spec_kind not in (None, FULL_ATTENTION):
                    continue
                self.groups.add(event.group_idx)
                self.blocks.stored(event.block_hashes, event.parent_block_hash,
                                   event.block_size, event.session_id)
            elif isinstance(event, BlockRemoved):
                if event.group_idx in self.groups:
                    self.blocks.removed(event.block_hashes)
            else:
                self.blocks.clear()

    def view(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "connected": self.connected,
                "messages": self.messages, "gaps": self.gaps,
                "restarts": self.restarts, **self.blocks.view()}


async def follow(follower: Follower) -> None:
    """Forever: the backend's events into its `EngineBlocks`."""
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    socket.connect(follower.endpoint)
    poller = zmq.asyncio.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    try:
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    follower.dropped()
                elif event == zmq.EVENT_CONNECTED:
                    follower.connected = True
            if socket in ready:
                follower.take(await socket.recv_multipart())
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)


class KvEvents:
    """This worker's followers: every backend with `kv_events` in a "prefix" pool."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.followers = {b.name: Follower(b.spec.kv_events, b.kv) for b in backends
                          if b.spec.kv_events and b.kv is not None}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(follow(f)) for f in self.followers.values()]

    async def close(self) -> None:
        for task in self._tasks:
            await stop_task(task)
