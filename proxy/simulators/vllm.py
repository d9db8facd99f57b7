"""vLLM OpenAI-compatible server simulator (protocols.md §3), matched to a real vLLM 0.32.

Several `--model` names act like vLLM's `--served-model-name` aliases of one engine: each is
listed by /v1/models and accepted in requests, and metrics carry the first name, as vLLM's do.
Beyond `--max-num-seqs` running, or when the KV cache (`--num-gpu-blocks-override` blocks of
`--block-size`) has no room for a prompt, requests queue (`vllm:num_requests_waiting`);
beyond `--max-num-queued-reqs` in flight they get vLLM's 503 (no Retry-After); vLLM never
answers 429. The engine model (batch, queue, serial prefill, prefix cache) is `scheduler`.
The context (`--max-model-len`) bounds `max_tokens` (400 beyond it) and the prompt (400), and
a request's completion is cut where the context ends. `POST /_sim/engine-death` is `kill -9`
of the EngineCore: /health 503, requests 500 `EngineDeadError`, live streams end with the
error event, and the port closes (at the first request that meets the dead engine, or after
`death_close_s`), as the real API server exits. With `--kv-events-config` it publishes
vLLM's KV-cache events (`kv_events`): a request's `session_id` (body, `X-Session-ID` header or
`vllm_xargs`) is carried into them and, as in vLLM, is no part of a block's hash.

`tests/real_engine/test_fidelity.py` compares this simulator with a real vLLM 0.32 (CPU build)
request by request. Differences kept on purpose:

- Text and token counts: lorem-ipsum words and the simulator's regex token rule
  (`textgen`), not a model and its tokenizer; EOS comes at `--completion-tokens` (or
  `x-sim-tokens`), not by chance. Logprobs are stable fakes.
- Prefix cache: the prompt's full blocks are hashed over the simulator's tokens (chat
  template tokens included), so hits come in whole blocks of `--block-size` as vLLM's do,
  but only prompt blocks are cached (vLLM also caches a finished answer's blocks, which the
  next turn of a conversation can hit). `n` > 1 is one request to the scheduler (vLLM
  schedules n). Requests hit blocks of a request still in prefill, as when vLLM schedules
  them in the same step.
- Timing: prefills run one after another at `--prefill-ms-per-1k-tokens` and decoding at
  `--tokens-per-s` per request, whatever the batch (vLLM mixes chunked prefills into decode
  steps and slows down as the batch grows). Nothing is preempted: a batch that outgrows the
  KV cache while decoding only pins `vllm:kv_cache_usage_perc` at 1.
- A prompt over the context is judged by tokens only (vLLM first rejects a prompt of more
  characters than the context could hold, naming `input_text`); pydantic errors (missing
  `messages`, malformed JSON) are worded differently, with the same 400.
- Death is noticed at once (vLLM's /health may still say 200 for a moment), and live streams
  always get the error event (vLLM's may be cut instead when its server exits first).
- A full queue always refuses before the response starts; vLLM sometimes admits a stream and
  then refuses it in-band (200, a 503 error event) when the queue filled in between.
- /metrics serves the families a gateway reads, not all of vLLM's (no `_created` series, no
  `http_*`, `process_*` or per-phase histograms; `cache_config_info` has vLLM 0.32's labels,
  its own block size and block count, the rest as the captured engine's).
- `POST /tokenize` counts and names tokens by the simulator's rule (`textgen`): a `prompt`'s
  tokens, or `messages` framed as a chat request's prompt (its `count` is that request's
  `prompt_tokens`); ids are `textgen.token_id`'s stable fakes, `token_strs` is null.
- KV-cache events (`kv_events`): the blocks stored are the prompt's cacheable ones above, so
  none for an answer's blocks (vLLM sends a BlockStored, answer tokens included, whenever
  decoding fills a block) and one fewer than vLLM when a prompt ends on a block boundary
  (vLLM caches that block too, though the same prompt cannot hit it). Token ids are
  `textgen.token_id`'s fakes. Blocks are evicted in vLLM's order (least recently used, a
  request's last blocks first), but when the simulator's own accounting runs out of room
  rather than when vLLM's allocator reuses a block.
- Not served: `/v1/completions`, `/detokenize`, `/load`,
  `stream_options.continuous_usage_stats`, `--enable-request-id-headers`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import AsyncIterator, Mapping

import orjson
from aiohttp import web

from proxy.simulators.bodies import json_object, json_response, opt
from proxy.simulators.engine import (
    CONTENT_TYPE,
    FINISH_REASONS,
    QUEUE_REASONS,
    Exposition,
    by,
)
from proxy.simulators.errors import ENGINE_DEAD, ENGINE_DEAD_TYPE, BadRequest, HttpError
from proxy.simulators.exchange import Exchange
from proxy.simulators.kv_events import Publisher
from proxy.simulators.openai_chat import (
    ChatRequest,
    Dialect,
    JsonObj,
    StreamExtras,
    chat_handler,
    error_payloads,
)
from proxy.simulators.runtime import inference
from proxy.simulators.scheduler import EVENT_LABELS, EventLabels
from proxy.simulators.state import STATE
from proxy.simulators.textgen import (
    EOS,
    LENGTH,
    STOP_SEQUENCE,
    TOOL_CALLS,
    prompt_token_list,
    text_tokens,
    token_id,
)

VERSION = "0.32.0"
FINGERPRINT = f"vllm-{VERSION}-{random.getrandbits(32):08x}"
BUSY = ("The engine is currently busy and cannot accept new requests. Please try again later "
        "or on a different instance.")


def _headers(_ex: Exchange, generated: int | None) -> Mapping[str, str]:
    return {"Content-Type": "text/event-stream; charset=utf-8"} if generated is None else {}


def check(ex: Exchange, req: ChatRequest) -> int | None:
    """vLLM's checks before it queues a request; the completion limit within the context."""
    config, state = ex.config, ex.state
    EVENT_LABELS.set(event_labels(ex))  # the body is read first (a bad session_id: 400)
    context = config.max_model_len
    if req.max_tokens is not None and req.max_tokens > context:
        raise BadRequest(f"{req.cap_field}={req.max_tokens} cannot be greater than "
                         f"max_model_len={context}. Please request fewer output tokens.",
                         "value", req.cap_field, req.max_tokens)
    if ex.prompt_tokens > context:
        # vLLM tokenizes with truncation at context + 1, so it says "at least".
        raise BadRequest(f"This model's maximum context length is {context} tokens. However, "
                         f"your prompt contains at least {context + 1} input tokens, which "
                         "exceeds this limit even without any output tokens. Please reduce "
                         "the length of the input prompt.", "value", "input_tokens", context + 1)
    if req.priority != 0 and config.scheduling_policy != "priority":
        raise BadRequest(f"Got priority {req.priority} but Priority scheduling is not enabled.",
                         "value", "priority", req.priority)
    if state.full:
        state.rejected += 1
        raise HttpError(503, BUSY, "Service Unavailable")
    room = context - ex.prompt_tokens
    return room if req.max_tokens is None else min(req.max_tokens, room)


def event_labels(ex: Exchange) -> EventLabels:
    """What the request's KV-cache events carry, as vLLM 0.32 takes it: the session is the
    body's `session_id` (a string or null, else 400), else the `X-Session-ID` header, else
    `vllm_xargs.session_id`; `vllm_xargs.kv_cache_report_mode` "full" has the blocks it found
    cached reported too."""
    body = json_object(ex.record.body)
    xargs = body.get("vllm_xargs")
    xargs = xargs if isinstance(xargs, dict) else {}
    session = opt(body, "session_id", str) or ex.request.headers.get("X-Session-ID") or None
    if session is None and isinstance(xargs.get("session_id"), str):
        session = xargs["session_id"] or None
    return EventLabels(session, xargs.get("kv_cache_report_mode") == "full")


def usage_extra(ex: Exchange, whole: bool) -> JsonObj:
    """`prompt_tokens_details` (with --enable-prompt-tokens-details) as vLLM 0.32 shapes it."""
    details: JsonObj | None = None
    if ex.config.prompt_tokens_details:
        details = {"cached_tokens": ex.cached_tokens,
                   "created_cache_tokens": ex.created_cache_tokens}
        if whole:
            details["multimodal_tokens"] = None
    if not whole:  # stream usage chunks leave out what is unset
        return {} if details is None else {"prompt_tokens_details": details}
    return {"prompt_tokens_details": details, "completion_tokens_details": None}


VLLM_CHAT = Dialect(
    kind="vllm",
    sse_prefix=b"data: ",
    strict_model=True,
    fixed_id=None,
    system_fingerprint=None,  # not on every chunk: see stream_extras.last_chunk
    role_chunk=True,
    role_in_deltas=False,
    finish_chunk=frozenset({EOS, TOOL_CALLS}),  # length and stop end on the last token's chunk
    finish_names={EOS: "stop", STOP_SEQUENCE: "stop", LENGTH: "length", TOOL_CALLS: "tool_calls"},
    stop_reason=True,
    null_usage_in_chunks=False,  # chunks are serialised with unset fields dropped
    logprob_bytes=True,
    reasoning=True,
    tool_call_id=lambda: f"chatcmpl-tool-{random.getrandbits(128):032x}",
    tool_meta_every_fragment=False,
    tool_content_null=True,
    tool_function_extra={},
    message_extra={
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    },
    response_extra={
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    },
    usage_extra=usage_extra,
    tools_exclude_response_format=False,
    generation_failure=(500, ENGINE_DEAD, ENGINE_DEAD_TYPE),
    error_events=error_payloads(
        lambda m, _t: {
            "error": {"message": m, "type": "InternalServerError", "param": None, "code": 500}
        }
    ),
    headers=_headers,
    choice_extra={"token_ids": None, "routed_experts": None},
    stream_extras=StreamExtras(
        role_chunk={"prompt_token_ids": None, "prompt_text": None},
        choice={"token_ids": None},
        last_chunk={"system_fingerprint": FINGERPRINT},
    ),
    check=check,
)

_chat = chat_handler(VLLM_CHAT)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE].healthy else 503)


async def version(_request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


async def models(request: web.Request) -> web.Response:
    created = int(time.time())
    config = request.app[STATE].config

    def entry(model: str) -> dict[str, object]:
        permission = {
            "id": f"modelperm-{os.urandom(8).hex()}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": config.max_model_len,
            "permission": [permission],
        }

    return json_response({"object": "list", "data": [entry(m) for m in config.models]})


async def metrics(request: web.Request) -> web.Response:
    """prometheus_client's exposition of the families a gateway reads (vLLM 0.32's names)."""
    state = request.app[STATE]
    out = Exposition(state.config.models[0])
    out.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              state.running)
    out.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              state.waiting)
    engine = state.engine
    out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              engine.kv_usage())
    out.info("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
             cache_config(state.config.block_size, state.config.kv_cache_blocks))
    out.counter("vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.", engine.queries)
    out.counter("vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.", engine.hits)
    out.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                0)
    out.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                sum(state.prompt_tokens.values()))
    out.counter("vllm:prompt_tokens_cached_total",
                "Number of cached prompt tokens (local + external).", engine.hits)
    out.counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                sum(state.generation_tokens.values()))
    out.family("vllm:request_success_total", "counter",
               "Count of successfully processed requests.",
               by("finished_reason", FINISH_REASONS,
                  lambda reason: sum(n for (_m, r), n in state.finished.items() if r == reason)))
    out.family("vllm:admission_rejections_total", "counter",
               "Number of admission attempts rejected by a queue limit, by reason.",
               by("reason", QUEUE_REASONS,
                  lambda reason: state.rejected if reason == QUEUE_REASONS[0] else 0),
               engine=False)
    out.histogram("vllm:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", state.latency.ttft)
    out.histogram("vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", state.latency.e2e)
    out.histogram("vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request.", state.latency.prefill)
    out.histogram("vllm:request_prefill_kv_computed_tokens",
                  "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                  state.latency.computed)
    return web.Response(text=out.text(), headers={"Content-Type": CONTENT_TYPE})


def cache_config(block_size: int, blocks: int) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels as vLLM 0.32 writes them (shared/real-engines), with
    this simulator's cache: what a router reads is `num_gpu_blocks` x `block_size`."""
    return {
        "_block_size_resolved": "True", "block_size": str(block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.92", "hash_block_size": "None",
        "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None", "kv_cache_max_concurrency": "1024.0",
        "kv_cache_memory_bytes": "1073741824", "kv_cache_size_tokens": str(block_size * blocks),
        "kv_offloading_backend": "native", "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None", "num_gpu_blocks": str(blocks),
        "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "False",
    }


def _bad_request(message: str, status: int = 400, kind: str = "BadRequestError"
                 ) -> web.Response:
    return json_response({"error": {"message": message, "type": kind, "param": None,
                                    "code": status}}, status=status)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `POST /tokenize`: {"model", "prompt"} or {"model", "messages"} -> {"count",
    "max_model_len", "tokens", "token_strs": null}, by the simulator's own tokens (the ones
    a chat request's `prompt_tokens` and prefix cache count)."""
    config = request.app[STATE].config
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _bad_request(f"Invalid JSON: {exc}")
    if not isinstance(body, dict):
        return _bad_request("Input should be a valid dictionary")
    model = body.get("model") or config.models[0]
    if model not in config.models:
        return _bad_request(f"The model `{model}` does not exist.", 404, "NotFoundError")
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, str) and messages is None:
        tokens = text_tokens(prompt)
    elif isinstance(messages, list) and prompt is None and all(
            isinstance(m, dict) for m in messages):
        tokens = prompt_token_list(messages)
    else:
        return _bad_request("Either `prompt` (a string) or `messages` (a list of messages) "
                            "is required")
    return json_response({"count": len(tokens), "max_model_len": config.max_model_len,
                          "tokens": [token_id(t) for t in tokens], "token_strs": None})


KV_EVENTS = web.AppKey("kv_events", Publisher)


async def _publish(app: web.Application) -> AsyncIterator[None]:
    """The KV-cache events' socket, open while the server runs."""
    publisher, engine = app[KV_EVENTS], app[STATE].engine
    publisher.open()
    engine.on_events = publisher.publish
    yield
    engine.on_events = None
    publisher.close()


async def engine_death(request: web.Request) -> web.Response:
    request.app[STATE].die()
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    if app[STATE].config.runner == "pooling":  # an embedding model: no chat
        from proxy.simulators import vllm_embed  # numpy (~0.1 s): loaded by this runner only

        app.router.add_post("/v1/embeddings", inference(vllm_embed.embeddings))
        app.router.add_post("/v1/chat/completions", vllm_embed.not_routed)
        app.router.add_post("/v1/completions", vllm_embed.not_routed)
    else:
        app.router.add_post("/v1/chat/completions", inference(_chat))
        config = app[STATE].config
        if config.kv_events is not None:
            app[KV_EVENTS] = Publisher(config.kv_events, config.block_size)
            app.cleanup_ctx.append(_publish)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/_sim/engine-death", engine_death)
