"""Nothing a client sends makes a 500: random bodies and credentials against a running gateway."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.app import build_app
from proxy.config import load_config
from proxy.simulators import SimConfig
from proxy.simulators import build_app as build_simulator
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.config_files import GENEROUS_TIERS, MODEL, write_config

ROUTES = ["/v2/compat/v1/chat/completions", "/v2/served/v1/chat/completions",
          "/v2/messages/v1/messages", "/v2/native/api/chat"]
FIELDS = ["model", "messages", "max_tokens", "temperature", "stop", "stream", "n", "tools",
          "tool_choice", "stream_options", "mode", "async", "logprobs", "top_logprobs", "seed",
          "system", "options", "format", "think", "top_k"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
    lambda fields: {"model": MODEL, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}], **fields})
requests = st.tuples(bodies | json_values, st.sampled_from(ROUTES),
                     st.sampled_from(["none", "garbage", "jwt-ish", "valid"]))


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.data_too_large, HealthCheck.too_slow])
@given(batch=st.lists(requests, min_size=25, max_size=25))
def test_random_requests_never_cause_a_500(redis_server: RedisProcess,
                                           batch: list[tuple[Any, str, str]]) -> None:
    asyncio.run(_run(redis_server, batch))


async def _run(redis: RedisProcess, batch: list[tuple[Any, str, str]]) -> None:
    sim = TestServer(build_simulator("vllm", SimConfig(models=(MODEL,))))
    await sim.start_server()
    folder = write_config(Path(tempfile.mkdtemp()), [{
        "name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
        "models": [MODEL]}], policies={"tiers.toml": GENEROUS_TIERS})
    gw = TestServer(build_app(load_config(folder), redis_url=redis.url))
    await gw.start_server()
    credentials = {"none": {}, "garbage": {"X-API-Key": "igw_sk_nope"},
                   "jwt-ish": {"Authorization": "Bearer a.b.c"},
                   "valid": {"X-API-Key": await new_key(redis.url)}}
    try:
        async with aiohttp.ClientSession() as session:
            for body, route, who in batch:
                async with session.post(gw.make_url(route), data=orjson.dumps(body),
                                        headers=credentials[who]) as response:
                    raw = await response.read()
                    assert response.status < 500 or response.status in (502, 503, 504), raw
                    if response.status >= 400:
                        assert raw and b"error" in raw, raw
    finally:
        await gw.close()
        await sim.close()
