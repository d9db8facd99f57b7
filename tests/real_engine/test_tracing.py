"""Tracing through `serve` into a real vLLM: the replicas export their spans to the session's
trace backend (tests/real_engine/conftest.py), the gateway its own; one request is then one
trace holding the gateway's stages and vLLM's `llm_request` span, the child of the gateway's
call to it (the W3C traceparent the gateway sent)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import openai
import orjson
import pytest

from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key
from tests.support.fleet import Stack
from tests.support.real_engines import SERVED, Engines, backend
from tests.support.trace_backend import TraceBackend

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

ROUTE = "/v2/compat/v1/chat/completions"
PRICES = """
version = "real-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""
SKEW = timedelta(milliseconds=20)  # two processes' clocks, read at slightly different moments


def test_one_trace_holds_the_gateways_stages_and_vllms_own_span(
        replicas: Engines, tmp_path: Path, clean_redis: RedisProcess,
        trace_backend: TraceBackend) -> None:
    stack = Stack(tmp_path, [backend(r) for r in replicas.replicas], workers=2,
                  redis_url=clean_redis.url, policies={"prices.toml": PRICES},
                  gateway_extra={"access_log": "access.log"},
                  telemetry={"endpoint": trace_backend.otlp_url, "export_every_s": 0.2})
    try:
        stack.ready(timeout=60)
        key = asyncio.run(funded_key(clean_redis.url))
        with openai.OpenAI(base_url=f"{stack.url}/v2/compat/v1", api_key=key,
                           max_retries=0) as client:
            stream = client.chat.completions.create(
                model=SERVED, stream=True, max_tokens=16,
                messages=[{"role": "user", "content": "Say hello to the world."}])
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices)
        assert text
        log = stack.folder / "access.log"
        line: dict[str, object] = {}
        for _ in range(100):
            lines = [orjson.loads(x) for x in log.read_bytes().splitlines()] if log.exists() \
                else []
            found = [x for x in lines if x.get("route") == ROUTE]
            if found:
                line = found[0]
                break
            time.sleep(0.1)
        trace_id = str(line["trace_id"])
        call_name = f"chat {SERVED}"
        spans = trace_backend.trace(trace_id, timeout=30, names=[
            f"POST {ROUTE}", "auth", "admission", "engine slot", call_name, "settlement",
            "llm_request"])
    finally:
        stack.close()
    named = {span["name"]: span for span in spans}
    server, call, engine = named[f"POST {ROUTE}"], named[call_name], named["llm_request"]
    assert server["parent_id"] is None
    assert call["parent_id"] == server["span_id"]
    # vLLM's span is the child of the gateway's call to it, and lies within it.
    assert engine["parent_id"] == call["span_id"] and engine["trace_id"] == trace_id
    assert call["start_time"] - SKEW <= engine["start_time"]
    assert engine["end_time"] <= call["end_time"] + SKEW
    assert call["attributes"]["igw.backend"] == line["backend"]
    # The engine's counts and the gateway's settled usage are the same tokens.
    engine_attributes = engine["attributes"]
    assert engine_attributes["gen_ai.usage.completion_tokens"] == \
        server["attributes"]["gen_ai.usage.output_tokens"] == line["units"]["completion_tokens"]  # type: ignore[index]
    assert engine_attributes["gen_ai.usage.prompt_tokens"] == \
        server["attributes"]["gen_ai.usage.input_tokens"]
    assert engine_attributes["gen_ai.latency.time_to_first_token"] > 0
