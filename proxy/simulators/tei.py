"""text-embeddings-inference (TEI 1.9) simulator: `POST /embed`, its OpenAI route
`POST /v1/embeddings` (also `/embeddings`), `/info`, `/health`, `/metrics`, `/tokenize`, as
TEI's router writes them (shared/tei-wire.md, read from TEI's source).

- `inputs`: a text, a list of token ids (one input), or a list of either (a batch, at most
  `--max-client-batch-size`: 422 beyond). An empty text or `[]`: 400 `Empty`. `truncate`
  (default: the server's `--auto-truncate`, on) cuts an input at `--max-input-length` tokens;
  with `truncate: false` a longer one is a 422. `dimensions` keeps the first values, then
  `normalize` (default true) makes the vector unit length.
- Tokens: the simulators' rule (`textgen`) plus [CLS] and [SEP] for a text; a token-id list
  counts its ids. Vectors: `vectors.embed` (texts that share words point alike).
- Concurrency: `--max-concurrent-requests` permits counted in inputs, taken at once or 429
  `Model is overloaded` (TEI never waits for one); `--max-batch-size` requests are processed
  at a time (`--ttft-ms` plus `--prefill-ms-per-1k-tokens`, over `--speed`), the others wait,
  their inputs counted in `te_queue_size`.
- Errors: `{"error", "error_type"}` with PascalCase types (Empty 400, Validation 422,
  Overloaded 429, Backend 424, Unhealthy 503); the OpenAI route's are flat `{"message",
  "code", "type"}`. Bodies that are not JSON, or JSON of the wrong shape, get axum's plain
  text (415, 400, 422), as TEI's do. Headers `x-compute-*` on success only.

Not served: `/embed_all`, `/embed_sparse`, `/rerank`, `/predict`, `/decode`, `prompt_name`
(422: no prompts configured), the separate Prometheus port.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from proxy.simulators.errors import HttpError
from proxy.simulators.exchange import Exchange
from proxy.simulators.faults import pause
from proxy.simulators.runtime import Handler, inference
from proxy.simulators.state import STATE
from proxy.simulators.textgen import token_id
from proxy.simulators.vectors import embed, input_tokens

VERSION = "1.9.3"
PAYLOAD_LIMIT = 2_000_000  # --payload-limit
SPECIAL_TOKENS = 2  # [CLS] ... [SEP]
_TYPES = {400: "Empty", 422: "Validation", 424: "Backend", 429: "Overloaded", 503: "Unhealthy"}


@dataclass
class Tei:
    """What the router counts beyond the shared state: permits (inputs) and the queue."""

    batch: asyncio.Semaphore
    inputs_in_flight: int = 0
    queued_inputs: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # te_* counters, by series


TEI = web.AppKey("tei", Tei)


class Plain(Exception):
    """axum's own refusal: a status and a text/plain body."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


def _error_type(exc: HttpError) -> str:
    """TEI's PascalCase type: the error's own, else its status's (a simulated x-sim-status)."""
    own = exc.error_type
    return own if own is not None and own in _TYPES.values() else _TYPES.get(exc.status,
                                                                               "Backend")


def _native_error(exc: HttpError) -> web.Response:
    return _json({"error": exc.message, "error_type": _error_type(exc)}, exc.status)


def _openai_error(exc: HttpError) -> web.Response:
    return _json({"message": exc.message, "code": exc.status, "type": _error_type(exc)},
                 exc.status)


def _json(body: object, status: int = 200) -> web.Response:
    """serde_json's compact JSON."""
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _count(app: web.Application, series: str, n: int = 1) -> None:
    counts = app[TEI].counts
    counts[series] = counts.get(series, 0) + n


def _body(ex: Exchange) -> dict[str, Any]:
    """The JSON object, or axum's plain-text refusal."""
    request = ex.request
    if len(ex.record.body) > PAYLOAD_LIMIT:
        raise Plain(413, "Failed to buffer the request body: length limit exceeded")
    media = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise Plain(415, "Expected request with `Content-Type: application/json`")
    try:
        body = orjson.loads(ex.record.body)
    except orjson.JSONDecodeError as exc:
        raise Plain(400, f"Failed to parse the request body as JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Plain(422, "Failed to deserialize the JSON body into the target type: invalid "
                         "type: expected struct EmbedRequest at line 1 column 1")
    return body


def _shape(message: str) -> Plain:
    return Plain(422, f"Failed to deserialize the JSON body into the target type: {message}")


def _inputs(value: object, name: str) -> tuple[list[str | list[int]], bool]:
    """TEI's untagged `Input`: (inputs, whether it was a batch)."""
    if isinstance(value, str):
        return [value], False
    if isinstance(value, list):
        if all(_token_id(v) for v in value):
            return [value], False  # [] too: an empty single input
        items: list[str | list[int]] = []
        for item in value:
            if isinstance(item, str) or (isinstance(item, list) and all(map(_token_id, item))):
                items.append(item)
            else:
                break
        else:
            return items, True
    raise _shape(f"{name}: data did not match any variant of untagged enum Input")


def _token_id(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**32


@dataclass(frozen=True, slots=True)
class Job:
    inputs: list[str | list[int]]
    batch: bool
    truncate: bool
    normalize: bool
    dimensions: int | None


def _job(body: dict[str, Any], name: str) -> Job:
    if name not in body:
        raise _shape(f"missing field `{name}`")
    inputs, batch = _inputs(body[name], name)
    truncate, norm, dims = body.get("truncate"), body.get("normalize", True), \
        body.get("dimensions")
    if truncate is not None and not isinstance(truncate, bool):
        raise _shape("truncate: invalid type: expected a boolean")
    if not isinstance(norm, bool):
        raise _shape("normalize: invalid type: expected a boolean")
    if dims is not None and not (type(dims) is int and dims >= 0):
        raise _shape("dimensions: invalid type: expected usize")
    if body.get("prompt_name") is not None:
        raise HttpError(422, "Input validation error: `default-prompt-name` is set to "
                        f"`{body['prompt_name']}` but no prompts were found in the Sentence "
                        "Transformers configuration", "Validation")
    return Job(inputs, batch, True if truncate is None else truncate, norm, dims)


def _check(ex: Exchange, job: Job) -> list[list[str]]:
    """TEI's validation, in its order; each input's tokens (specials included)."""
    config = ex.config
    if job.batch and len(job.inputs) > config.max_client_batch_size:
        raise HttpError(422, f"batch size {len(job.inputs)} > maximum allowed batch size "
                        f"{config.max_client_batch_size}", "Validation")
    if job.batch and not job.inputs:
        raise HttpError(400, "`inputs` cannot be empty", "Empty")
    if job.dimensions is not None:
        if job.dimensions == 0:
            raise HttpError(422, "Input validation error: `dimensions` should be positive",
                            "Validation")
        if job.dimensions > config.embedding_size:
            raise HttpError(422, "Input validation error: `dimensions` should be smaller than "
                            "the maximum embedding dimension.", "Validation")
    limit = config.max_input_length
    found = []
    for item in job.inputs:
        if not item:
            raise HttpError(400, "Input validation error: `inputs` cannot be empty", "Empty")
        tokens = input_tokens(item)
        if isinstance(item, str):
            tokens = ["[CLS]", *tokens, "[SEP]"]
        if len(tokens) > limit:
            if not job.truncate:
                raise HttpError(422, f"Input validation error: `inputs` must have less than "
                                f"{limit} tokens. Given: {len(tokens)}", "Validation")
            tokens = tokens[:limit]
        found.append(tokens)
    return found


async def _run(ex: Exchange, job: Job) -> tuple[list[np.ndarray], dict[str, str]]:
    """Validated, admitted (permits), processed in its turn: the vectors and x-compute-*."""
    app, config = ex.request.app, ex.config
    tei = app[TEI]
    _count(app, f'te_request_count{{method="{"batch" if job.batch else "single"}"}}')
    tokens = _check(ex, job)
    ex.model = config.models[0]
    ex.prompt_tokens = sum(map(len, tokens))
    n = len(tokens)
    if tei.inputs_in_flight + n > config.max_concurrency:
        _count(app, 'te_request_failure{err="overloaded"}')
        raise HttpError(429, "Model is overloaded", "Overloaded")
    _count(app, "te_embed_count", n)
    began = time.monotonic()
    tei.inputs_in_flight += n
    tei.queued_inputs += n
    queued = True
    try:
        async with tei.batch:
            tei.queued_inputs -= n
            queued = False
            waited = time.monotonic() - began
            work = config.ttft_s + config.prefill_s_per_token * ex.prompt_tokens
            if work > 0:
                await pause(ex.request, work)
            if not ex.state.healthy or config.fail_generation:
                _count(app, 'te_request_failure{err="inference"}')
                raise HttpError(424, "Backend error: simulated inference failure", "Backend")
    finally:
        tei.inputs_in_flight -= n
        if queued:
            tei.queued_inputs -= n
    vectors = [embed(t, config.embedding_size, job.dimensions, job.normalize) for t in tokens]
    ex.first_token = time.monotonic()
    _count(app, f'te_request_success{{method="{"batch" if job.batch else "single"}"}}')
    _count(app, "te_embed_success", n)
    total = round((time.monotonic() - began) * 1000)
    inference_ms = round((time.monotonic() - began - waited) * 1000)
    characters = sum(len(item) for item in job.inputs)
    headers = {"x-compute-type": "gpu+optimized", "x-compute-time": str(total),
               "x-compute-characters": str(characters), "x-compute-tokens": str(ex.prompt_tokens),
               "x-total-time": str(total), "x-tokenization-time": "0",
               "x-queue-time": str(round(waited * 1000)), "x-inference-time": str(inference_ms)}
    return vectors, headers


def _plain(handler: Handler) -> Handler:
    """axum's refusals (`Plain`) as its plain-text answers."""

    async def route(ex: Exchange) -> web.StreamResponse:
        try:
            return await handler(ex)
        except Plain as exc:
            return web.Response(status=exc.status, text=exc.text)

    return route


@_plain
async def embed_route(ex: Exchange) -> web.StreamResponse:
    job = _job(_body(ex), "inputs")
    vectors, headers = await _run(ex, job)
    body = orjson.dumps(vectors, option=orjson.OPT_SERIALIZE_NUMPY)
    return web.Response(body=body, headers={**headers, "Content-Type": "application/json"})


@_plain
async def openai_route(ex: Exchange) -> web.StreamResponse:
    body = _body(ex)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise _shape("encoding_format: unknown variant, expected `float` or `base64`")
    # Truncation is the server's setting and vectors are always unit length on this route.
    job = _job({name: body[name] for name in ("input", "dimensions") if name in body}, "input")
    vectors, headers = await _run(ex, job)
    data = [{"object": "embedding",
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
             if fmt == "base64" else v, "index": i} for i, v in enumerate(vectors)]
    answer = {"object": "list", "data": data, "model": ex.config.models[0],
              "usage": {"prompt_tokens": ex.prompt_tokens, "total_tokens": ex.prompt_tokens}}
    return web.Response(body=orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY),
                        headers={**headers, "Content-Type": "application/json"})


async def tokenize(request: web.Request) -> web.Response:
    """`POST /tokenize`: each text's tokens, [CLS] and [SEP] included, with byte offsets."""
    try:
        body = orjson.loads(await request.read())
        inputs = body["inputs"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return web.Response(status=422, text="Failed to deserialize the JSON body into the "
                                             "target type: missing field `inputs`")
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        return web.Response(status=422, text="Failed to deserialize the JSON body into the "
                                             "target type: inputs: data did not match any "
                                             "variant of untagged enum EncodingInput")
    if not texts:
        return _native_error(HttpError(400, "`inputs` cannot be empty", "Empty"))
    answer = []
    for text in texts:
        tokens: list[dict[str, Any]] = [{"id": 101, "text": "[CLS]", "special": True,
                                         "start": None, "stop": None}]
        offset = 0
        for token in input_tokens(text):
            at = text.find(token.strip(), offset) if token.strip() else offset
            start = len(text[:max(at, 0)].encode())
            offset = max(at, 0) + len(token.strip())
            tokens.append({"id": token_id(token), "text": token.strip(),
                           "special": False, "start": start,
                           "stop": start + len(token.strip().encode())})
        tokens.append({"id": 102, "text": "[SEP]", "special": True, "start": None,
                       "stop": None})
        answer.append(tokens)
    return _json(answer)


async def info(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    return web.Response(body=orjson.dumps({
        "model_id": config.models[0], "model_sha": None, "model_dtype": "float32",
        "served_model_name": config.models[0],
        "model_type": {"embedding": {"pooling": "cls"}},
        "max_concurrent_requests": config.max_concurrency,
        "max_input_length": config.max_input_length, "max_batch_tokens": 16384,
        "max_batch_requests": None, "max_client_batch_size": config.max_client_batch_size,
        "auto_truncate": True, "tokenization_workers": 1, "version": VERSION, "sha": None,
        "docker_label": None}), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    if request.app[STATE].healthy:
        return web.Response(status=200)
    return _native_error(HttpError(503, "unhealthy", "Unhealthy"))


async def metrics(request: web.Request) -> web.Response:
    """metrics-exporter-prometheus's text: `# TYPE` lines, no HELP, no `_total` suffix."""
    tei = request.app[TEI]
    families: dict[str, list[str]] = {}
    for series, value in sorted(tei.counts.items()):
        families.setdefault(series.partition("{")[0], []).append(f"{series} {value}")
    lines = []
    for name, samples in families.items():
        lines += [f"# TYPE {name} counter", *samples, ""]
    lines += ["# TYPE te_queue_size gauge", f"te_queue_size {tei.queued_inputs}", ""]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def add_routes(app: web.Application) -> None:
    app[TEI] = Tei(asyncio.Semaphore(app[STATE].config.batch_size))
    native = inference(embed_route, errors=_native_error)
    openai = inference(openai_route, errors=_openai_error)
    app.router.add_post("/embed", native)
    app.router.add_post("/v1/embeddings", openai)
    app.router.add_post("/embeddings", openai)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/info", info)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/metrics", metrics)
