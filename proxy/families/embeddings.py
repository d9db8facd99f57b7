"""Embeddings on the request path: OpenAI's request -> the model's servers (vLLM's or OpenAI's
`/v1/embeddings`, text-embeddings-inference's `/embed`), in batches of what a server takes at
once -> OpenAI's answer, charged per input token the servers counted. The request's schema,
bodies and encodings are in proxy.families.embed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.config import Policies
from proxy.credits.pricing import Units
from proxy.errors import ErrorKind, GatewayError
from proxy.families import embed
from proxy.families.base import Answer, Ctx, Family, Job, parsed
from proxy.upstream import http1
from proxy.upstream.client import read_answer
from proxy.upstream.pool import Backend, Pool

TEI_BATCH = 32  # text-embeddings-inference's default --max-client-batch-size


class Embeddings(Family):
    name = "embed"

    def max_body_bytes(self, policies: Policies) -> int:
        return policies.requests.embed.max_body_bytes

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        emb: embed.Embeddings = parsed(embed.parse_embeddings, body,
                                       policies.requests.embed.max_inputs)
        return Job(emb, emb.req.model, "direct", False,
                   Units(prompt_tokens=embed.worst_tokens(emb.inputs)))

    def model(self, job: Job, policies: Policies) -> str | None:
        return job.model

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        emb: embed.Embeddings = job.request
        cap = ctx.policies.requests.embed.max_answer_bytes
        headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        sizes = [size for b in pool.backends if (size := _batch_size(b)) is not None]
        size = min(sizes) if sizes else None  # any server of the pool may get a batch
        vectors: list[Any] = []
        tokens = 0
        for inputs in embed.batches(emb.inputs, size):
            def body_for(backend: Backend, inputs: list[Any] = inputs) -> bytes:
                if backend.spec.kind == "tei":
                    return orjson.dumps(embed.tei_body(emb, inputs))
                return orjson.dumps(embed.openai_body(emb, inputs, pool.model))

            async def use(backend: Backend, upstream: http1.Response,
                          inputs: list[Any] = inputs) -> tuple[list[Any], int]:
                return _vectors(backend, upstream, await read_answer(upstream, cap),
                                emb, inputs)

            found, counted = await ctx.upstreams.call(
                pool, _path, body_for, headers, ctx.client_headers, use, ticket=ctx.ticket,
                early=ctx.early)
            vectors += found
            tokens += counted
        tokens = min(tokens, job.worst.prompt_tokens)  # never above the hold
        body = embed.answer_body(vectors, emb.req.model, tokens)
        return Answer(orjson.dumps(body), "application/json", Units(prompt_tokens=tokens))


def _path(backend: Backend) -> str:
    return embed.TEI_PATH if backend.spec.kind == "tei" else embed.EMBEDDINGS_PATH


def _batch_size(backend: Backend) -> int | None:
    """backends.toml's, else what the server said (TEI's /info), else TEI's default."""
    spec = backend.spec
    if spec.max_batch_inputs is not None:
        return spec.max_batch_inputs
    if backend.batch_inputs is not None:
        return backend.batch_inputs
    return TEI_BATCH if spec.kind == "tei" else None


def _vectors(backend: Backend, upstream: http1.Response, raw: bytes, emb: embed.Embeddings,
             inputs: list[Any]) -> tuple[list[Any], int]:
    """The vectors of one batch and the tokens the server counted for it (its bound when it
    names none: never a guess below what it used)."""
    try:
        answer = orjson.loads(raw)
        if backend.spec.kind == "tei":
            vectors = embed.tei_vectors(answer, len(inputs), emb.base64)
            tokens = _header_count(upstream.headers.get("x-compute-tokens"))
        else:
            vectors, tokens = embed.openai_vectors(answer, len(inputs), emb.base64)
    except (orjson.JSONDecodeError, embed.BadAnswer):
        raise GatewayError(ErrorKind.UPSTREAM_ERROR,
                           "the embedding server sent an unusable answer") from None
    return vectors, tokens if tokens is not None else embed.worst_tokens(inputs)


def _header_count(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


EMBEDDINGS = Embeddings()
