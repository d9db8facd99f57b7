"""The replicas' own traces, in the session's trace backend: a request that carries a
`traceparent` header is one `llm_request` span (kind SERVER) in that trace, the child of the span
the header names, with the request's id and token counts; one without is a trace of its own.
This is what a gateway's trace continues into (its client span's id goes upstream in
`traceparent`)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import aiohttp
import pytest

from tests.support.real_engines import SERVED, Engines
from tests.support.trace_backend import SpanRecord, TraceBackend

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]


async def chat(url: str, headers: dict[str, str]) -> dict[str, Any]:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 5, "temperature": 0}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


async def test_a_request_is_a_server_span_in_the_callers_trace(
        replicas: Engines, trace_backend: TraceBackend) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    answers = {answer["id"]: answer for answer in [
        await chat(replica.url, {"traceparent": f"00-{trace_id}-{parent_id}-01"})
        for replica in replicas.replicas]}
    spans = await asyncio.to_thread(trace_backend.trace, trace_id, timeout=20,
                                    names=["llm_request"] * len(answers))
    assert len(spans) == len(answers)  # one per request, and nothing else
    for span in spans:
        assert (span["trace_id"], span["parent_id"], span["kind"]) == (trace_id, parent_id,
                                                                       "SERVER")
        attributes = span["attributes"]
        usage = answers[attributes["gen_ai.request.id"]]["usage"]
        assert attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
        assert attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
        assert attributes["gen_ai.request.max_tokens"] == 5
        assert span["start_time"] <= span["end_time"]


async def test_a_request_without_traceparent_is_a_trace_of_its_own(
        replicas: Engines, trace_backend: TraceBackend) -> None:
    request_id = (await chat(replicas[0].url, {}))["id"]

    def spans_of_the_request() -> list[SpanRecord]:
        deadline = time.monotonic() + 20
        while True:
            found = [s for s in trace_backend.spans() if s["name"] == "llm_request"
                     and s["attributes"].get("gen_ai.request.id") == request_id]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    [span] = await asyncio.to_thread(spans_of_the_request)
    assert span["parent_id"] is None and span["kind"] == "SERVER"
