"""The embedding simulators: text-embeddings-inference (`simulate tei`) as TEI 1.9's router
answers (shared/tei-wire.md, read from its source: no TEI runs here), and vLLM's `--runner
pooling` beside its chat routes (compared with a real vLLM in tests/real_engine)."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import pytest
from aiohttp.test_utils import TestClient

from proxy.simulators import SimConfig, build_app

MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]


async def tei(aiohttp_client: MakeClient, **options: Any) -> TestClient[Any, Any]:
    return await aiohttp_client(build_app("tei", SimConfig(models=("acme/bge",), **options)))


async def post(client: TestClient[Any, Any], path: str, body: Any
               ) -> tuple[int, dict[str, str], Any]:
    response = await client.post(path, data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    raw = await response.read()
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = raw.decode()
    return response.status, dict(response.headers), parsed


async def test_tei_embed_answers_vectors_and_compute_headers(
        aiohttp_client: MakeClient) -> None:
    client = await tei(aiohttp_client)
    status, headers, vectors = await post(client, "/embed", {"inputs": "Hello, world"})
    assert status == 200 and len(vectors) == 1 and len(vectors[0]) == 384  # [[...]], always
    assert abs(np.linalg.norm(vectors[0]) - 1) < 1e-6
    assert headers["x-compute-type"] == "gpu+optimized"
    assert headers["x-compute-tokens"] == "5"  # [CLS] Hello , world [SEP]
    assert headers["x-compute-characters"] == "12"
    for name in ("x-compute-time", "x-total-time", "x-tokenization-time", "x-queue-time",
                 "x-inference-time"):
        assert headers[name].isdigit()
    status, _, batch = await post(client, "/embed", {"inputs": ["Hello, world", [101, 7, 102]],
                                                     "dimensions": 16, "normalize": False})
    assert status == 200 and [len(v) for v in batch] == [16, 16]
    # Cut to `dimensions` first, then (normalize: false) left as it is: the unit vector's
    # first values, scaled.
    ratio = np.array(batch[0]) / np.array(vectors[0][:16])
    assert np.allclose(ratio, ratio[0], rtol=1e-4) and abs(np.linalg.norm(batch[0]) - 1) > 1e-3


async def test_tei_openai_route(aiohttp_client: MakeClient) -> None:
    client = await tei(aiohttp_client)
    status, _, answer = await post(client, "/v1/embeddings",
                                   {"input": ["a b", "c"], "model": "ignored",
                                    "encoding_format": "base64"})
    assert status == 200
    assert list(answer) == ["object", "data", "model", "usage"]
    assert answer["model"] == "acme/bge"  # the served name, never the request's
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    raw = base64.b64decode(answer["data"][0]["embedding"])
    _, _, native = await post(client, "/embed", {"inputs": "a b"})
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(native[0], abs=1e-8)
    status, _, error = await post(client, "/embeddings", {"input": [""]})
    assert (status, error) == (400, {"message": "Input validation error: `inputs` cannot be "
                                                "empty", "code": 400, "type": "Empty"})


async def test_tei_refusals_in_its_words(aiohttp_client: MakeClient) -> None:
    client = await tei(aiohttp_client, max_client_batch_size=2, max_input_length=8)
    cases: list[tuple[Any, int, Any]] = [
        ({"inputs": ["a", "b", "c"]}, 422,
         {"error": "batch size 3 > maximum allowed batch size 2", "error_type": "Validation"}),
        ({"inputs": ""}, 400,
         {"error": "Input validation error: `inputs` cannot be empty", "error_type": "Empty"}),
        ({"inputs": []}, 400,
         {"error": "Input validation error: `inputs` cannot be empty", "error_type": "Empty"}),
        ({"inputs": "one two three four five six seven", "truncate": False}, 422,
         {"error": "Input validation error: `inputs` must have less than 8 tokens. Given: 9",
          "error_type": "Validation"}),
        ({"inputs": "a", "dimensions": 0}, 422,
         {"error": "Input validation error: `dimensions` should be positive",
          "error_type": "Validation"}),
        ({"inputs": "a", "dimensions": 385}, 422,
         {"error": "Input validation error: `dimensions` should be smaller than the maximum "
                   "embedding dimension.", "error_type": "Validation"}),
    ]
    for body, status, error in cases:
        assert (await post(client, "/embed", body))[::2] == (status, error), body
    # Truncation is on by default: the same long text is cut at 8 tokens, not refused.
    _, headers, _ = await post(client, "/embed", {"inputs": "one two three four five six seven"})
    assert headers["x-compute-tokens"] == "8"
    # axum's own refusals are plain text.
    response = await client.post("/embed", data=b'{"inputs": "a"}')
    assert (response.status, await response.text()) == (
        415, "Expected request with `Content-Type: application/json`")
    status, _, text = await post(client, "/embed", {"nope": 1})
    assert status == 422 and text.endswith("missing field `inputs`")
    status, _, text = await post(client, "/embed", {"inputs": 5})
    assert status == 422 and "untagged enum Input" in text


async def test_tei_permits_count_inputs_and_refuse_at_once(aiohttp_client: MakeClient) -> None:
    client = await tei(aiohttp_client, max_concurrency=3, max_batch_size=1, ttft_ms=300)
    first = asyncio.ensure_future(post(client, "/embed", {"inputs": ["a", "b"]}))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(post(client, "/embed", {"inputs": "c"}))  # waits its turn
    await asyncio.sleep(0.05)
    metrics = await (await client.get("/metrics")).text()
    assert "te_queue_size 1\n" in metrics and "# HELP" not in metrics
    refused = await post(client, "/embed", {"inputs": "d"})  # 3 inputs in flight already
    assert refused[::2] == (429, {"error": "Model is overloaded", "error_type": "Overloaded"})
    assert (await first)[0] == 200 and (await second)[0] == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'te_request_failure{err="overloaded"} 1' in metrics
    assert "te_embed_success 3" in metrics and "te_queue_size 0\n" in metrics


async def test_tei_info_health_and_tokenize(aiohttp_client: MakeClient) -> None:
    client = await tei(aiohttp_client, max_client_batch_size=16)
    info = await (await client.get("/info")).json()
    assert info["max_client_batch_size"] == 16 and info["max_input_length"] == 512
    assert info["model_type"] == {"embedding": {"pooling": "cls"}}
    health = await client.get("/health")
    assert health.status == 200 and await health.read() == b""
    await client.post("/_sim/health", json={"healthy": False})
    assert (await client.get("/health")).status == 503
    _, _, tokens = await post(client, "/tokenize", {"inputs": "héllo you"})
    assert [t["text"] for t in tokens[0]] == ["[CLS]", "héllo", "you", "[SEP]"]
    assert [(t["start"], t["stop"]) for t in tokens[0]] == [(None, None), (0, 6), (7, 10),
                                                            (None, None)]


async def test_vllm_pooling_serves_embeddings_not_chat(aiohttp_client: MakeClient) -> None:
    client = await aiohttp_client(build_app("vllm", SimConfig(
        models=("acme/e5",), runner="pooling", embedding_size=32, max_model_len=16)))
    response = await client.post("/v1/embeddings", json={"input": ["a b", [5, 6]]},
                                 headers={"X-Request-Id": "r-1"})
    answer = await response.json()
    assert response.status == 200 and answer["id"] == "embd-r-1"
    assert answer["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0,
                               "prompt_tokens_details": None, "completion_tokens_details": None}
    assert [len(d["embedding"]) for d in answer["data"]] == [32, 32]
    short = await (await client.post("/v1/embeddings", json={"input": "a", "dimensions": 8})
                   ).json()
    assert len(short["data"][0]["embedding"]) == 8
    long = await client.post("/v1/embeddings", json={"input": "w " * 20})
    assert long.status == 400
    assert (await long.json())["error"]["param"] == "input_tokens"
    chat = await client.post("/v1/chat/completions", json={"messages": []})
    assert (chat.status, await chat.json()) == (404, {"detail": "Not Found"})
    metrics = await (await client.get("/metrics")).text()
    assert "vllm:prompt_tokens_total" in metrics
