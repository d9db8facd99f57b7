"""Embeddings in front of a REAL vLLM serving a tiny embedding model (serve-embed.sh: 256-dim,
last-token pooling, Matryoshka 32/64/128/256, max_model_len 512): the official `openai`
client's `embeddings.create` through the gateway, charged the engine's own token counts; and the
vLLM embeddings simulator (`simulate vllm --runner pooling`) compared with it request by
request, as a client (the gateway) sees them. Vectors and token counts differ by nature (a
random model and tokenizer against the simulators' word rule); statuses, error bodies, the
answer's shape, vector lengths and encodings must match."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from redis.asyncio import Redis

from proxy.credits.ledger import Ledger
from proxy.store.redis_process import RedisProcess
from tests.support.fidelity import shape
from tests.support.gateway import GatewayFactory, settled
from tests.support.real_engines import EMBED_SERVED, Replica, embed_backend
from tests.support.upstreams import SimulatorFactory
from tests.support.vllm_metrics import scrape

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

PER_1K = 50
PRICES = f"""
version = "real-embed-v1"
[models."{EMBED_SERVED}"]
prompt_per_1k_tokens = {PER_1K}
"""
LONG = "word " * 600  # over the replica's 512 tokens


async def post(base: str, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(
            base + path, data=orjson.dumps(body),
            headers={"Content-Type": "application/json"}) as response:
        raw = await response.read()
        return response.status, orjson.loads(raw) if raw else None


async def prompt_tokens_total(replica: Replica) -> float:
    text = await scrape(replica.url)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total{"))


async def test_the_openai_client_through_the_gateway(
        embedder: Replica, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    gw = await gateway(embed_backend(embedder), policies={"prices.toml": PRICES})
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    await ledger.credit("acct-test", 10**9, {"reason": "test"})
    texts = ["hello world", "the cat sat on the mat", "hello there world"]
    status, direct = await post(embedder.url, "/v1/embeddings",
                                {"model": EMBED_SERVED, "input": texts})
    assert status == 200
    status, direct_short = await post(embedder.url, "/v1/embeddings",
                                      {"model": EMBED_SERVED, "input": texts[0],
                                       "dimensions": 64})
    assert status == 200
    before = await prompt_tokens_total(embedder)
    async with openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")),
                                  api_key=gw.api_key,  # type: ignore[attr-defined]
                                  max_retries=0) as ai:
        packed = await ai.embeddings.create(model=EMBED_SERVED, input=texts)  # base64
        floats = await ai.embeddings.create(model=EMBED_SERVED, input=texts,
                                            encoding_format="float")
        short = await ai.embeddings.create(model=EMBED_SERVED, input=texts[0], dimensions=64)
        ids = await ai.embeddings.create(model=EMBED_SERVED, input=[[119, 79, 196], [5]])
        with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
            await ai.embeddings.create(model=EMBED_SERVED, input=["short", LONG])
    # The engine's vectors, exactly (base64 decoded by the client), in the inputs' order.
    for got in (packed, floats):
        for mine, theirs in zip(got.data, direct["data"], strict=True):
            assert mine.embedding == pytest.approx(theirs["embedding"], abs=1e-7)
        assert got.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert short.data[0].embedding == pytest.approx(direct_short["data"][0]["embedding"],
                                                    abs=1e-7)
    assert len(short.data[0].embedding) == 64 and ids.usage.prompt_tokens == 4
    # Charged what the engine counted (its own counter agrees); the refused one nothing.
    await settled(gw)
    charges = [e for e in await ledger.all_entries("acct-test") if e["type"] == "charge"]
    used = [r.usage.prompt_tokens for r in (packed, floats, short, ids)]
    assert [c.get("prompt_tokens", 0) for c in charges] == [*used, 0]
    assert [c["price"] for c in charges] == [-(-n * PER_1K // 1000) for n in used] + [0]
    assert await prompt_tokens_total(embedder) - before == sum(used)
    await redis.aclose()


# (request body, what must match: "all" the whole answer, "shape" its structure and lengths,
# "status" the status and the error's type only (pydantic's wording differs))
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("one text", {"model": EMBED_SERVED, "input": "hello world"}, "shape"),
    ("texts", {"model": EMBED_SERVED, "input": ["a b", "c", ""]}, "shape"),
    ("token ids", {"model": EMBED_SERVED, "input": [5, 6, 7]}, "shape"),
    ("token-id lists", {"model": EMBED_SERVED, "input": [[5, 6], [7]]}, "shape"),
    ("base64", {"model": EMBED_SERVED, "input": "hi", "encoding_format": "base64"}, "shape"),
    ("dimensions", {"model": EMBED_SERVED, "input": "hi", "dimensions": 64}, "shape"),
    ("no model", {"input": "hi"}, "shape"),
    ("user", {"model": EMBED_SERVED, "input": "hi", "user": "u-1"}, "shape"),
    ("dimensions out of range", {"model": EMBED_SERVED, "input": "hi", "dimensions": 1000},
     "all"),
    ("wrong model", {"model": "acme/nope", "input": "hi"}, "all"),
    ("empty list", {"model": EMBED_SERVED, "input": []}, "all"),
    ("an empty token list", {"model": EMBED_SERVED, "input": [[]]}, "all"),
    ("too long", {"model": EMBED_SERVED, "input": ["a", LONG]}, "all"),
    ("bad encoding", {"model": EMBED_SERVED, "input": "hi", "encoding_format": "int8"},
     "status"),
    ("no input", {"model": EMBED_SERVED}, "status"),
]


@pytest.mark.parametrize(("body", "match"), [(b, m) for _, b, m in CASES],
                         ids=[name for name, _, _ in CASES])
async def test_the_simulator_answers_as_vllm_does(
        embedder: Replica, simulator: SimulatorFactory, body: dict[str, Any],
        match: str) -> None:
    sim = await simulator("vllm", (EMBED_SERVED,), runner="pooling", embedding_size=256,
                          max_model_len=512)
    real_status, real = await post(embedder.url, "/v1/embeddings", body)
    sim_status, mine = await post(str(sim.make_url("/")).rstrip("/"), "/v1/embeddings", body)
    assert sim_status == real_status, (real, mine)
    if match == "all":
        assert mine == real
    elif match == "status":
        assert mine["error"]["type"] == real["error"]["type"]
    else:
        for answer in (real, mine):
            answer.pop("id"), answer.pop("created")
        assert shape(mine) == shape(real)
        assert [len(d["embedding"]) for d in mine["data"]] == \
            [len(d["embedding"]) for d in real["data"]]
        if body.get("encoding_format") == "base64":
            assert len(base64.b64decode(mine["data"][0]["embedding"])) == 4 * 256


async def test_chat_is_not_routed_on_either(embedder: Replica,
                                            simulator: SimulatorFactory) -> None:
    sim = await simulator("vllm", (EMBED_SERVED,), runner="pooling", embedding_size=256,
                          max_model_len=512)
    body = {"model": EMBED_SERVED, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/chat/completions", "/v1/completions"):
        real = await post(embedder.url, path, body)
        assert real == (404, {"detail": "Not Found"})
        assert await post(str(sim.make_url("/")).rstrip("/"), path, body) == real
