"""The engines' KV-cache events in the prefix index (proxy.upstream.kv_blocks, kv_events): what
an engine evicts leaves the index at once, a restarted engine leaves it empty."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from proxy.simulators import SimConfig
from proxy.simulators import build_app as build_simulator
from proxy.simulators.config import KvEventsConfig
from proxy.upstream.kv_blocks import EngineBlocks, session_of
from proxy.upstream.kv_events import Follower
from proxy.upstream.prefixes import BLOCK_CHARS, PrefixIndex, Prompt, prompt_of
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory
from tests.support.processes import free_ports
from tests.support.upstreams import SimulatorFactory
from tests.support.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)

BLOCK_TOKENS = 16


class BlockPinned(KVCacheEvent):  # an event type this gateway does not know
    block_hashes: list[int]


def frames(seq: int, *events: Any) -> list[bytes]:
    """One message as vLLM's ZmqEventPublisher sends it."""
    return [b"kv", seq.to_bytes(8, "big"),
            msgspec.msgpack.encode(EventBatch(1.0, list(events), 0))]


def stored(hashes: list[int], parent: int | None, session: str | None) -> BlockStored:
    return BlockStored(hashes, parent, list(range(len(hashes) * BLOCK_TOKENS)), BLOCK_TOKENS,
                       None, "GPU", None, group_idx=0, kv_cache_spec_kind="full_attention",
                       session_id=session)


def removed(block: int) -> BlockRemoved:
    return BlockRemoved([block], "GPU", group_idx=0)


def a_prompt(text: str) -> Prompt:
    prompt = prompt_of({"messages": [{"role": "system", "content": text}]})
    assert prompt is not None
    return prompt


def index_with(prompt: Prompt) -> tuple[PrefixIndex, EngineBlocks]:
    index = PrefixIndex(1_000_000)
    index.resize("r0", None)
    index.add("r0", prompt.blocks, 0.0)
    blocks = EngineBlocks("r0")
    blocks.sent(index, prompt)
    return index, blocks


def test_an_evicted_engine_block_takes_the_index_blocks_ending_inside_it() -> None:
    prompt = a_prompt("The house style. " * 100)  # 1,736 bytes: 6 full index blocks
    index, blocks = index_with(prompt)
    # 4 bytes per token: an engine block (16 tokens) is 64 bytes, a quarter of an index block.
    assert index.chars_per_token == 4.0 and BLOCK_CHARS == 256
    engine = list(range(100, 127))  # 27 full engine blocks of the prompt's ~434 tokens
    blocks.stored(engine[:10], None, BLOCK_TOKENS, session_of(prompt))
    blocks.stored(engine[10:], engine[9], BLOCK_TOKENS, session_of(prompt))
    assert blocks.mapped == 6  # every index block ends inside one engine block
    assert index.matched("r0", prompt) == 6
    # vLLM evicts a chain from its end: the 24th engine block ends bytes 1,472-1,536, where the
    # sixth index block (1,280-1,536) ends: the index then holds five.
    blocks.removed(engine[23:])
    assert index.matched("r0", prompt) == 5
    blocks.removed([engine[3]])  # ends the first index block: nothing matches any more
    assert index.matched("r0", prompt) == 0
    assert index.size("r0") == 4  # the blocks between stay until the index's room trims them


def test_depth_follows_blocks_stored_by_requests_from_elsewhere() -> None:
    shared = "A system prompt shared by every conversation. " * 12  # 2 index blocks
    prompt = a_prompt(shared + "My own question, asked at length. " * 30)  # 6 blocks
    index, blocks = index_with(prompt)
    # Another client's request stored the first 8 engine blocks (no session of ours); ours
    # stored the rest of its prompt after them.
    blocks.stored(list(range(8)), None, BLOCK_TOKENS, "someone-else")
    blocks.stored(list(range(8, 20)), 7, BLOCK_TOKENS, session_of(prompt))
    assert blocks.mapped == 3  # the index blocks ending in engine blocks 8-19 (bytes 512-1,280)
    blocks.removed([12])  # bytes 768-832: the fourth index block (768-1,024) ends in block 15
    assert index.matched("r0", prompt) == len(prompt.blocks)
    blocks.removed([15])
    assert index.matched("r0", prompt) == 3
    # A block whose parent this worker never saw stored tells nothing.
    blocks.stored([50, 51], 49, BLOCK_TOKENS, session_of(prompt))
    blocks.removed([50, 51])
    assert index.matched("r0", prompt) == 3


def test_the_follower_reads_vllms_wire_and_clears_the_index_when_the_engine_restarts() -> None:
    prompt = a_prompt("The house style. " * 100)
    index, blocks = index_with(prompt)
    follower = Follower("tcp://127.0.0.1:1", blocks)
    session = session_of(prompt)
    assert not index.view()["replicas"]["r0"]["engine_reports_evictions"]
    follower.take(frames(7, stored(list(range(27)), None, session)))
    # Its evictions are heard now: the index's own estimate of the room no longer trims first.
    assert index.view()["replicas"]["r0"]["engine_reports_evictions"]
    assert index.view()["replicas"]["r0"]["fit"] == 1.5
    follower.take(frames(8, BlockPinned([1]), removed(26)))
    assert blocks.view()["removed"] == 1 and index.matched("r0", prompt) == 6  # the unknown skipped
    # A hybrid model's sliding-window group drops blocks as its window moves: not evictions.
    window = stored(list(range(27)), None, session)
    window.group_idx, window.kv_cache_spec_kind = 1, "sliding_window"
    follower.take(frames(9, window, BlockRemoved([23], "GPU", group_idx=1)))
    assert index.matched("r0", prompt) == 6
    follower.take(frames(10, removed(23)))
    assert index.matched("r0", prompt) == 5
    follower.take([b"kv", b"\x00", b"not msgpack"])  # not vLLM's: ignored
    follower.take(frames(11, b"\xc1"))  # an event that is not one
    assert follower.messages == 5 and follower.gaps == follower.restarts == 0
    # Events lost (seq 12-19): depths are forgotten, the index stays.
    follower.take(frames(20, removed(3)))
    assert follower.gaps == 1 and index.matched("r0", prompt) == 5
    # A new engine process numbers from 0 again: its cache is empty.
    follower.take(frames(0))
    assert follower.restarts == 1 and index.size("r0") == 0
    assert "r0" not in index.view()["replicas"]  # its own estimate again, until heard
    index.add("r0", prompt.blocks, 1.0)
    blocks.sent(index, prompt)
    follower.take(frames(1, AllBlocksCleared()))
    assert index.size("r0") == 0
    assert follower.view()["cleared"] == 2


# Through a running gateway: simulators that publish their events as vLLM does.

def events_config(port: int) -> KvEventsConfig:
    return KvEventsConfig(endpoint=f"tcp://*:{port}")


async def chat(base: str, messages: list[dict[str, str]], **headers: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{base.rstrip('/')}/v1/chat/completions" if not headers else base,
            headers=headers, json={"model": MODEL, "messages": messages}) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def ask(gw: TestServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    return await chat(str(gw.make_url("/v2/compat/v1/chat/completions")), messages,
                      **{"X-API-Key": gw.api_key})  # type: ignore[attr-defined]


async def kv_view(gw: TestServer) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(
            gw.make_url("/admin/backends"), headers={"Authorization": "Bearer ops"}) as r:
        return {b["name"]: b.get("kv_events") for b in (await r.json())["data"]}


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(200):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not seen within 4 s: {what}")


def conversation(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You answer questions on {topic}. " * 40},
            {"role": "user", "content": "Why?"}]


async def test_what_an_engine_evicts_for_traffic_the_gateway_never_saw_leaves_the_index(
    simulator: SimulatorFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    events = free_ports(2)
    # Caches of 96 blocks of 16 tokens: about four of these prompts each.
    sims = [await simulator(kv_cache_blocks=96, block_size=16, default_completion_tokens=2,
                            prompt_tokens_details=True, kv_events=events_config(port))
            for port in events]
    gw = await gateway(*[{"name": f"b{i}", "kind": "vllm", "url": str(s.make_url("/")),
                          "models": [MODEL], "kv_events": f"tcp://127.0.0.1:{port}"}
                         for i, (s, port) in enumerate(zip(sims, events, strict=True))],
                       routing={"pick": "prefix"})
    pool = gw.app[ROUTER].chat_pool(MODEL)
    assert pool.index is not None
    index = pool.index
    mine = conversation("the gateway's own traffic")
    prompt = prompt_of({"messages": mine})
    assert prompt is not None

    async def stored_somewhere() -> bool:  # ZMQ joins asynchronously: ask until it is heard
        await ask(gw, mine)
        view = await kv_view(gw)
        return any(v["index_blocks_mapped"] for v in view.values())

    await until(stored_somewhere, "a stored block of ours")
    view = await kv_view(gw)
    home = next(name for name, v in view.items() if v["index_blocks_mapped"])
    engine = sims[int(home[1:])]
    assert view[home]["endpoint"] == f"tcp://127.0.0.1:{events[int(home[1:])]}"
    assert index.matched(home, prompt) == len(prompt.blocks)
    # Another client sends that engine other prompts directly: it evicts ours (the gateway's
    # own estimate of its room would keep ours for three more such prompts).
    for n in range(6):
        await chat(str(engine.make_url("/")), conversation(f"a stranger's topic {n}"))
    await until(lambda: asyncio.sleep(0, index.matched(home, prompt) == 0),
                "the evicted prompt leaving the index")
    view = await kv_view(gw)
    assert view[home]["removed"] > 0 and view[home]["gaps"] == view[home]["restarts"] == 0
    # The engine confirms it: the prompt's next request finds nothing cached there.
    answer = await chat(str(engine.make_url("/")), mine)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_restarted_engine_leaves_nothing_of_its_cache_in_the_index(
    aiohttp_server: Any, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    port, events = free_ports(2)
    config = SimConfig(models=(MODEL,), kv_cache_blocks=4096, block_size=16,
                       default_completion_tokens=2, kv_events=events_config(events))
    engine = await aiohttp_server(build_simulator("vllm", config), port=port)
    gw = await gateway({"name": "b0", "kind": "vllm", "url": f"http://127.0.0.1:{port}",
                        "models": [MODEL], "kv_events": f"tcp://127.0.0.1:{events}"},
                       routing={"pick": "prefix"})
    index = gw.app[ROUTER].chat_pool(MODEL).index
    assert index is not None
    kept = conversation("what a restart loses")
    prompt = prompt_of({"messages": kept})
    assert prompt is not None

    async def heard() -> bool:
        await ask(gw, conversation(f"joining {time.monotonic()}"))
        return bool((await kv_view(gw))["b0"]["messages"])

    await until(heard, "the engine's events")
    await ask(gw, kept)
    await until(lambda: asyncio.sleep(0, (index.matched("b0", prompt) == len(prompt.blocks))),
                "the prompt in the index")
    # The engine process ends; a new one takes its ports and stores other prompts (its first
    # messages may go out before the gateway's socket has reconnected: ZMQ drops those).
    await engine.close()
    for _ in range(100):  # ZMQ closes the old socket in its own thread: the port frees soon
        try:
            engine = await aiohttp_server(build_simulator("vllm", config), port=port)
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.02)

    async def restarted() -> bool:
        await chat(f"http://127.0.0.1:{port}", conversation(f"restarted {time.monotonic()}"))
        return bool((await kv_view(gw))["b0"]["restarts"])

    await until(restarted, "the restart")
    assert index.matched("b0", prompt) == 0 and index.size("b0") == 0
    assert (await kv_view(gw))["b0"]["restarts"] == 1
