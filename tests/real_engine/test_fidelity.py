"""Simulator fidelity: the same requests to `simulate vllm` and to a real vLLM, compared as a
client sees them. Values that differ by nature (ids, times, sampled text, token counts of two
different tokenizers) are compared by type; everything else must match: statuses, error
bodies, SSE framing, the usage chunk, /v1/models, /health while the engine dies, metric names
and types. What the simulator differs in on purpose is listed in its docstring."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from tests.support.fidelity import events, shape
from tests.support.real_engines import MAX_MODEL_LEN, SERVED, Engines, Replica
from tests.support.upstreams import SimulatorFactory
from tests.support.vllm_metrics import families, scrape

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

HELLO = [{"role": "user", "content": "Hello there"}]
# What the tier's replicas run with (engines.REPLICA_ARGS), as simulator options.
SIM_OPTIONS: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "max_concurrency": 4,
                               "max_queued": 8, "prompt_tokens_details": True,
                               "block_size": 32, "tokens_per_s": 200}
# The families a gateway reads (routing, load, cache), which the simulator must serve.
NEEDED_METRICS = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:admission_rejections_total",
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_prefill_kv_computed_tokens",
}


async def exchange(base: str, path: str, body: Any | None = None
                   ) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session:
        method = session.post(base + path, json=body) if body is not None \
            else session.get(base + path)
        async with method as response:
            return response.status, dict(response.headers), await response.read()


@pytest.fixture
async def pair(replicas: Engines, simulator: SimulatorFactory) -> tuple[str, str]:
    sim: TestServer = await simulator("vllm", models=(SERVED,), **SIM_OPTIONS)
    return replicas[0].url, str(sim.make_url("")).rstrip("/")


def both(pair: tuple[str, str], path: str, body: Any | None = None
         ) -> Any:
    real, sim = pair
    return asyncio.gather(exchange(real, path, body), exchange(sim, path, body))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "status"), [
    ({"model": "acme/does-not-exist", "messages": HELLO, "max_tokens": 4}, 404),
    ({"model": SERVED, "messages": HELLO, "max_tokens": 5000}, 400),
    ({"model": SERVED, "messages": HELLO, "max_tokens": 0}, 400),
    ({"model": SERVED, "messages": [{"role": "user", "content": "license " * 1500}],
      "max_tokens": 4}, 400),
])
async def test_errors_match(pair: tuple[str, str], body: dict[str, Any], status: int,
                            stream: bool) -> None:
    (real_status, real_headers, real), (sim_status, sim_headers, sim) = await both(
        pair, "/v1/chat/completions", {**body, "stream": stream})
    assert (real_status, sim_status) == (status, status)
    assert real_headers["Content-Type"] == sim_headers["Content-Type"] == "application/json"
    assert orjson.loads(sim) == orjson.loads(real)  # the whole body, message text included


async def test_a_completion_has_the_same_shape(pair: tuple[str, str]) -> None:
    body = {"model": SERVED, "messages": HELLO, "max_tokens": 5, "ignore_eos": True}
    (real_status, _, real), (sim_status, _, sim) = await both(pair, "/v1/chat/completions", body)
    assert real_status == sim_status == 200
    assert shape(orjson.loads(sim)) == shape(orjson.loads(real))
    assert orjson.loads(sim)["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("usage", [False, True])
async def test_a_stream_has_the_same_framing_and_usage_chunk(pair: tuple[str, str],
                                                             usage: bool) -> None:
    body: dict[str, Any] = {"model": SERVED, "messages": HELLO, "max_tokens": 4,
                            "ignore_eos": True, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    (real_status, real_headers, real), (sim_status, sim_headers, sim) = await both(
        pair, "/v1/chat/completions", body)
    assert real_status == sim_status == 200
    assert sim_headers["Content-Type"] == real_headers["Content-Type"]
    assert "Content-Length" not in sim_headers and "Content-Length" not in real_headers
    real_events, sim_events = events(real), events(sim)
    assert real_events[-1] == sim_events[-1] == b"[DONE]"
    # role chunk, 4 content chunks (finish_reason on the last), then the usage chunk if asked.
    # vLLM sends what each engine step made; outputs that queue up while the API server is
    # busy go out merged in one chunk (a loaded full run saw 3 content chunks for 4 tokens).
    assert len(sim_events) == 6 + usage
    assert 3 + usage <= len(real_events) <= 6 + usage
    real_chunks = [shape(orjson.loads(e)) for e in real_events[:-1]]
    sim_chunks = [shape(orjson.loads(e)) for e in sim_events[:-1]]
    last = -1 - usage  # the content chunk with finish_reason
    assert sim_chunks[0] == real_chunks[0]  # the role chunk
    assert sim_chunks[last] == real_chunks[last]
    assert all(chunk == sim_chunks[1] for chunk in real_chunks[1:last])  # plain content
    if usage:
        assert sim_chunks[-1] == real_chunks[-1]


async def test_models_list_is_the_same(pair: tuple[str, str]) -> None:
    (_, real_headers, real), (_, sim_headers, sim) = await both(pair, "/v1/models")
    real_models, sim_models = orjson.loads(real), orjson.loads(sim)
    assert shape(sim_models) == shape(real_models)
    pick = ("id", "object", "owned_by", "parent", "max_model_len")
    assert [{k: m[k] for k in pick} for m in sim_models["data"]] == \
        [{k: m[k] for k in pick} for m in real_models["data"]]
    assert sim_headers["Content-Type"] == real_headers["Content-Type"]


async def test_metric_names_and_types(pair: tuple[str, str]) -> None:
    real_base, sim_base = pair
    await exchange(sim_base, "/v1/chat/completions", {"model": SERVED, "messages": HELLO,
                                                       "max_tokens": 2})
    real_text, sim_text = await scrape(real_base), await scrape(sim_base)
    real, sim = families(real_text), families(sim_text)
    sim_vllm = {name: kind for name, kind in sim.items() if name.startswith("vllm:")}
    assert set(sim_vllm) >= NEEDED_METRICS
    assert {name: real.get(name) for name in sim_vllm} == sim_vllm  # names and types agree
    # The same label names on each series the simulator shares with the engine.
    assert labels(sim_text) == {k: v for k, v in labels(real_text).items() if k in labels(sim_text)}
    _, real_headers, _ = await exchange(real_base, "/metrics")
    _, sim_headers, _ = await exchange(sim_base, "/metrics")
    assert sim_headers["Content-Type"] == real_headers["Content-Type"]


def labels(text: str) -> dict[str, frozenset[str]]:
    """Series name -> its label names (series of one family may differ, e.g. `le`)."""
    out: dict[str, frozenset[str]] = {}
    for match in re.finditer(r"^(vllm:[a-z_:]+)\{([^}]*)\}", text, re.M):
        out[match[1]] = frozenset(re.findall(r'(\w+)="', match[2]))
    return out


async def watch_death(base: str, kill: Any) -> tuple[list[str], list[bytes], bytes]:
    """Kill the engine under a live stream; return what /health said until the port closed
    (collapsed), the 500 bodies seen meanwhile, and the end of the live stream."""
    async with aiohttp.ClientSession() as session:
        live = await session.post(base + "/v1/chat/completions", json={
            "model": SERVED, "messages": HELLO, "max_tokens": 900, "ignore_eos": True,
            "stream": True})
        assert live.status == 200  # streaming; killed at once, before it could finish
        await kill()
        seen: list[str] = []
        failures: list[bytes] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while (not seen or seen[-1] != "refused") and loop.time() < deadline:
            try:
                async with session.get(base + "/health") as response:
                    state = str(response.status)
                    assert await response.read() == b""
                async with session.post(base + "/v1/chat/completions", json={
                        "model": SERVED, "messages": HELLO, "max_tokens": 2}) as response:
                    if response.status != 200:
                        failures.append(await response.read())
            except aiohttp.ClientConnectionError:
                state = "refused"
            if not seen or seen[-1] != state:
                seen.append(state)
            await asyncio.sleep(0.02)
        try:
            tail = (await live.content.read())[-400:]
        except aiohttp.ClientPayloadError:
            tail = b"(cut)"
        live.close()
    return seen, failures, tail


def replica_alive(engines: Engines) -> Replica:
    running = [r for r in engines.replicas if r.running]
    assert running, "no replica left to kill"
    return running[-1]


@pytest.mark.kills_engine
async def test_health_while_the_engine_dies(engines: Engines,
                                            simulator: SimulatorFactory) -> None:
    replica = replica_alive(engines)
    sim: TestServer = await simulator("vllm", models=(SERVED,), **SIM_OPTIONS)

    async def kill_real() -> None:
        replica.kill_core()

    async def kill_sim() -> None:
        async with aiohttp.ClientSession() as session, session.post(
                sim.make_url("/_sim/engine-death")) as response:
            assert response.status == 204

    real = await watch_death(replica.url, kill_real)
    simulated = await watch_death(str(sim.make_url("")).rstrip("/"), kill_sim)
    for seen, failures, tail in (real, simulated):
        # /health: 200 until the death is noticed, then 503, then the port closes for good.
        assert seen[-1] == "refused" and seen[0] in ("200", "503"), seen
        assert seen in (["200", "503", "refused"], ["503", "refused"], ["200", "refused"])
        assert len(set(failures)) <= 1  # one answer while dead: vLLM's EngineDeadError 500
        # The live stream ends with the engine's error event, then [DONE].
        assert b'data: {"error"' in tail, (seen, tail)
        ends = events(tail[tail.index(b'data: {"error"'):])
        assert ends[-1] == b"[DONE]" and orjson.loads(ends[-2])["error"]["code"] == 500
    if real[1] and simulated[1]:
        assert orjson.loads(simulated[1][0]) == orjson.loads(real[1][0])
