"""`simulate vllm --kv-events-config`: vLLM's KV-cache events on a real ZMQ socket, read with a
SUB socket and decoded with vLLM 0.32's own structs (copied below from
vllm/distributed/kv_events.py), the wire shape as a real vLLM's was captured
(docs/simulators.md, "KV-cache events")."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import aiohttp
import msgspec
import orjson
import pytest
import zmq
import zmq.asyncio

from proxy.simulators import SimConfig, cli
from proxy.simulators.config import KvEventsConfig
from proxy.simulators.kvcache import block_hashes, external_hash, hittable_blocks
from proxy.simulators.textgen import prompt_token_list, token_id
from proxy.simulators.vllm import KV_EVENTS
from tests.support.config_files import MODEL
from tests.support.processes import free_ports, stop_group, wait_until_ready
from tests.support.upstreams import SimulatorFactory
from tests.support.vllm_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

# A real vLLM 0.32's messages, as captured: the maps' keys in wire order.
REAL_STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                    "kv_cache_spec_kind", "session_id"]
REAL_REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx"]

# ------------------------------------------------------------------------------ helpers

BLOCK = 4
SYSTEM = {"role": "system", "content": " ".join(f"w{i}" for i in range(20))}  # 24 tokens
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def messages(user: str, system: dict[str, str] = SYSTEM) -> list[dict[str, str]]:
    return [system, {"role": "user", "content": user}]


def warm_up(i: int) -> list[dict[str, str]]:
    """A subscriber's i-th probe: 2 blocks, the first shared by every probe."""
    return [{"role": "user", "content": f"warm {i} up and go"}]


def cached_hashes(msgs: list[dict[str, str]]) -> list[int]:
    """The prompt's cacheable blocks, as the events name them."""
    prompt = prompt_token_list(msgs)
    return [external_hash(h) for h in
            block_hashes(prompt, BLOCK, hittable_blocks(len(prompt), BLOCK))]


class Subscriber:
    """A SUB socket on the topic "kv" that checks every message's frames and numbering."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.socket.connect(endpoint)
        self.sequence: int | None = None
        self.payload = b""
        self.probes = 0  # warm-up requests sent

    async def next(self, wait_s: float = 5.0) -> KVEventBatch:
        frames = await asyncio.wait_for(self.socket.recv_multipart(), wait_s)
        assert len(frames) == 3 and frames[0] == b"kv" and len(frames[1]) == 8
        number = int.from_bytes(frames[1], "big")
        assert self.sequence is None or number == self.sequence + 1  # none skipped
        self.sequence, self.payload = number, frames[2]
        batch: KVEventBatch = _decoder.decode(frames[2])
        return batch

    async def join(self, base: str) -> None:
        """Wait until the subscription reached the publisher (a PUB socket drops what it sends
        before): requests with sessions "warm-0", "warm-1", ... until one's message arrives;
        each stores one chain, so message i is request i's (numbering starts at 0)."""
        for i in range(100):
            await chat(base, warm_up(i), session_id=f"warm-{i}")
            self.probes = i + 1
            try:
                batch = await self.next(wait_s=0.1)
            except TimeoutError:
                continue
            while True:  # then take those still on their way, up to request i's
                (stored,) = stored_events(batch)
                assert stored.session_id == f"warm-{self.sequence}"
                if self.sequence == i:
                    return
                batch = await self.next()
        raise AssertionError("the subscription never took")

    def close(self) -> None:
        self.socket.close(linger=0)


async def chat(base: str, msgs: list[dict[str, str]], headers: dict[str, str] | None = None,
               **body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{base}/v1/chat/completions", headers=headers,
            json={"model": MODEL, "messages": msgs, "max_tokens": 1, **body}) as response:
        return response.status, orjson.loads(await response.read())


@pytest.fixture
async def events_sim(simulator: SimulatorFactory) -> AsyncIterator[Any]:
    """A vLLM simulator publishing on a free loopback port, and a subscriber that has joined."""
    subscribers: list[Subscriber] = []

    async def start(**options: Any) -> tuple[str, Subscriber]:
        sim = await simulator(kv_events=KvEventsConfig("tcp://127.0.0.1:0", "kv"),
                              block_size=BLOCK, prompt_tokens_details=True, **options)
        base = str(sim.make_url("")).rstrip("/")
        sub = Subscriber(sim.app[KV_EVENTS].endpoint)
        subscribers.append(sub)
        await sub.join(base)
        return base, sub

    yield start
    for sub in subscribers:
        sub.close()


def stored_events(batch: KVEventBatch) -> list[BlockStored]:
    return [e for e in batch.events if isinstance(e, BlockStored)]


# ------------------------------------------------------------------------------- tests


async def test_a_request_publishes_the_blocks_it_computed_with_its_session(
    events_sim: Any
) -> None:
    base, sub = await events_sim()
    msgs = messages("tell me about the sea and the ships on it")
    prompt = prompt_token_list(msgs)
    before = time.time()
    status, _ = await chat(base, msgs, session_id="conv-7")
    assert status == 200
    batch = await sub.next()
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    blocks = (len(prompt) - 1) // BLOCK  # vLLM never hits the last prompt token's block
    assert stored.block_hashes == cached_hashes(msgs) and len(set(stored.block_hashes)) == blocks
    assert all(0 <= h < 2**64 for h in stored.block_hashes)
    assert stored.parent_block_hash is None  # the prompt's first block starts the chain
    assert stored.token_ids == [token_id(t) for t in prompt[:blocks * BLOCK]]
    assert stored.session_id == "conv-7"
    assert (stored.block_size, stored.lora_id, stored.medium, stored.lora_name,
            stored.extra_keys, stored.group_idx, stored.kv_cache_spec_kind) == (
        BLOCK, None, "GPU", None, [None] * blocks, 0, "full_attention")
    assert batch.data_parallel_rank == 0 and before <= batch.ts <= time.time()
    # The wire as vLLM's: [ts, [event], 0], the event a map with the captured keys in order.
    raw = msgspec.msgpack.decode(sub.payload)
    assert sub.payload[0] == 0x93 and sub.payload[1] == 0xCB  # fixarray 3, then a float64
    assert list(raw[1][0]) == REAL_STORED_KEYS and raw[2] == 0


async def test_a_shared_beginning_stores_only_the_new_blocks_after_it(events_sim: Any) -> None:
    base, sub = await events_sim()
    first, second = messages("one two three four five six"), messages("seven eight nine ten")
    await chat(base, first, session_id="a")
    (stored_a,) = (await sub.next()).events
    await chat(base, second, session_id="b")
    (stored_b,) = (await sub.next()).events
    assert isinstance(stored_a, BlockStored) and isinstance(stored_b, BlockStored)
    ours, theirs = cached_hashes(first), cached_hashes(second)
    shared = (24 + 3) // BLOCK  # the system prompt and the user turn's opening tokens
    assert ours[:shared] == theirs[:shared] and ours[shared] != theirs[shared]
    assert stored_a.block_hashes == ours
    assert stored_b.block_hashes == theirs[shared:]  # only what it computed
    assert stored_b.parent_block_hash == stored_a.block_hashes[shared - 1]
    prompt = prompt_token_list(second)
    assert stored_b.token_ids == [token_id(t) for t in prompt[shared * BLOCK:len(theirs) * BLOCK]]
    # The same prompt again, another session: all its blocks hit (the session is no part of a
    # block's hash), so it stores nothing and no message goes out for it ...
    status, body = await chat(base, first, session_id="c")
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ours) * BLOCK
    # ... as the next message, one number on, is the next request's.
    await chat(base, messages("eleven twelve"), session_id="d")
    (stored_d,) = (await sub.next()).events
    assert isinstance(stored_d, BlockStored) and stored_d.session_id == "d"


async def test_eviction_announces_each_block_removed_before_the_blocks_stored(
    events_sim: Any
) -> None:
    capacity, chain = 16, 7  # each prompt below: 31 tokens, 7 cacheable blocks, 1 more private
    base, sub = await events_sim(kv_cache_blocks=capacity)
    # The cache's unheld blocks, least recently used first: a request releases its chain
    # last block first, so its first block is the most recent.
    free: list[int] = []
    for i in range(sub.probes):
        probe = cached_hashes(warm_up(i))
        free = [h for h in free if h not in probe] + probe[::-1]
    removed_total = 0
    for n in range(4):  # prompts that share nothing
        msgs = messages("a b c", {"role": "system", "content": f"s{n} " * 20})
        await chat(base, msgs, session_id=f"p{n}")
        batch = await sub.next()
        *removed, stored = batch.events  # vLLM evicts while allocating, then stores
        assert isinstance(stored, BlockStored) and stored.session_id == f"p{n}"
        assert stored.block_hashes == cached_hashes(msgs) and len(stored.block_hashes) == chain
        # Beside the running request's 7 blocks and 1 private, room for 8 unheld ones.
        evicted = max(0, len(free) - (capacity - chain - 1))
        assert [e.block_hashes for e in removed] == [[h] for h in free[:evicted]]
        assert all(isinstance(e, BlockRemoved) and (e.medium, e.group_idx) == ("GPU", 0)
                   for e in removed)
        if removed:
            raw = msgspec.msgpack.decode(sub.payload)[1]
            assert [list(e) for e in raw[:-1]] == [REAL_REMOVED_KEYS] * len(removed)
        free = free[evicted:] + stored.block_hashes[::-1]
        removed_total += len(removed)
    assert removed_total >= 2 * chain  # the last two requests each evict a whole chain


async def test_the_session_comes_from_the_body_the_header_or_vllm_xargs(events_sim: Any) -> None:
    base, sub = await events_sim()
    cases: Sequence[tuple[str, dict[str, Any], dict[str, str], str | None]] = [
        ("body", {"session_id": "s-body"}, {"X-Session-ID": "s-header"}, "s-body"),
        ("header", {}, {"X-Session-ID": "s-header"}, "s-header"),
        ("xargs", {"vllm_xargs": {"session_id": "s-xargs"}}, {}, "s-xargs"),
        ("empty", {"session_id": ""}, {}, None),
        ("none", {}, {}, None),
    ]
    for name, body, headers, session in cases:
        await chat(base, messages(f"{name} case here now"), headers, **body)
        (stored,) = (await sub.next()).events
        assert isinstance(stored, BlockStored) and stored.session_id == session, name
        keys = list(msgspec.msgpack.decode(sub.payload)[1][0])
        assert keys == (REAL_STORED_KEYS if session else REAL_STORED_KEYS[:-1]), name
    status, body = await chat(base, messages("bad"), session_id=5)
    assert status == 400 and "session_id" in body["error"]["message"]


async def test_report_mode_full_reports_the_reused_blocks_too(events_sim: Any) -> None:
    base, sub = await events_sim()
    first = messages("what is the capital of france")
    await chat(base, first)
    await sub.next()
    longer = messages("what is the capital of france and of spain and of italy")
    await chat(base, longer, session_id="e", vllm_xargs={"kv_cache_report_mode": "full"})
    reused, new = stored_events(await sub.next())
    hashes = cached_hashes(longer)
    hit = (len(prompt_token_list(first)) - 1) // BLOCK
    assert (reused.block_hashes, reused.parent_block_hash) == (hashes[:hit], None)
    assert (new.block_hashes, new.parent_block_hash) == (hashes[hit:], hashes[hit - 1])
    assert reused.session_id == new.session_id == "e"


def test_the_flag_reads_vllms_kv_events_config() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)

    def parse(spec: str) -> SimConfig:
        return cli.config_from(parser.parse_args(["vllm", "--kv-events-config", spec]))

    on = parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
               '"endpoint": "tcp://*:5557", "topic": "kv", "replay_endpoint": "tcp://*:5558"}')
    assert on.kv_events == KvEventsConfig("tcp://*:5557", "kv")
    assert parse('{"enable_kv_cache_events": true}').kv_events == KvEventsConfig("tcp://*:5557")
    assert parse('{"enable_kv_cache_events": false, "publisher": "zmq"}').kv_events is None
    assert parse('{"enable_kv_cache_events": true, "publisher": "null"}').kv_events is None
    assert cli.config_from(parser.parse_args(["vllm"])).kv_events is None
    for bad in ('{"enable_kv_cache_events": true, "bogus": 1}', "not json",
                '{"enable_kv_cache_events": true, "publisher": "kafka"}'):
        with pytest.raises(SystemExit):
            parse(bad)


@pytest.fixture
def sim_process() -> Iterator[tuple[str, str]]:
    """`inference-gateway simulate vllm` publishing on a wildcard endpoint: its URL, and the
    loopback address of its events."""
    port, events = free_ports(2)
    spec = orjson.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{events}", "topic": "kv"}).decode()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "simulate", "vllm", "--port", str(port), "--model",
         MODEL, "--block-size", str(BLOCK), "--kv-events-config", spec],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_ready(f"{base}/health", proc)
        yield base, f"tcp://127.0.0.1:{events}"
    finally:
        stop_group(proc, 5)


async def test_a_simulator_process_publishes_on_a_wildcard_endpoint(
    sim_process: tuple[str, str]
) -> None:
    base, endpoint = sim_process
    sub = Subscriber(endpoint)
    try:
        await sub.join(base)
        msgs = messages("from another process")
        await chat(base, msgs, session_id="proc")
        (stored,) = (await sub.next()).events
        assert isinstance(stored, BlockStored) and stored.session_id == "proc"
        assert stored.block_hashes == cached_hashes(msgs)
    finally:
        sub.close()
