"""The chat simulators under load, as engines (issue 17, part 4): a batch limit and a waiting
queue, prefill time and a block-hashed prefix cache that cuts it, KV-cache usage, per-replica
speed, and the gauges a router reads, parsed with prometheus_client's own text parser.

Timing assertions are lower bounds the simulators' sleeps guarantee (a busy machine only makes
an answer later) or comparisons with wide margins; queue state is read from the gauges and
from `/_sim/requests`, not from the clock.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.simulators import SimConfig, cli
from proxy.simulators.kvcache import BlockPool, block_hashes, hittable_blocks
from proxy.simulators.textgen import prompt_token_list, prompt_tokens
from tests.support.config_files import MODEL
from tests.support.processes import free_port
from tests.support.upstreams import SimulatorFactory

Messages = list[dict[str, Any]]
Metrics = dict[str, float]


def words(word: str, count: int) -> str:
    return f"{word} " * count


def user(text: str) -> Messages:
    return [{"role": "user", "content": text}]  # 4 tokens + one a word


def parse(text: str) -> tuple[Metrics, dict[str, str]]:
    """Each family's value (summed over labels; histograms left out) and type, as
    prometheus_client reads them (counters by their name without `_total`)."""
    values: Metrics = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            if sample.name in (family.name, family.name + "_total"):
                values[family.name] = values.get(family.name, 0.0) + sample.value
    return values, types


async def scrape(sim: TestServer) -> Metrics:
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/metrics")) as r:
        return parse(await r.text())[0]


async def until(sim: TestServer, ready: Callable[[Metrics], bool]) -> Metrics:
    """Scrape until `ready` holds (for 10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = await scrape(sim)
        if ready(metrics):
            return metrics
        assert time.monotonic() < deadline, metrics
        await asyncio.sleep(0.01)


def chat_body(messages: Messages, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, **extra}


async def open_stream(session: aiohttp.ClientSession, sim: TestServer, messages: Messages,
                      max_tokens: int) -> aiohttp.ClientResponse:
    """A stream of exactly `max_tokens` tokens, open once its headers arrived (vLLM sends
    them before the request is scheduled)."""
    response = await session.post(sim.make_url("/v1/chat/completions"), json=chat_body(
        messages, stream=True, max_tokens=max_tokens, ignore_eos=True))
    assert response.status == 200
    return response


async def timed_stream(sim: TestServer, messages: Messages, max_tokens: int,
                       start: float | None = None) -> tuple[float, float]:
    """(time to the first event, time to the end) of a whole stream, from `start`."""
    async with aiohttp.ClientSession() as session:
        begin = time.monotonic() if start is None else start
        response = await open_stream(session, sim, messages, max_tokens)
        await response.content.readuntil(b"\n\n")
        first = time.monotonic() - begin
        await response.read()
        return first, time.monotonic() - begin


async def usage(sim: TestServer, messages: Messages, max_tokens: int = 2) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(
            sim.make_url("/v1/chat/completions"),
            json=chat_body(messages, max_tokens=max_tokens)) as response:
        assert response.status == 200
        body: dict[str, Any] = orjson.loads(await response.read())
        return body["usage"]  # type: ignore[no-any-return]


async def cached(sim: TestServer, messages: Messages) -> int:
    details = (await usage(sim, messages))["prompt_tokens_details"]
    return int(details["cached_tokens"])


async def outcomes(sim: TestServer) -> list[str | None]:
    async with aiohttp.ClientSession() as session, \
            session.get(sim.make_url("/_sim/requests")) as response:
        return [record["outcome"] for record in await response.json()]


# ---------------------------------------------------------------- the KV cache (pure)


def test_block_hashes_chain_over_everything_before_the_block() -> None:
    shared = [f"t{i}" for i in range(20)]
    one = block_hashes([*shared, *"abcd"], 8, 3)
    two = block_hashes([*shared, *"wxyz"], 8, 3)
    assert one[:2] == two[:2] and one[2] != two[2]  # tokens 16-23 differ from token 20 on
    moved = block_hashes(["other", *shared[1:], *"abcd"], 8, 3)
    assert not set(moved) & set(one)  # same later tokens, different beginning: nothing shared
    assert [hittable_blocks(n, 16) for n in (16, 17, 64, 65)] == [0, 1, 3, 4]


def test_the_pool_forgets_unheld_blocks_least_recently_used_and_endings_first() -> None:
    pool = BlockPool(capacity=4)
    assert pool.acquire([b"a1", b"a2"]) == 0
    pool.release([b"a1", b"a2"])
    assert pool.acquire([b"b1", b"b2"]) == 0
    pool.release([b"b1", b"b2"])
    assert (pool.held, pool.cached) == (0, 4)
    assert pool.acquire([b"a1", b"c2"]) == 1  # a shared beginning hits; a1 is used again
    assert pool.forget(private=1) == [b"a2", b"b2"]  # room for 1 more unheld block
    assert pool.cached_prefix([b"a1", b"a2"]) == 1 and pool.cached_prefix([b"b1", b"b2"]) == 1
    assert pool.forget(private=10) == [b"b1"]  # held blocks stay, however short the room
    assert (pool.held, pool.cached) == (2, 2)
    pool.acquire([b"a1"])  # a second request on the same block: held once, counted once
    assert pool.held == 2
    pool.release([b"a1"])
    assert pool.cached_prefix([b"a1", b"c2"]) == 2


def test_the_prompt_token_list_is_what_prompt_tokens_counts() -> None:
    messages: Messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi, there"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]},
    ]
    tokens = prompt_token_list(messages)
    assert len(tokens) == prompt_tokens(messages) == 7 + 7 + 4 + 8
    assert tokens[:4] == ["<|start|>", "system", "<|content|>", "Be"]


# ---------------------------------------------------------------- batch and queue


async def test_a_full_batch_queues_the_next_requests_in_arrival_order(
    simulator: SimulatorFactory,
) -> None:
    sim = await simulator(max_concurrency=1, tokens_per_s=50)
    async with aiohttp.ClientSession() as session:
        first = await open_stream(session, sim, user("first"), 500)  # 10 s: holds the slot
        await first.content.readuntil(b"\n\n")
        second = await open_stream(session, sim, user("second"), 2)
        third = await open_stream(session, sim, user("third"), 2)
        metrics = await until(sim, lambda m: m["vllm:num_requests_waiting"] == 2)
        assert metrics["vllm:num_requests_running"] == 1
        second_token = asyncio.ensure_future(second.content.readuntil(b"\n\n"))
        await asyncio.sleep(0.2)
        assert not second_token.done()  # nothing while the batch is full
        first.close()  # the client leaves: its slot goes to the head of the queue
        await second_token
        await third.content.readuntil(b"\n\n")
        # The third started only once the second had finished.
        assert (await outcomes(sim))[:2] == ["cancelled", "completed"]
        await third.read()
    await until(sim, lambda m: m["vllm:num_requests_running"] == 0)


async def test_time_to_first_token_grows_with_queue_position(
    simulator: SimulatorFactory,
) -> None:
    sim = await simulator(max_concurrency=1, ttft_ms=10, tokens_per_s=100)
    start = time.monotonic()
    # Each holds the only slot for at least 10 ms + 4 tokens 10 ms apart.
    timings = await asyncio.gather(*(timed_stream(sim, user(f"request {i}"), 5, start)
                                     for i in range(4)))
    firsts = sorted(first for first, _ in timings)
    for position, first in enumerate(firsts):
        assert first >= 0.9 * (0.01 + position * 0.05), firsts
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/metrics")) as r:
        text = await r.text()
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="acme/small-chat"} ' \
           "4.0" in text


async def test_tgi_queues_beyond_its_batch_and_refuses_beyond_max_concurrent_requests(
    simulator: SimulatorFactory,
) -> None:
    sim = await simulator("tgi", max_concurrency=3, max_batch_size=1, tokens_per_s=50)
    async with aiohttp.ClientSession() as session:
        first = await session.post(sim.make_url("/generate_stream"), json={
            "inputs": words("alpha", 10), "parameters": {"max_new_tokens": 200}})
        await first.content.readuntil(b"\n\n")
        queued = [asyncio.ensure_future(session.post(sim.make_url("/generate"), json={
            "inputs": "Hello there", "parameters": {"max_new_tokens": 3}})) for _ in range(2)]
        metrics = await until(sim, lambda m: m["tgi_queue_size"] == 2)
        assert metrics["tgi_batch_current_size"] == 1
        assert metrics["tgi_batch_current_max_tokens"] == 10 + 200  # prompt + max new tokens
        assert metrics["tgi_batch_max_total_tokens"] == 65536 * 16
        refused = await session.post(sim.make_url("/generate"), json={"inputs": "x"})
        assert refused.status == 429  # 3 in flight: 1 running, 2 queued
        await asyncio.sleep(0.1)
        first.close()
        for answer in await asyncio.gather(*queued):
            assert answer.status == 200
            assert int(answer.headers["x-queue-time"]) >= 100
            answer.release()
    metrics = await until(sim, lambda m: m["tgi_batch_current_size"] == 0)
    assert (metrics["tgi_queue_size"], metrics["tgi_batch_current_max_tokens"]) == (0, 0)
    assert metrics["tgi_request_failure"] >= 2  # the 429 and the dropped stream


# ---------------------------------------------------------------- prefix cache and prefill


async def test_requests_sharing_a_system_prompt_share_its_cached_blocks(
    simulator: SimulatorFactory,
) -> None:
    sim = await simulator(prompt_tokens_details=True, block_size=16)
    system = {"role": "system", "content": words("rule", 60)}  # 64 tokens: 4 whole blocks
    first_turn = [system, {"role": "user", "content": words("ask", 28)}]  # 96 tokens
    prompts = [
        first_turn,
        [system, {"role": "user", "content": words("other", 40)}],  # the system prompt's 4
        # The next turn: all of the first turn's cached blocks (5: its first 95 tokens).
        [*first_turn, {"role": "assistant", "content": "Fine"}, *user("And then?")],
    ]
    usages = [await usage(sim, messages) for messages in prompts]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 64, 80]
    metrics = await scrape(sim)
    assert metrics["vllm:prefix_cache_hits"] == 64 + 80
    assert metrics["vllm:prefix_cache_queries"] == sum(u["prompt_tokens"] for u in usages)


async def test_a_prefix_hit_cuts_the_time_to_first_token(simulator: SimulatorFactory) -> None:
    sim = await simulator(prefill_ms_per_1k_tokens=2000, prompt_tokens_details=True)
    prompt = user(words("context", 196))  # 200 tokens: 0.4 s of prefill
    miss, _ = await timed_stream(sim, prompt, 1)
    hit, _ = await timed_stream(sim, prompt, 1)  # 192 tokens cached: 16 ms left to prefill
    assert miss >= 0.9 * 0.4
    assert hit < miss / 2, (hit, miss)
    assert (await scrape(sim))["vllm:prefix_cache_hits"] == 192


async def test_a_small_cache_forgets_the_least_recently_used_prefix(
    simulator: SimulatorFactory,
) -> None:
    small = await simulator(prompt_tokens_details=True, kv_cache_blocks=8)
    large = await simulator(prompt_tokens_details=True)

    def prompt(word: str) -> Messages:
        return user(words(word, 60))  # 64 tokens: 3 cacheable blocks

    for sim in (small, large):
        for word in ("alpha", "beta", "gamma"):
            assert await cached(sim, prompt(word)) == 0
    assert await cached(large, prompt("alpha")) == 48  # room for all three
    assert await cached(small, prompt("gamma")) == 48  # the latest stays
    assert await cached(small, prompt("alpha")) < 48  # the oldest made room
    assert (await scrape(small))["vllm:kv_cache_usage_perc"] == 0.0


async def test_kv_cache_usage_and_room_for_a_prompt(simulator: SimulatorFactory) -> None:
    sim = await simulator(kv_cache_blocks=24, tokens_per_s=20)
    alpha, beta = user(words("alpha", 196)), user(words("beta", 196))  # 12 shared blocks + 1
    async with aiohttp.ClientSession() as session:
        first = await open_stream(session, sim, alpha, 200)
        await first.content.readuntil(b"\n\n")
        usage_one = (await scrape(sim))["vllm:kv_cache_usage_perc"]
        assert 13 / 24 <= usage_one < 1
        same = await open_stream(session, sim, alpha, 200)  # shares the 12: needs 1 more
        await same.content.readuntil(b"\n\n")
        other = await open_stream(session, sim, beta, 2)  # needs 13: no room beside 14+
        metrics = await until(sim, lambda m: m["vllm:num_requests_waiting"] == 1)
        assert metrics["vllm:num_requests_running"] == 2
        assert usage_one < metrics["vllm:kv_cache_usage_perc"] <= 1
        first.close()
        same.close()
        await other.read()  # scheduled once the blocks were freed
    metrics = await until(sim, lambda m: m["vllm:num_requests_running"] == 0)
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    tiny = await simulator(kv_cache_blocks=4, tokens_per_s=20)
    async with aiohttp.ClientSession() as session:
        # Alone, a request too big for the cache still runs (and fills it).
        big = await open_stream(session, tiny, alpha, 50)
        await big.content.readuntil(b"\n\n")
        assert (await scrape(tiny))["vllm:kv_cache_usage_perc"] == 1.0
        big.close()


# ---------------------------------------------------------------- speed, exposition, CLI


async def test_a_slow_replica_is_slower_in_every_phase(simulator: SimulatorFactory) -> None:
    options = {"ttft_ms": 20, "tokens_per_s": 100, "prefill_ms_per_1k_tokens": 1000}
    fast = await simulator(**options)
    slow = await simulator(speed=0.25, **options)
    prompt = user(words("word", 16))  # 20 tokens: 20 ms of prefill at full speed
    fast_first, fast_total = await timed_stream(fast, prompt, 5)
    slow_first, slow_total = await timed_stream(slow, prompt, 5)
    assert slow_first >= 0.9 * 4 * (0.02 + 0.02)  # first token: ttft and prefill, 4x
    assert slow_total - slow_first >= 0.9 * 4 * 0.04  # 4 token intervals, each 4x
    assert fast_first < slow_first and fast_total < slow_total


@pytest.mark.parametrize("kind", ["vllm", "tgi"])
async def test_metrics_parse_with_prometheus_clients_parser_under_load(
    simulator: SimulatorFactory, kind: str,
) -> None:
    sim = await simulator(kind, max_concurrency=4, max_batch_size=1, tokens_per_s=50)
    async with aiohttp.ClientSession() as session:
        await usage(sim, user("warm up"))
        first = await open_stream(session, sim, user("hold the slot"), 200)
        await first.content.readuntil(b"\n\n")
        second = await open_stream(session, sim, user("wait"), 2)
        key = "vllm:num_requests_waiting" if kind == "vllm" else "tgi_queue_size"
        await until(sim, lambda m: m[key] == 1)
        async with session.get(sim.make_url("/metrics")) as response:
            values, types = parse(await response.text())
        first.close()
        second.close()
    if kind == "vllm":
        assert {name: types[name] for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
            "vllm:time_to_first_token_seconds")} == {
            "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
            "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_hits": "counter",
            "vllm:prefix_cache_queries": "counter",
            "vllm:time_to_first_token_seconds": "histogram"}
        assert values["vllm:num_requests_running"] == 1
        assert 0 < values["vllm:kv_cache_usage_perc"] <= 1
        assert values["vllm:prefix_cache_queries"] > 0
    else:
        gauges = ("tgi_queue_size", "tgi_batch_current_size", "tgi_batch_current_max_tokens",
                  "tgi_batch_max_total_tokens")
        assert {name: types[name] for name in gauges} == dict.fromkeys(gauges, "gauge")
        assert values["tgi_batch_current_size"] == 1
        assert values["tgi_batch_current_max_tokens"] == 4 + 3 + 200  # a chat prompt + cap
        assert types["tgi_request_count"] == "counter"


def test_cli_engine_flags() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    vllm = parser.parse_args(["vllm", "--speed", "0.33", "--max-num-seqs", "8",
                              "--prefill-ms-per-1k-tokens", "50", "--kv-cache-blocks", "100"])
    assert cli.config_from(vllm) == SimConfig(
        models=(MODEL,), speed=0.33, max_concurrency=8, prefill_ms_per_1k_tokens=50,
        kv_cache_blocks=100)
    tgi = parser.parse_args(["tgi", "--max-concurrent-requests", "4", "--max-batch-size", "2",
                             "--max-batch-total-tokens", "4096"])
    assert cli.config_from(tgi) == SimConfig(
        models=(MODEL,), max_concurrency=4, max_batch_size=2, kv_cache_blocks=4096 // 16)
    assert parser.parse_args(["vllm", "--num-gpu-blocks-override", "7"]).kv_cache_blocks == 7
    for bad in (["--speed", "0"], ["--max-num-seqs", "0"], ["--prefill-ms-per-1k-tokens", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["vllm", *bad])


def test_the_cli_runs_an_uneven_replica() -> None:
    """`inference-gateway simulate vllm --speed ... --max-num-seqs ...` as an operator runs it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "vllm", "--port",
                             str(port), "--model", MODEL, "--speed", "0.5", "--max-num-seqs",
                             "1", "--tokens-per-s", "20", "--prefill-ms-per-1k-tokens", "100"],
                            stdout=subprocess.DEVNULL)
    try:
        asyncio.run(_two_requests_on_one_slot(f"http://127.0.0.1:{port}", proc))
    finally:
        proc.terminate()
        proc.wait(10)


async def _two_requests_on_one_slot(base: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "the simulator exited"
            try:
                async with session.get(base + "/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            assert time.monotonic() < deadline, "the simulator never listened"
            await asyncio.sleep(0.1)
        streams = [await session.post(base + "/v1/chat/completions", json=chat_body(
            user(f"request {i}"), stream=True, max_tokens=100, ignore_eos=True))
            for i in range(2)]
        for _ in range(200):
            async with session.get(base + "/metrics") as response:
                values = parse(await response.text())[0]
            if values["vllm:num_requests_waiting"] == 1:
                break
            await asyncio.sleep(0.02)
        assert (values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]) == (1, 1)
        for stream in streams:
            stream.close()
