"""vLLM's KV-cache events, published by the vLLM simulator (`--kv-events-config`).

As vLLM 0.32's `ZmqEventPublisher` (vllm/distributed/kv_events.py) sends them, checked against
a real one (docs/simulators.md, "KV-cache events"): a ZMQ PUB socket, one multipart message a
scheduler step that changed the cache, (topic, sequence number as 8 bytes big-endian from 0,
payload). The payload is msgspec's msgpack of a `KVEventBatch`, an array [ts, events,
data_parallel_rank] (the rank 0, as vLLM's publisher sets it), each event a map tagged by
"type": `BlockStored` (a request's newly cached blocks: their hashes, the chain's parent,
their token ids, `session_id` when the request had one; with `vllm_xargs.kv_cache_report_mode`
"full", the blocks it found cached too) or `BlockRemoved` (one evicted block). Hashes are
64-bit integers (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).

The flag takes vLLM's keys: `enable_kv_cache_events`, `publisher` ("zmq" or "null"),
`endpoint`, `topic`, `hwm`; `replay_endpoint`, `buffer_steps` and `max_queue_size` are
accepted and ignored (no replay socket: a subscriber that missed messages sees the gap in the
sequence numbers). Unlike vLLM, which connects to an endpoint without a wildcard, the
simulator binds every endpoint (`tcp://*:5557` and `tcp://127.0.0.1:5557` alike; port 0 takes
a free port, see `Publisher.endpoint`). vLLM's `AllBlocksCleared` (sent when its prefix cache
is reset) never comes: the simulator never empties its cache wholesale.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import msgspec
import orjson
import zmq

from proxy.simulators.config import KvEventsConfig
from proxy.simulators.kvcache import CacheEvent, Stored, external_hash
from proxy.simulators.textgen import token_id

MEDIUM = "GPU"
ATTENTION = "full_attention"  # the one KV-cache group (0) of a plain decoder model
_KEYS = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "hwm", "replay_endpoint",
         "buffer_steps", "max_queue_size"}


def parse_config(text: str) -> KvEventsConfig | None:
    """`--kv-events-config JSON` as vLLM reads it; None when it publishes nothing."""
    try:
        spec = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("expected a JSON object")
    if unknown := sorted(set(spec) - _KEYS):
        raise ValueError(f"unknown keys: {', '.join(unknown)}")
    enabled = spec.get("enable_kv_cache_events", False)
    publisher = spec.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"Unknown event publisher '{publisher}'")
    endpoint, topic, hwm = (spec.get("endpoint", "tcp://*:5557"), spec.get("topic", ""),
                            spec.get("hwm", 100_000))
    if not (isinstance(endpoint, str) and isinstance(topic, str) and isinstance(hwm, int)):
        raise ValueError("endpoint and topic are strings, hwm an integer")
    if enabled is not True or publisher == "null":
        return None
    return KvEventsConfig(endpoint, topic, hwm)


# vLLM's structs, field order the wire's (fields vLLM always leaves at their default, so
# never sends, are not declared).
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[None] | None = None  # one entry a block: no LoRA, media or salt
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode(ts: float, events: Sequence[CacheEvent], block_size: int) -> bytes:
    """One step's cache events as vLLM's publisher packs them (pure)."""
    return _encoder.encode(KVEventBatch(ts, [_event(e, block_size) for e in events], 0))


def _event(event: CacheEvent, block_size: int) -> BlockStored | BlockRemoved:
    if isinstance(event, Stored):
        return BlockStored(
            block_hashes=[external_hash(block) for block in event.hashes],
            parent_block_hash=None if event.parent is None else external_hash(event.parent),
            token_ids=[token_id(token) for token in event.tokens],
            block_size=block_size, lora_id=None, medium=MEDIUM, lora_name=None,
            extra_keys=[None] * len(event.hashes), group_idx=0,
            kv_cache_spec_kind=ATTENTION, session_id=event.session_id)
    return BlockRemoved([external_hash(event.block)], MEDIUM, group_idx=0)


class Publisher:
    """The PUB socket: bound by `open` (the server's startup), written from the event loop
    without blocking (beyond `hwm` queued messages ZMQ drops them, as for vLLM, and the
    sequence number is spent all the same)."""

    def __init__(self, config: KvEventsConfig, block_size: int) -> None:
        self.config = config
        self.endpoint = config.endpoint  # once bound: the address it took (port 0 resolved)
        self.sequence = 0  # the next message's number
        self._topic = config.topic.encode()
        self._block_size = block_size
        self._socket: zmq.Socket[bytes] | None = None

    def open(self) -> None:
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.set_hwm(self.config.hwm)
        try:
            socket.bind(self.config.endpoint)
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        self._socket = socket
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """One step's events as one message."""
        if self._socket is None:
            return
        sequence, self.sequence = self.sequence, self.sequence + 1
        payload = encode(time.time(), events, self._block_size)
        with contextlib.suppress(zmq.Again):
            self._socket.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload),
                                        flags=zmq.NOBLOCK)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
