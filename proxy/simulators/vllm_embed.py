"""vLLM serving an embedding model (`vllm serve` of an embedder, or `--runner pooling`; here
`simulate vllm --runner pooling`): `POST /v1/embeddings` as vLLM 0.32 answers it
(shared/real-engines/vllm-embed-wire.md), on the same engine model as chat: the request's
inputs are one prefill that waits for a slot of `--max-num-seqs`, is counted in
`vllm:num_requests_running` / `_waiting`, and takes `--ttft-ms` plus its prefill.

- `input`: a text, a list of token ids, a list of texts or a list of token-id lists. A text
  counts the simulators' tokens (`textgen`) plus the EOS its tokenizer appends (so "" is one
  token); a token-id list its ids. `[]`, `[[]]` and an input over `--max-model-len` tokens
  get vLLM's 400s (the last always says "at least <max-model-len + 1>", as vLLM's does).
- `encoding_format`: float (default) or base64 (float32, little-endian). `dimensions`: the
  model is Matryoshka over any length in [1, `--embedding-size`] (the first values, made unit
  length again); outside it vLLM's 400.
- The answer: `{id: "embd-<hex, or the X-Request-Id>", object, created, model, data: [{index,
  object, embedding}], usage: {prompt_tokens, total_tokens, completion_tokens: 0, ..._details:
  null}}`; a wrong `model` is vLLM's 404 (`model` may be left out).
- `/v1/chat/completions` and `/v1/completions` are not routed: FastAPI's 404 `{"detail": "Not
  Found"}`.

Differences kept: vLLM runs each input of a request as its own engine request (so one batch of
five counts five in `vllm:num_requests_waiting`); here a request is one. `bytes` encodings,
`embed_dtype`, `endianness`, `use_activation`, `truncate_prompt_tokens` and chat-style
`messages` are not served (400).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from proxy.simulators.bodies import json_object
from proxy.simulators.errors import BadRequest, HttpError
from proxy.simulators.exchange import Exchange
from proxy.simulators.vectors import embed, input_tokens

EOS = "<|endoftext|>"
BUSY = ("The engine is currently busy and cannot accept new requests. Please try again later "
        "or on a different instance.")
_UNSERVED = ("embed_dtype", "endianness", "use_activation", "truncate_prompt_tokens", "messages")


def _inputs(value: object) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and not value:
        raise BadRequest("You must pass at least one prompt", "value")
    if isinstance(value, list) and all(_token_id(v) for v in value):
        return [value]
    if isinstance(value, list) and all(
            isinstance(v, str) or (isinstance(v, list) and all(map(_token_id, v)))
            for v in value):
        if any(v == [] for v in value):
            raise BadRequest("The decoder prompt cannot be empty", "value")
        return list(value)
    raise _pydantic("input: Input should be a valid string, a list of integers, a list of "
                    "strings or a list of lists of integers")


def _pydantic(fault: str) -> HttpError:
    """A request off vLLM's schema: its RequestValidationError answer (type "Bad Request"; the
    wording is shorter than pydantic's list over every request shape)."""
    return HttpError(400, f"1 validation error:\n  {fault}", "Bad Request")


def _token_id(value: object) -> bool:
    return type(value) is int and value >= 0


def _dimensions(body: dict[str, Any], model: str, size: int) -> int | None:
    dimensions = body.get("dimensions")
    if dimensions is None:
        return None
    if type(dimensions) is not int or not 1 <= dimensions <= size:
        raise BadRequest(f"Model {model!r} only supports dimensions in range [1, {size}], got "
                         f"{dimensions}.", "value")
    return dimensions


async def embeddings(ex: Exchange) -> web.StreamResponse:
    config, state = ex.config, ex.state
    body: dict[str, Any] = json_object(ex.record.body)
    model = body.get("model") or config.models[0]
    if model not in config.models:
        raise HttpError(404, f"The model `{model}` does not exist.", "NotFoundError")
    ex.model = config.models[0]
    for name in _UNSERVED:
        if name in body:
            raise BadRequest(f"`{name}` is not served by this simulator", "value", name)
    inputs = _inputs(body.get("input"))
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise _pydantic(f"encoding_format: Input should be 'float', 'base64', 'bytes' or "
                        f"'bytes_only' (input={fmt!r})")
    dimensions = _dimensions(body, model, config.embedding_size)
    tokens = [[*input_tokens(i), EOS] if isinstance(i, str) else input_tokens(i)
              for i in inputs]
    context = config.max_model_len
    if any(len(found) > context for found in tokens):
        # vLLM tokenizes with truncation at context + 1, so it says "at least" that.
        raise BadRequest(f"This model's maximum context length is {context} tokens. However, "
                         f"your prompt contains at least {context + 1} input tokens, which "
                         "exceeds this limit even without any output tokens. Please reduce "
                         "the length of the input prompt.", "value", "input_tokens",
                         context + 1)
    if state.full:
        state.rejected += 1
        raise HttpError(503, BUSY, "Service Unavailable")
    ex.prompt = [t for found in tokens for t in found]
    ex.prompt_tokens = len(ex.prompt)
    await ex.admit()  # a slot of the running batch, then the prefill
    await ex.pacer().step()
    if state.dead or config.fail_generation:
        raise HttpError(500, "simulated pooling failure", "InternalServerError")
    vectors = [embed(found, config.embedding_size, dimensions) for found in tokens]
    ex.first_token = time.monotonic()
    data = [{"index": i, "object": "embedding",
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
             if fmt == "base64" else v} for i, v in enumerate(vectors)]
    request_id = ex.request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
    answer = {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
              "model": model, "data": data,
              "usage": {"prompt_tokens": ex.prompt_tokens, "total_tokens": ex.prompt_tokens,
                        "completion_tokens": 0, "prompt_tokens_details": None,
                        "completion_tokens_details": None}}
    return web.Response(body=orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY),
                        content_type="application/json")


async def not_routed(_request: web.Request) -> web.Response:
    """FastAPI's 404 for a route a pooling model's server does not have."""
    return web.Response(status=404, body=b'{"detail":"Not Found"}',
                        content_type="application/json")
