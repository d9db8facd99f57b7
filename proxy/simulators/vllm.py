"""vLLM OpenAI-compatible server simulator (protocols.md §3).

Several `--model` names act like vLLM's `--served-model-name` aliases of one engine: each is
listed by /v1/models and accepted in requests, and metrics carry the first name, as vLLM's do.
Excess load queues (visible as `vllm:num_requests_waiting`); vLLM never answers 429.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping

from aiohttp import web

from proxy.simulators.openai_chat import Dialect, chat_handler, error_payloads
from proxy.simulators.runtime import STATE, Exchange, inference, json_response
from proxy.simulators.textgen import EOS, LENGTH, STOP_SEQUENCE, TOOL_CALLS

VERSION = "0.11.0"
MAX_MODEL_LEN = 32768


def _headers(_ex: Exchange, generated: int | None) -> Mapping[str, str]:
    return {"Content-Type": "text/event-stream; charset=utf-8"} if generated is None else {}


VLLM_CHAT = Dialect(
    kind="vllm",
    sse_prefix=b"data: ",
    strict_model=True,
    fixed_id=None,
    system_fingerprint=None,
    role_chunk=True,
    role_in_deltas=False,
    finish_chunk=True,
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
        "tool_calls": [],
        "reasoning": None,
    },
    response_extra={
        "service_tier": None,
        "system_fingerprint": None,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    },
    usage_extra={"prompt_tokens_details": None},
    tools_exclude_response_format=False,
    generation_failure=(
        500,
        "EngineCore encountered an issue. See stack trace for the root cause.",
        "InternalServerError",
    ),
    error_events=error_payloads(
        lambda m, _t: {
            "error": {"message": m, "type": "InternalServerError", "param": None, "code": 500}
        }
    ),
    headers=_headers,
)

_chat = chat_handler(VLLM_CHAT)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE].healthy else 503)


async def version(_request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


async def models(request: web.Request) -> web.Response:
    created = int(time.time())

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
            "max_model_len": MAX_MODEL_LEN,
            "permission": [permission],
        }

    return json_response(
        {"object": "list", "data": [entry(m) for m in request.app[STATE].config.models]}
    )


async def metrics(request: web.Request) -> web.Response:
    """prometheus_client exposition: counters end in `_total`, values are floats."""
    state = request.app[STATE]
    labels = f'engine="0",model_name="{state.config.models[0]}"'
    lines: list[str] = []

    def metric(name: str, kind: str, samples: Mapping[str, float]) -> None:
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{extra}{labels}}} {float(v)}" for extra, v in samples.items())

    metric("vllm:num_requests_running", "gauge", {"": state.running})
    metric("vllm:num_requests_waiting", "gauge", {"": state.waiting})
    metric("vllm:kv_cache_usage_perc", "gauge", {"": 0.0})
    metric("vllm:prompt_tokens_total", "counter", {"": sum(state.prompt_tokens.values())})
    metric("vllm:generation_tokens_total", "counter", {"": sum(state.generation_tokens.values())})
    reasons = {
        f'finished_reason="{reason}",': sum(
            n for (_model, r), n in state.finished.items() if r == reason
        )
        for reason in ("stop", "length", "abort")
    }
    metric("vllm:request_success_total", "counter", reasons)
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", inference(_chat))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
