"""The engine's context length: read from vLLM's /v1/models by the prober (in the background,
before the first request), then a cap beyond it is the gateway's 422 in every style, and a
request that names none is held and capped within it (issue 18)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from proxy.upstream.prober import context_lengths
from tests.support.accounts import funded_key, journal
from tests.support.chat import HELLO
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory, sim_requests

CONTEXT = 64
PRICES = """
version = "ctx-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""
# (path, body without the cap, where the cap goes, the loc a 422 names)
STYLES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "compat": ("/v2/compat/v1/chat/completions", {"model": MODEL, "messages": HELLO},
               ("max_tokens",)),
    "compat-new": ("/v2/compat/v1/chat/completions", {"model": MODEL, "messages": HELLO},
                   ("max_completion_tokens",)),
    "served": ("/v2/served/v1/chat/completions", {"model": MODEL, "messages": HELLO},
               ("max_tokens",)),
    "messages": ("/v2/messages/v1/messages", {"model": MODEL, "messages": HELLO},
                 ("max_tokens",)),
    "native": ("/v2/native/api/chat", {"model": MODEL, "messages": HELLO, "stream": False},
               ("options", "num_predict")),
}


def with_cap(body: dict[str, Any], where: tuple[str, ...], cap: int) -> dict[str, Any]:
    out = dict(body)
    if len(where) == 1:
        out[where[0]] = cap
    else:
        out[where[0]] = {where[1]: cap}
    return out


async def call(gw: TestServer, key: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(path), json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.read()


@pytest.fixture
async def setup(simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: Any
                ) -> tuple[TestServer, TestServer, str]:
    sim = await simulator(max_model_len=CONTEXT)
    gw = await gateway(sim, policies={"prices.toml": PRICES})
    return sim, gw, await funded_key(clean_redis.url)


async def test_the_context_is_learned_before_the_first_request(
    setup: tuple[TestServer, TestServer, str]
) -> None:
    sim, gw, _ = setup
    [backend] = gw.app[ROUTER].backends
    assert backend.max_model_len == {MODEL: CONTEXT}
    assert gw.app[ROUTER].chat_pool(MODEL).context_limit() == CONTEXT
    assert await sim_requests(sim) == []  # read by the prober, not on a request's path


@pytest.mark.parametrize("style", sorted(STYLES))
async def test_a_cap_beyond_the_context_is_422_and_reaches_nothing(
    style: str, setup: tuple[TestServer, TestServer, str], clean_redis: Any
) -> None:
    sim, gw, key = setup
    path, body, where = STYLES[style]
    status, raw = await call(gw, key, path, with_cap(body, where, CONTEXT + 1))
    assert status == 422, raw
    detail = orjson.loads(raw).get("detail")
    assert detail[0]["loc"] == ["body", *where] and f"{CONTEXT}," in detail[0]["msg"]
    assert await sim_requests(sim) == []
    await settled(gw)
    assert [e for e in await journal(clean_redis.url) if e["type"] == "charge"] == []
    status, raw = await call(gw, key, path, with_cap(body, where, CONTEXT))  # the edge is fine
    assert status == 200, raw


@pytest.mark.parametrize("style", ["compat", "native"])
async def test_a_request_without_a_cap_is_held_and_capped_within_the_context(
    style: str, setup: tuple[TestServer, TestServer, str], clean_redis: Any
) -> None:
    sim, gw, key = setup
    path, body, _ = STYLES[style]
    status, raw = await call(gw, key, path, body)  # default_max_tokens (4096) would not fit
    assert status == 200, raw
    [sent] = [r["body"] for r in await sim_requests(sim)]
    assert sent["max_tokens"] == CONTEXT
    await settled(gw)
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert charge["held_max"] < 4096 * 10 and charge["held_max"] >= CONTEXT * 10


def test_context_lengths_come_only_from_well_formed_entries() -> None:
    raw = orjson.dumps({"object": "list", "data": [
        {"id": "a", "max_model_len": 1024}, {"id": "b"}, {"id": "c", "max_model_len": "9"},
        {"id": "d", "max_model_len": 0}, {"id": "e", "max_model_len": True}, "junk",
        {"max_model_len": 5}]})
    assert context_lengths(raw) == {"a": 1024}
    assert context_lengths(b"not json") is None
    assert context_lengths(b"[]") is None
    assert context_lengths(b'{"data": {}}') is None
