"""`simulate vllm` as a real vLLM 0.32 engine behaves (issue 18): its context limits, its
queue's admission control, its prefix cache, its death, its /metrics. The same behaviours are
compared with a real vLLM in tests/real_engine/test_fidelity.py; these run without one."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from tests.support.config_files import MODEL
from tests.support.upstreams import SimulatorFactory

HELLO = [{"role": "user", "content": "Hello there"}]  # 4 + 2 tokens (the simulator's rule)


async def chat(sim: TestServer, **body: Any) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            sim.make_url("/v1/chat/completions"),
            json={"model": MODEL, "messages": HELLO, **body}) as response:
        return response.status, dict(response.headers), await response.read()


def error(raw: bytes) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(raw)["error"]
    return body


async def test_the_context_bounds_the_cap_and_the_prompt(simulator: SimulatorFactory) -> None:
    sim = await simulator(max_model_len=32)
    status, _, raw = await chat(sim, max_tokens=33)
    assert status == 400 and error(raw) == {
        "message": "max_tokens=33 cannot be greater than max_model_len=32. Please request "
                   "fewer output tokens. (parameter=max_tokens, value=33)",
        "type": "BadRequestError", "param": "max_tokens", "code": 400}
    status, _, raw = await chat(sim, messages=[{"role": "user", "content": "x " * 40}])
    assert status == 400 and error(raw)["param"] == "input_tokens"
    assert "at least 33 input tokens" in error(raw)["message"]
    status, _, raw = await chat(sim, max_tokens=0)
    assert status == 400 and error(raw)["message"] == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")
    # No cap, ignore_eos: the answer runs to the end of the context, as vLLM's does.
    status, _, raw = await chat(sim, ignore_eos=True)
    usage = orjson.loads(raw)["usage"]
    assert status == 200 and usage["total_tokens"] == 32 and usage["prompt_tokens"] == 6


async def test_a_full_queue_answers_503_without_retry_after(simulator: SimulatorFactory) -> None:
    sim = await simulator(max_concurrency=1, max_queued=2, tokens_per_s=20)
    async with aiohttp.ClientSession() as session:
        streams = [await session.post(sim.make_url("/v1/chat/completions"), json={
            "model": MODEL, "messages": HELLO, "stream": True}) for _ in range(2)]
        status, headers, raw = await chat(sim, stream=True)
        assert status == 503 and "Retry-After" not in headers
        assert error(raw) == {"message": "The engine is currently busy and cannot accept new "
                                         "requests. Please try again later or on a different "
                                         "instance.",
                              "type": "Service Unavailable", "param": None, "code": 503}
        async with session.get(sim.make_url("/metrics")) as response:
            metrics = await response.text()
        for stream in streams:
            stream.close()
    assert ('vllm:admission_rejections_total{model_name="acme/small-chat",'
            'reason="max_num_queued_reqs"} 1.0') in metrics


async def test_a_repeated_prompt_hits_the_prefix_cache_in_whole_blocks(
    simulator: SimulatorFactory
) -> None:
    sim = await simulator(prompt_tokens_details=True, block_size=16)
    long = [{"role": "user", "content": "word " * 60}]  # 64 tokens
    details = []
    for body in ({}, {}, {"stream": True, "stream_options": {"include_usage": True}}):
        _, _, raw = await chat(sim, messages=long, max_tokens=2, **body)
        if body:
            usage = orjson.loads(raw.split(b"data: ")[-2])["usage"]
        else:
            usage = orjson.loads(raw)["usage"]
        details.append(usage["prompt_tokens_details"])
    assert details == [
        {"cached_tokens": 0, "created_cache_tokens": 48, "multimodal_tokens": None},
        {"cached_tokens": 48, "created_cache_tokens": 0, "multimodal_tokens": None},
        {"cached_tokens": 48, "created_cache_tokens": 0},  # streams leave out what is unset
    ]
    plain = await simulator()
    _, _, raw = await chat(plain)
    assert orjson.loads(raw)["usage"]["prompt_tokens_details"] is None


async def test_engine_death_then_the_port_closes(simulator: SimulatorFactory) -> None:
    sim = await simulator(tokens_per_s=50)
    health = sim.make_url("/health")
    async with aiohttp.ClientSession() as session:
        live = await session.post(sim.make_url("/v1/chat/completions"), json={
            "model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 200,
            "ignore_eos": True})
        await live.content.readline()
        async with session.post(sim.make_url("/_sim/engine-death")) as response:
            assert response.status == 204
        async with session.get(health) as response:
            assert response.status == 503 and await response.read() == b""
        rest = await live.content.read()
        assert rest.endswith(b'"type":"InternalServerError","param":null,"code":500}}\n\n'
                             b"data: [DONE]\n\n")
        status, _, raw = await chat(sim)
        assert status == 500 and error(raw)["message"].startswith("EngineCore encountered")
        await asyncio.sleep(0.05)  # that request shut the server down
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(health)


async def test_metrics_are_vllms_families_in_its_layout(simulator: SimulatorFactory) -> None:
    sim = await simulator()
    await chat(sim, max_tokens=3)
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/metrics")) as r:
        assert r.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
        text = await r.text()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types["vllm:prompt_tokens_total"] == "counter"
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert all(f"# HELP {name} " in text for name in types)
    labels = 'engine="0",finished_reason="length",model_name="acme/small-chat"'
    assert f"vllm:request_success_total{{{labels}}} 1.0" in text
    assert re.search(r'^vllm:e2e_request_latency_seconds_bucket\{engine="0",le="\+Inf",'
                     r'model_name="acme/small-chat"\} 1\.0$', text, re.M)


async def test_prefill_time_and_computed_tokens_are_vllms_histograms(
    simulator: SimulatorFactory
) -> None:
    """What the gateway fits an engine's prefill price from (proxy.upstream.prefill_price): the
    time from the start of a request's prefill to its first token, and the prompt tokens
    computed (not found cached)."""
    sim = await simulator(block_size=16, prefill_ms_per_1k_tokens=1000, ttft_ms=10,
                          max_model_len=1024)
    long = [{"role": "user", "content": "word " * 60}]  # 64 tokens, 48 of them cacheable
    for _ in range(2):
        status, _, _ = await chat(sim, messages=long, max_tokens=2)
        assert status == 200
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/metrics")) as r:
        text = await r.text()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types["vllm:request_prefill_time_seconds"] == "histogram"
    assert types["vllm:request_prefill_kv_computed_tokens"] == "histogram"

    def sample(name: str) -> float:
        found = re.search(rf'^{name}\{{engine="0",model_name="acme/small-chat"\}} (\S+)$',
                          text, re.M)
        assert found is not None, name
        return float(found.group(1))

    assert sample("vllm:request_prefill_kv_computed_tokens_count") == 2.0
    assert sample("vllm:request_prefill_kv_computed_tokens_sum") == 64.0 + 16.0
    # 80 tokens at 1 ms each, plus the engine's 10 ms to a first token, twice.
    assert sample("vllm:request_prefill_time_seconds_count") == 2.0
    assert 0.099 < sample("vllm:request_prefill_time_seconds_sum") < 0.2
    # The token histogram's buckets follow the context, as vLLM sizes them: 1, 2, 5 ... 1000.
    bounds = re.findall(r'^vllm:request_prefill_kv_computed_tokens_bucket\{engine="0",'
                        r'le="([^"]+)"', text, re.M)
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0",
                      "1000.0", "+Inf"]


async def test_a_wait_for_the_prefills_ahead_is_not_prefill_time(
    simulator: SimulatorFactory
) -> None:
    """vLLM keeps a request in its queue until a step's token budget takes its prompt, so its
    prefill clock starts with its own prefill: two prompts sent at once, the second prefilled
    after the first, count each one's own prefill, not the second's wait as well."""
    sim = await simulator(prefill_ms_per_1k_tokens=1000, ttft_ms=10, max_concurrency=2)
    prompts = [[{"role": "user", "content": f"prompt{i} " + "word " * 200}] for i in range(2)]
    answers = await asyncio.gather(*(chat(sim, messages=m, max_tokens=1) for m in prompts))
    assert [status for status, _, _ in answers] == [200, 200]
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/metrics")) as r:
        text = await r.text()
    found = re.search(r'^vllm:request_prefill_time_seconds_sum\{engine="0",'
                      r'model_name="acme/small-chat"\} (\S+)$', text, re.M)
    assert found is not None
    # Each about 0.2 s of its own tokens and 0.01 s; with the second's wait, 0.2 s more.
    assert 0.4 < float(found.group(1)) < 0.5
