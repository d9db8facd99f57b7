"""`simulate vllm` answers vLLM's `POST /tokenize` (issue 31: what a router may ask a worker),
counting by the simulator's own token rule: a chat request's `prompt_tokens` for the same
messages, `count_tokens` for a prompt. Shape as a real vLLM 0.32's (shared/real-engines)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from proxy.simulators.textgen import count_tokens, token_id
from tests.support.config_files import MODEL
from tests.support.upstreams import SimulatorFactory


async def post(sim: Any, path: str, body: object) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(
            sim.make_url(path), data=orjson.dumps(body)) as response:
        return response.status, orjson.loads(await response.read())


async def test_tokenize_counts_as_the_chat_usage_does(simulator: SimulatorFactory) -> None:
    sim = await simulator(max_model_len=1024)
    status, doc = await post(sim, "/tokenize", {"model": MODEL, "prompt": "Hello world, again!"})
    assert status == 200
    assert doc == {"count": 5, "max_model_len": 1024, "token_strs": None,
                   "tokens": [token_id(t) for t in ("Hello", "world", ",", "again", "!")]}
    assert doc["count"] == count_tokens("Hello world, again!")
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello there"}]
    status, doc = await post(sim, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and doc["count"] == len(doc["tokens"])
    status, chat = await post(sim, "/v1/chat/completions",
                              {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert status == 200 and chat["usage"]["prompt_tokens"] == doc["count"] == 4 + 4 + 4 + 2
    # The same prefix, the same leading ids (what prefix caching hashes).
    status, longer = await post(sim, "/tokenize", {"model": MODEL, "messages": [
        *messages, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Go"}]})
    assert longer["tokens"][:doc["count"]] == doc["tokens"] and longer["count"] > doc["count"]
    # `model` may be left out (the served model), as vLLM's.
    status, doc = await post(sim, "/tokenize", {"prompt": "one two"})
    assert status == 200 and doc["count"] == 2


async def test_tokenize_refuses_what_vllm_refuses(simulator: SimulatorFactory) -> None:
    sim = await simulator()
    status, doc = await post(sim, "/tokenize", {"model": "acme/nope", "prompt": "x"})
    assert status == 404 and doc["error"]["type"] == "NotFoundError"
    for body in ({"model": MODEL}, {"model": MODEL, "prompt": 3},
                 {"model": MODEL, "prompt": "x", "messages": []}, ["x"]):
        status, doc = await post(sim, "/tokenize", body)
        assert status == 400 and doc["error"]["code"] == 400, body
    # Tokenizing is not inference: no request is counted.
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/metrics")) as r:
        assert r.status == 200
        counted = [float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines()
                   if line.startswith(("vllm:request_success_total{",
                                       "vllm:prompt_tokens_total{"))]
        assert counted and sum(counted) == 0
