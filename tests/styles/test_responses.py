"""The Responses API (`POST /v2/compat/v1/responses`) through the gateway, called with the
official OpenAI client as its users call it: plain, streamed (the exact named-event sequence),
with function tools both ways, items translated into the chat the engine gets; refused where
the gateway cannot honour it; charged and journaled like chat."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest

from tests.support.accounts import journal
from tests.support.config_files import MODEL
from tests.support.gateway import settled
from tests.support.upstreams import sim_requests

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def client(gw: Any, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")), api_key=key,
                              max_retries=0)


async def test_a_plain_response_and_the_chat_the_engine_got(gateway: Any, simulator: Any,
                                                             clean_redis: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client(gw, gw.api_key) as c:
        response = await c.responses.create(
            model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=8,
            temperature=0.5, metadata={"ticket": "42"})
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text  # the SDK's own aggregation of output_text parts
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.status == "incomplete"  # the simulator's answer is cut at 8 tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 8
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    assert response.metadata == {"ticket": "42"} and response.max_output_tokens == 8
    [sent] = await sim_requests(sim)
    assert sent["body"]["messages"] == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hello there"}]
    assert sent["body"]["max_tokens"] == 8 and sent["body"]["temperature"] == 0.5
    await settled(gw)
    [entry] = [e for e in await journal(clean_redis.url, "acct-test")
               if e.get("request_id") and e.get("completion_tokens") == 8]
    assert entry["prompt_tokens"] == response.usage.input_tokens


async def test_a_streamed_response_is_the_event_sequence_the_client_parses(
        gateway: Any, simulator: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client(gw, gw.api_key) as c:
        stream = await c.responses.create(model=MODEL, input="Hello", max_output_tokens=6,
                                          stream=True)
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response
    assert final.output_text == text and final.usage is not None
    assert final.usage.output_tokens == 6
    # The stream helper accumulates the events into the response (it wants a
    # response.completed: an answer that ended on its own, not at max_output_tokens).
    async with client(gw, gw.api_key) as c, \
            c.responses.stream(model=MODEL, input="Hello") as s:
        streamed = "".join([e.delta async for e in s if e.type == "response.output_text.delta"])
        helper = await s.get_final_response()
    assert helper.status == "completed" and helper.output_text == streamed
    assert helper.usage is not None and helper.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_function_calls_out_and_their_results_back(gateway: Any, simulator: Any,
                                                         stream: bool) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client(gw, gw.api_key) as c:
        if stream:
            async with c.responses.stream(model=MODEL, input="Weather in Paris?",
                                          tools=[WEATHER]) as s:  # type: ignore[list-item]
                kinds = [event.type async for event in s]
                first = await s.get_final_response()
            assert "response.function_call_arguments.delta" in kinds
            assert "response.function_call_arguments.done" in kinds
        else:
            first = await c.responses.create(model=MODEL, input="Weather in Paris?",
                                             tools=[WEATHER], tool_choice="required")  # type: ignore[list-item]
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather" and call.call_id
        assert "city" in orjson.loads(call.arguments)
        # The caller runs the function and sends the whole conversation back (nothing stored).
        second = await c.responses.create(model=MODEL, tools=[WEATHER], input=[  # type: ignore[list-item]
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
            tool_choice="none")
    assert second.output_text
    last = (await sim_requests(sim))[-1]["body"]
    assert last["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    assert last["tools"][0]["function"]["name"] == "get_weather"


async def test_items_with_parts_and_roles(gateway: Any, simulator: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client(gw, gw.api_key) as c:
        response = await c.responses.create(model=MODEL, input=[
            {"role": "developer", "content": "Answer in French."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=",
                 "detail": "low"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Un point."}]},
            {"role": "user", "content": "Merci"}])
    assert response.status in ("completed", "incomplete")
    [sent] = await sim_requests(sim)
    assert sent["body"]["messages"] == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=",
                                                "detail": "low"}}]},
        {"role": "assistant", "content": "Un point."},
        {"role": "user", "content": "Merci"}]


@pytest.mark.parametrize(("body", "where"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, ["body", "previous_response_id"]),
    ({"input": [{"type": "function_call", "call_id": "c1"}]}, ["body", "input", 0, "name"]),
    ({"input": [{"type": "message", "content": "x"}]}, ["body", "input", 0, "role"]),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, ["body", "input", 0, "type"]),
    ({"input": "hi", "tool_choice": "required"}, ["body", "tool_choice"]),
    ({"input": "hi", "stream": True, "async": True}, ["body", "stream"]),
    ({"input": "hi", "reasoning": {"effort": "low"}}, ["body", "reasoning"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "https://example.com/a.png"}]}]},
     ["body", "input", 0, "content", 0, "image_url"]),
])
async def test_what_cannot_be_honoured_is_a_422_naming_it(gateway: Any, simulator: Any,
                                                         body: dict[str, Any],
                                                         where: list[object]) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client(gw, gw.api_key) as c:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await c.post("/responses", cast_to=object, body={"model": MODEL, **body})
    detail = caught.value.response.json()["detail"]
    assert detail and any(item["loc"][:len(where)] == where for item in detail), detail
    assert await sim_requests(sim) == []  # nothing reached the engine


async def test_an_async_response_is_polled_as_the_same_response_object(
        gateway: Any, simulator: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    tasks = openai.AsyncOpenAI(base_url=str(gw.make_url("/v2")), api_key=gw.api_key,
                               max_retries=0)
    async with client(gw, gw.api_key) as c, tasks:
        accepted = await c.post("/responses", cast_to=object, body={
            "model": MODEL, "input": "Hello", "async": True})
        assert isinstance(accepted, dict) and accepted["task_id"].startswith("direct:")
        for _ in range(200):
            polled = await tasks.get(f"/tasks/{accepted['task_id']}", cast_to=object)
            assert isinstance(polled, dict)
            if polled["status"] != "running":
                break
            await asyncio.sleep(0.02)
    result = polled["result"]
    assert polled["status"] == "completed" and result["object"] == "response"
    assert result["task_id"] == accepted["task_id"] and result["usage"]["output_tokens"] > 0
    assert result["output"][0]["content"][0]["type"] == "output_text"


async def test_the_openai_client_lists_the_models_from_the_compat_base_url(
        gateway: Any, simulator: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client(gw, gw.api_key) as c:
        models = [model async for model in c.models.list()]
    assert [model.id for model in models] == [MODEL]
    assert models[0].object == "model"


async def test_a_stream_cut_mid_way_ends_failed_and_is_charged_like_chat(
        gateway: Any, simulator: Any, clean_redis: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client(gw, gw.api_key) as c:
        stream = await c.responses.create(model=MODEL, input="Hello", stream=True,
                                          extra_headers={"x-sim-cut-after": "3"})
        events = [event async for event in stream]
    last = events[-1]
    assert last.type == "response.failed"
    assert last.response.status == "failed" and last.response.error is not None
    assert last.response.error.code == "server_error"
    assert "stream" in last.response.error.message
    assert any(e.type == "response.output_text.delta" for e in events)  # it had begun
    await settled(gw)
    charges = [e for e in await journal(clean_redis.url, "acct-test") if e["type"] == "charge"]
    assert charges[-1]["status"] == "cut" and charges[-1]["estimated"] is True
    assert charges[-1]["completion_tokens"] > 0
