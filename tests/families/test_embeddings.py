"""Embeddings through the gateway with the official `openai` client: text-embeddings-inference
and vLLM (`--runner pooling`) simulators behind `/v2/compat/v1/embeddings`, charged per input
token as the servers counted them, in the tier's token limits, refused before anything is sent
when the request is not one."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.appkeys import ROUTER
from proxy.credits.ledger import Ledger
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

TEI_MODEL, VLLM_MODEL = "acme/embed-small", "acme/embed-vllm"
PER_1K = 20  # micro-credits per 1k input tokens
PRICES = f"""
version = "embed-v1"
[models."{TEI_MODEL}"]
prompt_per_1k_tokens = {PER_1K}
[models."{VLLM_MODEL}"]
prompt_per_1k_tokens = {PER_1K}
"""
TIERS = """
[tiers.guest]
requests_per_minute = 100000
families = ["chat"]
models = { "*" = ["direct"] }
[tiers.basic]
requests_per_minute = 100000
families = ["chat"]
models = { "*" = ["direct"] }
[tiers.pro]
requests_per_minute = 100000
families = ["chat", "embed"]
models = { "*" = ["direct"] }
tokens_per_minute = 200
[tiers.max]
requests_per_minute = 100000
families = ["chat", "embed"]
models = { "*" = ["direct"] }
"""


@dataclass
class Stack:
    gateway: TestServer
    tei: TestServer
    vllm: TestServer
    redis_url: str

    async def key(self, tier: str, account: str, credits: int = 10**9) -> str:
        key = await new_key(self.redis_url, tier, account=account)
        redis = Redis.from_url(self.redis_url)
        try:
            await Ledger(redis).credit(account, credits, {"reason": "test"})
        finally:
            await redis.aclose()
        return key

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=str(self.gateway.make_url("/v2/compat/v1")),
                                  api_key=key, max_retries=0)

    async def sent(self, server: TestServer) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session, session.get(
                server.make_url("/_sim/requests")) as response:
            records: list[dict[str, Any]] = await response.json()
            return records

    async def charges(self, account: str) -> list[dict[str, Any]]:
        await settled(self.gateway)
        redis = Redis.from_url(self.redis_url)
        try:
            entries = await Ledger(redis).all_entries(account)
        finally:
            await redis.aclose()
        return [e for e in entries if e["type"] == "charge"]

    async def post(self, body: Any, key: str) -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session, session.post(
                self.gateway.make_url("/v2/compat/v1/embeddings"), json=body,
                headers={"Authorization": f"Bearer {key}"}) as response:
            return response.status, await response.json()


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def stack(gateway: GatewayFactory, simulator: SimulatorFactory,
                clean_redis: RedisProcess) -> StackFactory:
    async def start(tei: dict[str, Any] | None = None, backend: dict[str, Any] | None = None,
                    requests_toml: str = "") -> Stack:
        tei_sim = await simulator("tei", (TEI_MODEL,), **(tei or {}))
        vllm_sim = await simulator("vllm", (VLLM_MODEL,), runner="pooling")
        gw = await gateway(
            {"name": "tei-a", "kind": "tei", "url": str(tei_sim.make_url("/")).rstrip("/"),
             "models": [TEI_MODEL], "forward_headers": ["x-sim-*"], **(backend or {})},
            {"name": "vllm-embed", "kind": "vllm", "family": "embed",
             "url": str(vllm_sim.make_url("/")).rstrip("/"), "models": [VLLM_MODEL]},
            policies={"tiers.toml": TIERS, "prices.toml": PRICES,
                      "requests.toml": requests_toml})
        return Stack(gw, tei_sim, vllm_sim, clean_redis.url)

    return start


def unpack(vector: str) -> list[float]:
    raw = base64.b64decode(vector)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


async def test_the_openai_client_against_tei(stack: StackFactory) -> None:
    s = await stack()
    key = await s.key("max", "acct-e")
    texts = ["The cat sat on the mat.", "A dog slept on the rug.", "The cat sat."]
    async with s.client(key) as ai:
        found = await ai.embeddings.create(model=TEI_MODEL, input=texts)  # base64 on the wire
        floats = await ai.embeddings.create(model=TEI_MODEL, input=texts[0],
                                            encoding_format="float")
        short = await ai.embeddings.create(model=TEI_MODEL, input=[[101, 7, 9, 102]],
                                           dimensions=64, encoding_format="float")
    assert [d.index for d in found.data] == [0, 1, 2]
    assert all(len(d.embedding) == 384 for d in found.data)
    assert floats.data[0].embedding == pytest.approx(found.data[0].embedding, abs=1e-6)
    assert len(short.data[0].embedding) == 64
    assert sum(x * x for x in short.data[0].embedding) == pytest.approx(1.0, abs=1e-4)
    # The simulator's vectors are sums of word directions: the texts that share words are nearer.
    a, b, c = (d.embedding for d in found.data)
    assert sum(x * y for x, y in zip(a, c, strict=True)) > sum(
        x * y for x, y in zip(a, b, strict=True))
    sent = await s.sent(s.tei)
    assert [r["path"] for r in sent] == ["/embed"] * 3
    assert sent[0]["body"] == {"inputs": texts, "normalize": True, "truncate": False}
    assert sent[2]["body"]["dimensions"] == 64 and sent[2]["body"]["inputs"] == [[101, 7, 9, 102]]
    # Charged the server's own token counts (its x-compute-tokens), at the prompt price.
    charges = await s.charges("acct-e")
    assert [c["prompt_tokens"] for c in charges] == [
        found.usage.prompt_tokens, floats.usage.prompt_tokens, short.usage.prompt_tokens]
    # Each text: its words, its full stop, [CLS] and [SEP].
    assert found.usage.prompt_tokens == sum(len(t.split()) + 3 for t in texts)
    assert short.usage.prompt_tokens == 4
    for charge, usage in zip(charges, (found.usage, floats.usage, short.usage), strict=True):
        assert charge["price"] == -(-usage.prompt_tokens * PER_1K // 1000)
        assert charge["route"] == "embed" and charge["model"] == TEI_MODEL


async def test_vllm_pooling_and_the_vector_encodings(stack: StackFactory) -> None:
    s = await stack()
    key = await s.key("max", "acct-v")
    async with s.client(key) as ai:
        packed = await ai.embeddings.create(model=VLLM_MODEL, input=["one two", "three"])
        plain = await ai.embeddings.create(model=VLLM_MODEL, input=["one two", "three"],
                                           encoding_format="float")
    for a, b in zip(packed.data, plain.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    sent = await s.sent(s.vllm)
    assert [r["path"] for r in sent] == ["/v1/embeddings"] * 2
    assert [r["body"]["encoding_format"] for r in sent] == ["base64", "float"]
    assert sent[0]["body"]["model"] == VLLM_MODEL
    status, raw = await s.post({"model": VLLM_MODEL, "input": "x", "encoding_format": "base64"},
                               key)
    assert status == 200 and isinstance(raw["data"][0]["embedding"], str)
    assert unpack(raw["data"][0]["embedding"]) == pytest.approx(
        (await s.post({"model": VLLM_MODEL, "input": "x"}, key))[1]["data"][0]["embedding"],
        abs=1e-6)
    charges = await s.charges("acct-v")
    assert [c["prompt_tokens"] for c in charges[:2]] == [packed.usage.prompt_tokens,
                                                         plain.usage.prompt_tokens]


async def test_inputs_beyond_a_servers_batch_go_in_batches(stack: StackFactory) -> None:
    s = await stack(tei={"max_client_batch_size": 8, "max_input_length": 64})
    # Nothing in backends.toml says 8: the prober read it from TEI's /info.
    tei = next(b for b in s.gateway.app[ROUTER].backends if b.name == "tei-a")
    assert (tei.batch_inputs, tei.max_model_len) == (8, {TEI_MODEL: 64})
    key = await s.key("max", "acct-b")
    texts = [f"text number {i}" for i in range(19)]
    async with s.client(key) as ai:
        whole = await ai.embeddings.create(model=TEI_MODEL, input=texts, encoding_format="float")
        one = await ai.embeddings.create(model=TEI_MODEL, input=texts[13],
                                         encoding_format="float")
    assert [d.index for d in whole.data] == list(range(19))
    assert whole.data[13].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
    sent = await s.sent(s.tei)
    assert [len(r["body"]["inputs"]) for r in sent] == [8, 8, 3, 1]
    assert whole.usage.prompt_tokens == sum(len(t.split()) + 2 for t in texts)


async def test_requests_that_are_not_one_are_refused_before_anything_is_sent(
        stack: StackFactory) -> None:
    s = await stack(requests_toml="[embed]\nmax_inputs = 4\n")
    key = await s.key("max", "acct-r")
    bad = [
        ({"model": TEI_MODEL, "input": ""}, ["body", "input"]),
        ({"model": TEI_MODEL, "input": []}, ["body", "input"]),
        ({"model": TEI_MODEL, "input": ["a", ""]}, ["body", "input", 1]),
        ({"model": TEI_MODEL, "input": ["a", 3]}, ["body", "input", 1]),
        ({"model": TEI_MODEL, "input": [[1, 2], [-1]]}, ["body", "input", 1]),
        ({"model": TEI_MODEL, "input": ["a"] * 5}, ["body", "input"]),
        ({"model": TEI_MODEL, "input": "a", "encoding_format": "int8"},
         ["body", "encoding_format"]),
        ({"model": TEI_MODEL, "input": "a", "dimensions": 0}, ["body", "dimensions"]),
        ({"model": TEI_MODEL, "input": "a", "extra": 1}, ["body", "extra"]),
        ({"input": "a"}, ["body", "model"]),
    ]
    for body, loc in bad:
        status, answer = await s.post(body, key)
        assert status == 422, (body, answer)
        assert loc in [d["loc"] for d in answer["detail"]], (body, answer)
    status, answer = await s.post({"model": "acme/nope", "input": "a"}, key)
    assert status == 404
    assert await s.sent(s.tei) == []
    assert await s.charges("acct-r") == []


async def test_an_input_the_server_refuses_costs_nothing(stack: StackFactory) -> None:
    s = await stack(tei={"max_input_length": 16})
    key = await s.key("max", "acct-l")
    status, answer = await s.post({"model": TEI_MODEL, "input": ["short", "word " * 40]}, key)
    assert status == 400, answer
    assert "must have less than 16 tokens" in answer["error"]["message"]
    charges = await s.charges("acct-l")
    assert [c["price"] for c in charges] == [0]  # the hold ended, nothing charged


async def test_tiers_decide_access_and_token_limits_count_input_tokens(
        stack: StackFactory) -> None:
    s = await stack()
    basic = await s.key("basic", "acct-basic")
    status, answer = await s.post({"model": TEI_MODEL, "input": "hello"}, basic)
    assert status == 403 and "embeddings" in answer["error"]["message"]
    pro = await s.key("pro", "acct-pro")  # 200 tokens a minute
    text = "word " * 30
    first, _ = await s.post({"model": TEI_MODEL, "input": text}, pro)  # holds 158, uses 32
    assert first == 200
    await settled(s.gateway)  # the server's count replaces the reservation
    second, _ = await s.post({"model": TEI_MODEL, "input": text}, pro)  # 32 + 158 fits
    assert second == 200
    await settled(s.gateway)
    third, answer = await s.post({"model": TEI_MODEL, "input": [text, text]}, pro)  # 64 + 316
    assert third == 429 and "tokens" in answer["error"]["message"]
    assert len(await s.sent(s.tei)) == 2


async def test_models_lists_the_embedding_models(stack: StackFactory) -> None:
    s = await stack()
    key = await s.key("max", "acct-m")
    async with aiohttp.ClientSession() as session, session.get(
            s.gateway.make_url("/v2/models"), headers={"X-API-Key": key}) as response:
        listed = {m["id"]: m for m in orjson.loads(await response.read())["data"]}
    for model in (TEI_MODEL, VLLM_MODEL):
        assert listed[model]["task_family"] == "embed"
        assert listed[model]["price"]["prompt_per_1k_tokens"] == PER_1K
        assert listed[model]["tiers"] == {"direct": ["pro", "max"]}
        assert listed[model]["healthy"] is True


async def test_the_dispatcher_keeps_a_server_within_its_slots(stack: StackFactory) -> None:
    """A TEI that refuses (429) a second input in flight, behind a backend of one slot: the
    requests wait in the gateway's queue for it, and none is refused."""
    s = await stack(tei={"max_concurrency": 1, "ttft_ms": 80}, backend={"max_concurrency": 1})
    key = await s.key("max", "acct-d")
    answers = await asyncio.gather(*(s.post({"model": TEI_MODEL, "input": f"text {i}"}, key)
                                     for i in range(4)))
    assert [status for status, _ in answers] == [200] * 4
    sent = await s.sent(s.tei)
    assert len(sent) == 4 and {r["outcome"] for r in sent} == {"completed"}
