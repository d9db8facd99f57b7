"""The Anthropic-style route end to end (official anthropic client -> gateway -> simulators), and
property tests of the pure translation both ways."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import ErrorKind, GatewayError
from proxy.http.sse import SSEDecoder
from proxy.simulators.textgen import prompt_tokens
from proxy.styles.anthropic import AnthropicEncoder, AnthropicStyle, to_message
from proxy.validate import RequestInvalid
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import PROBE_AGENT, SimulatorFactory

ROUTE = "/v2/messages/v1/messages"
HELLO: Any = [{"role": "user", "content": "Say hello to the world."}]
WEATHER: Any = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
KINDS = pytest.mark.parametrize("kind", ["vllm", "tgi"])


@asynccontextmanager
async def client_for(gw: TestServer, key: str | None = None
                     ) -> AsyncIterator[anthropic.AsyncAnthropic]:
    api_key = key if key is not None else gw.api_key  # type: ignore[attr-defined]
    async with anthropic.AsyncAnthropic(base_url=str(gw.make_url("/v2/messages")),
                                        api_key=api_key, max_retries=0) as client:
        yield client


async def started(simulator: SimulatorFactory, gateway: GatewayFactory, kind: str = "vllm"
                  ) -> tuple[TestServer, TestServer]:
    sim = await simulator(kind)
    return sim, await gateway(sim, kind=kind)


async def upstream_bodies(sim: TestServer) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/_sim/requests")) as r:
        return [record["body"] for record in await r.json()
                if record["headers"].get("user-agent") != PROBE_AGENT]


async def raw_events(gw: TestServer, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of every SSE event the gateway sent."""
    async with aiohttp.ClientSession() as session, session.post(
        gw.make_url(ROUTE), json={**body, "stream": True},
        headers={"x-api-key": gw.api_key, **(headers or {})},  # type: ignore[attr-defined]
    ) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = await response.read()
    decoder = SSEDecoder()
    events = decoder.feed(raw) + decoder.finish()
    return [(event.event, orjson.loads(event.data)) for event in events]


def shape(names: list[str | None]) -> str:
    """Event names with runs of deltas collapsed: easy to compare against the documented order."""
    out: list[str] = []
    for name in names:
        short = "delta+" if name == "content_block_delta" else str(name)
        if not (out and out[-1] == short == "delta+"):
            out.append(short)
    return " ".join(out)


# ---- end to end ---------------------------------------------------------------------------


@KINDS
async def test_plain_message(kind: str, simulator: SimulatorFactory, gateway: GatewayFactory
                             ) -> None:
    sim, gw = await started(simulator, gateway, kind)
    async with client_for(gw) as client:
        # This SDK version no longer types sampling parameters: extra_body sends them.
        message = await client.messages.create(model=MODEL, max_tokens=64, messages=HELLO,
                                               extra_body={"temperature": 0.7, "top_k": 5})
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text.strip()  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    sent = (await upstream_bodies(sim))[-1]
    assert message.usage.input_tokens == prompt_tokens(sent["messages"])
    assert message.usage.output_tokens == 16  # the simulator's natural length
    assert message.usage.cache_read_input_tokens == 0
    extra = message.model_extra or {}
    assert extra["task_id"].startswith("direct:") and extra["mode"] == "direct"
    # Translated, not forwarded: OpenAI fields only, temperature unscaled.
    assert sent["messages"] == HELLO and sent["max_tokens"] == 64 and sent["temperature"] == 0.7
    assert "mode" not in sent
    assert ("top_k" in sent) == (kind == "vllm")  # a vLLM extension, stripped for others


@KINDS
async def test_streamed_message(kind: str, simulator: SimulatorFactory, gateway: GatewayFactory
                                ) -> None:
    sim, gw = await started(simulator, gateway, kind)
    async with client_for(gw) as client:
        plain = await client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
        async with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:
            texts = [event.text async for event in stream if event.type == "text"]
            final = await stream.get_final_message()
    assert len(texts) == 16
    assert final.content[0].text == "".join(texts) == plain.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.id.startswith("msg_")
    sent = (await upstream_bodies(sim))[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    # message_start said 0 input tokens; the final message_delta brought the real count.
    assert final.usage.input_tokens == prompt_tokens(sent["messages"])
    assert final.usage.output_tokens == 16


@KINDS
async def test_raw_event_sequence(kind: str, simulator: SimulatorFactory, gateway: GatewayFactory
                                  ) -> None:
    _, gw = await started(simulator, gateway, kind)
    events = await raw_events(gw, {"model": MODEL, "max_tokens": 64, "messages": HELLO})
    assert all(data["type"] == name for name, data in events)  # `event:` line == data type
    assert shape([name for name, _ in events]) == (
        "message_start content_block_start ping delta+ content_block_stop message_delta "
        "message_stop")
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == 0
    assert start["task_id"].startswith("direct:")
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 16 and final["usage"]["input_tokens"] > 0


async def test_system_prompt_becomes_first_system_message(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim, gw = await started(simulator, gateway)
    async with client_for(gw) as client:
        await client.messages.create(model=MODEL, max_tokens=8, messages=HELLO,
                                     system="You are terse.")
        await client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, system=[
            {"type": "text", "text": "Rule one.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Rule two."}])
    first, second = await upstream_bodies(sim)
    assert first["messages"] == [{"role": "system", "content": "You are terse."}, *HELLO]
    assert second["messages"][0] == {"role": "system", "content": "Rule one.\nRule two."}


@KINDS
async def test_tool_use(kind: str, simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim, gw = await started(simulator, gateway, kind)
    async with client_for(gw) as client:
        message = await client.messages.create(
            model=MODEL, max_tokens=64, messages=HELLO, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_") and isinstance(block.input, dict)
    assert isinstance(block.input["city"], str)
    sent = (await upstream_bodies(sim))[-1]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"]}}]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["parallel_tool_calls"] is False


@KINDS
async def test_streamed_tool_use(kind: str, simulator: SimulatorFactory, gateway: GatewayFactory
                                 ) -> None:
    _, gw = await started(simulator, gateway, kind)
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": HELLO,
                               "tools": [WEATHER], "tool_choice": {"type": "any"}}
    async with client_for(gw) as client:
        plain = await client.messages.create(**request)
        async with client.messages.stream(**request) as stream:
            final = await stream.get_final_message()
    (block,) = final.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == plain.content[0].input
    assert final.stop_reason == "tool_use"
    events = await raw_events(gw, request)
    assert shape([name for name, _ in events]) == (
        "message_start content_block_start ping delta+ content_block_stop message_delta "
        "message_stop")
    assert events[1][1]["content_block"]["input"] == {}
    fragments = [data["delta"]["partial_json"] for name, data in events
                 if name == "content_block_delta"]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == block.input


@KINDS
async def test_tool_result_round_trip(kind: str, simulator: SimulatorFactory,
                                      gateway: GatewayFactory) -> None:
    sim, gw = await started(simulator, gateway, kind)
    async with client_for(gw) as client:
        first = await client.messages.create(model=MODEL, max_tokens=64, messages=HELLO,
                                             tools=[WEATHER])
        call = first.content[0]
        assert call.type == "tool_use"
        conversation: list[Any] = [
            *HELLO,
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                {"type": "text", "text": "And tomorrow?"}]},
        ]
        second = await client.messages.create(model=MODEL, max_tokens=64,
                                              messages=conversation, tools=[WEATHER])
    assert second.content  # the upstream took the conversation
    sent = (await upstream_bodies(sim))[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "user"]
    assistant, tool, user = sent[1:]
    upstream_id = assistant["tool_calls"][0]["id"]
    # The upstream gets back exactly the call id it issued (the toolu_ prefix is the gateway's).
    assert call.id == "toolu_" + upstream_id
    if kind == "vllm":
        assert upstream_id.startswith("chatcmpl-tool-")
    assert assistant["content"] == "Let me check."
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == call.input
    assert tool == {"role": "tool", "tool_call_id": upstream_id, "content": "Sunny, 21 C"}
    assert user == {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}


async def test_thinking(simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim, gw = await started(simulator, gateway, "vllm")
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    async with client_for(gw) as client:
        message = await client.messages.create(model=MODEL, max_tokens=64, messages=HELLO,
                                               thinking=thinking)
        async with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO,
                                          thinking=thinking) as stream:
            final = await stream.get_final_message()
    for answer in (message, final):
        assert [block.type for block in answer.content] == ["thinking", "text"]
        assert answer.content[0].thinking.strip()  # type: ignore[union-attr]
        assert answer.content[0].signature == ""  # type: ignore[union-attr]
        assert answer.usage.output_tokens == 16 + 8  # reasoning counts as output
    assert [b.to_dict() for b in message.content] == [
        {k: v for k, v in b.to_dict().items() if k != "parsed_output"} for b in final.content]
    for sent in await upstream_bodies(sim):
        assert sent["chat_template_kwargs"] == {"enable_thinking": True}


async def test_stop_sequence_is_reported(simulator: SimulatorFactory, gateway: GatewayFactory
                                         ) -> None:
    _, gw = await started(simulator, gateway, "vllm")
    async with client_for(gw) as client:
        plain = await client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
        word = plain.content[0].text.split()[3]  # type: ignore[union-attr]
        stopped = await client.messages.create(model=MODEL, max_tokens=64, messages=HELLO,
                                               stop_sequences=[word, "zzz"])
        async with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO,
                                          stop_sequences=[word]) as stream:
            final = await stream.get_final_message()
    for answer in (stopped, final):
        assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == word
        assert word not in answer.content[0].text  # type: ignore[union-attr]
    async with client_for(gw) as client:
        short = await client.messages.create(model=MODEL, max_tokens=3, messages=HELLO)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


async def test_errors_in_anthropic_shape(simulator: SimulatorFactory, gateway: GatewayFactory
                                         ) -> None:
    sim, gw = await started(simulator, gateway)
    async with client_for(gw, key="nope") as client:
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await client.messages.create(model=MODEL, max_tokens=8, messages=HELLO)
    async with client_for(gw) as client:
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="acme/none", max_tokens=8, messages=HELLO)
        with pytest.raises(anthropic.UnprocessableEntityError) as invalid:
            # `omit` leaves max_tokens out; a fixed timeout skips the SDK's sizing by it.
            await client.messages.create(model=MODEL, max_tokens=anthropic.omit,  # type: ignore[call-overload]
                                         messages=HELLO, timeout=30)
        with pytest.raises(anthropic.UnprocessableEntityError) as unknown:
            await client.messages.create(model=MODEL, max_tokens=8, messages=HELLO,
                                         extra_body={"frequency_penalty": 1})
        with pytest.raises(anthropic.InternalServerError) as upstream:
            await client.messages.create(model=MODEL, max_tokens=8, messages=HELLO,
                                         extra_headers={"x-sim-status": "500"})
    assert auth.value.status_code == 401
    assert auth.value.body["type"] == "error"  # type: ignore[index]
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    body: Any = invalid.value.body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["detail"] == [{"loc": ["body", "max_tokens"], "msg": "Field required",
                               "type": "missing"}]
    assert "max_tokens" in body["error"]["message"]
    assert unknown.value.body["detail"][0]["loc"] == ["body", "frequency_penalty"]  # type: ignore[index]
    assert upstream.value.status_code == 502
    assert upstream.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert len(await upstream_bodies(sim)) == 1  # only the 502 reached the upstream


async def test_usage_rules_are_422(simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    _, gw = await started(simulator, gateway)
    async with client_for(gw) as client:
        with pytest.raises(anthropic.UnprocessableEntityError) as caught:
            await client.messages.create(model=MODEL, max_tokens=8, messages=[
                {"role": "user", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "x", "input": {}}]}],
                tool_choice={"type": "any"})
    locs = [item["loc"] for item in caught.value.body["detail"]]  # type: ignore[index]
    assert ["body", "messages", 0, "content", 0, "type"] in locs
    assert ["body", "tool_choice"] in locs


@KINDS
async def test_mid_stream_failure_is_one_error_event(
    kind: str, simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    _, gw = await started(simulator, gateway, kind)
    fault = {"x-sim-error-after": "3"}
    events = await raw_events(gw, {"model": MODEL, "max_tokens": 64, "messages": HELLO}, fault)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "error"
    assert names.count("error") == 1 and "message_stop" not in names
    assert events[-1][1]["error"]["type"] == "api_error"
    async with client_for(gw) as client, client.messages.stream(
        model=MODEL, max_tokens=64, messages=HELLO, extra_headers=fault
    ) as stream:
        with pytest.raises(anthropic.APIStatusError) as caught:
            async for _ in stream:
                pass
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


# ---- pure: error rendering ----------------------------------------------------------------


@pytest.mark.parametrize(("kind", "expected"), [
    (ErrorKind.INVALID_JSON, "invalid_request_error"),
    (ErrorKind.INVALID_API_KEY, "authentication_error"),
    (ErrorKind.INSUFFICIENT_CREDITS, "billing_error"),
    (ErrorKind.FORBIDDEN, "permission_error"),
    (ErrorKind.NOT_FOUND, "not_found_error"),
    (ErrorKind.PAYLOAD_TOO_LARGE, "request_too_large"),
    (ErrorKind.VALIDATION_ERROR, "invalid_request_error"),
    (ErrorKind.RATE_LIMITED, "rate_limit_error"),
    (ErrorKind.INTERNAL_ERROR, "api_error"),
    (ErrorKind.UPSTREAM_ERROR, "api_error"),
    (ErrorKind.UNAVAILABLE, "overloaded_error"),
    (ErrorKind.UPSTREAM_TIMEOUT, "timeout_error"),
])
def test_error_body_types(kind: ErrorKind, expected: str) -> None:
    body = orjson.loads(AnthropicStyle().error_body(GatewayError(kind, "why")))
    assert body == {"type": "error", "error": {"type": expected, "message": "why"},
                    "detail": "why"}
    event = AnthropicEncoder(MODEL, "direct:x", ()).error(GatewayError(kind, "why"))
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")


# ---- pure: request translation details --------------------------------------------------


def test_request_translation_details() -> None:
    call = AnthropicStyle().parse({
        "model": MODEL, "max_tokens": 50, "stream": True, "stop_sequences": ["END"],
        "metadata": {"user_id": "u-1"}, "thinking": {"type": "disabled"}, "mode": "direct",
        "tools": [WEATHER], "tool_choice": {"type": "any"}, "cache_control": {"type": "ephemeral"},
        "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "iVBORw0K"}},
                {"type": "image", "source": {"type": "url",
                                             "url": "data:image/gif;base64,R0lGODdh"}},
                {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "tool_use", "id": "toolu_call_1", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_call_1", "is_error": True,
                 "content": [{"type": "text", "text": "no"},
                             {"type": "image", "source": {
                                 "type": "url", "url": "data:image/gif;base64,R0lGODlh"}}]}]},
        ]})
    assert call.stream and call.mode == "direct" and call.max_tokens == 50
    assert call.extras == {"stop_sequences": ("END",)}
    body = call.openai_body
    assert body["stop"] == ["END"] and body["user"] == "u-1" and body["stream"] is True
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["tool_choice"] == "required" and "mode" not in body
    assert body["messages"] == [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
            {"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lGODdh"}},
            {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": None, "tool_calls": [  # thinking dropped
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "no"},
        # a tool message holds text only: the result's image follows as a user message
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lGODlh"}}]},
    ]


@pytest.mark.parametrize(("thinking", "enabled"), [
    ({"type": "enabled", "budget_tokens": 2048}, True), ({"type": "adaptive"}, True),
    ({"type": "disabled"}, False)])
def test_thinking_modes(thinking: dict[str, Any], enabled: bool) -> None:
    call = AnthropicStyle().parse({"model": MODEL, "max_tokens": 9, "messages": HELLO,
                                   "thinking": thinking})
    assert call.openai_body["chat_template_kwargs"] == {"enable_thinking": enabled}
    assert "budget_tokens" not in orjson.dumps(call.openai_body).decode()


def test_tool_ids_stay_unique_within_a_message() -> None:
    """TGI numbers every call "0": the second one still gets an id of its own."""
    calls = [{"id": "0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "0", "type": "function", "function": {"name": "g", "arguments": "[1]"}}]
    out = to_message({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": None, "tool_calls": calls}}]}, MODEL, ())
    assert [b["id"] for b in out["content"]] == ["toolu_0", "toolu_0_1"]
    assert out["content"][1]["input"] == {"raw_arguments": "[1]"}  # not an object: kept as text
    assert out["stop_reason"] == "tool_use" and out["id"].startswith("msg_")


# ---- properties: Anthropic request -> OpenAI body -> (inverse) ------------------------------

words = st.text(st.characters(codec="utf-8"), max_size=12)
idents = st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | words,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner, max_size=3),
    max_leaves=6)
text_blocks = st.builds(lambda t: {"type": "text", "text": t}, words)
# (URL sources are accepted as data: URLs only, which read back as base64 sources: the details
# test covers their translation.)
images = st.builds(lambda d: {"type": "image", "source": {"type": "base64",
                                                          "media_type": "image/png", "data": d}},
                   st.from_regex(r"[A-Za-z0-9+/]{4,16}", fullmatch=True))
tool_results = st.builds(
    lambda i, c: {"type": "tool_result", "tool_use_id": "toolu_" + i, "content": c},
    idents, st.none() | words | st.lists(text_blocks, max_size=3))
user_turns = st.one_of(words, st.builds(
    lambda results, rest: results + rest,  # Anthropic: tool results lead the user turn
    st.lists(tool_results, max_size=2), st.lists(text_blocks | images, max_size=3)))
tool_uses = st.builds(lambda i, n, inp: {"type": "tool_use", "id": "toolu_" + i, "name": n,
                                         "input": inp},
                      idents, idents, st.dictionaries(words, json_values, max_size=3))
thinking = st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, words)
assistant_turns = st.one_of(words, st.lists(text_blocks | tool_uses | thinking, max_size=4))
tools = st.lists(st.builds(
    lambda n, d, schema: {"name": n, "input_schema": schema, **({"description": d} if d else {})},
    idents, st.none() | words, st.dictionaries(words, json_values, max_size=2)),
    max_size=3, unique_by=lambda t: t["name"])


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    turns = draw(st.integers(1, 5))
    messages = [{"role": "user", "content": draw(user_turns)} if i % 2 == 0 else
                {"role": "assistant", "content": draw(assistant_turns)} for i in range(turns)]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 128_000)),
                            "messages": messages}
    if system := draw(st.none() | words | st.lists(text_blocks, max_size=3)):
        body["system"] = system
    if stops := draw(st.lists(words, max_size=4)):
        body["stop_sequences"] = stops
    if defined := draw(tools):
        body["tools"] = defined
        choice = draw(st.sampled_from(["auto", "any", "none", "tool"]))
        body["tool_choice"] = {"type": choice, **(
            {"name": draw(st.sampled_from([t["name"] for t in defined]))} if choice == "tool"
            else {})}
    return body


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(block["text"] for block in content)


def normalised(body: dict[str, Any]) -> dict[str, Any]:
    """What must survive: system text, turns (thinking dropped, texts joined as documented),
    tools, tool choice and stop sequences."""
    messages = []
    for message in body["messages"]:
        content = message["content"]
        if message["role"] == "assistant" and not isinstance(content, str):
            texts = [b for b in content if b["type"] == "text"]
            calls = [b for b in content if b["type"] == "tool_use"]
            content = ([{"type": "text", "text": _text(texts)}] if texts else []) + calls \
                if calls else _text(texts)
        elif not isinstance(content, str):
            content = [{**b, "content": _text(b["content"])} if b["type"] == "tool_result"
                       else b for b in content]
        messages.append({"role": message["role"], "content": content})
    return {"system": _text(body.get("system")) or None, "messages": messages,
            "tools": body.get("tools"), "tool_choice": body.get("tool_choice", {}).get("type"),
            "stop_sequences": body.get("stop_sequences")}


def _block(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] == "text":
        return part
    url = part["image_url"]["url"]
    if url.startswith("data:"):
        media_type, _, data = url.removeprefix("data:").partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                            "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def inverse(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI body -> the Anthropic request it came from (protocols.md §5 gateway notes)."""
    openai_messages = list(body["messages"])
    system = None
    if openai_messages and openai_messages[0]["role"] == "system":
        system = openai_messages.pop(0)["content"]
    messages: list[dict[str, Any]] = []
    after_tools = False  # a user message right after tool messages is the same turn
    for m in openai_messages:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": "toolu_" + m["tool_call_id"],
                     "content": m["content"]}
            if after_tools:
                messages[-1]["content"].append(block)
            else:
                messages.append({"role": "user", "content": [block]})
            after_tools = True
            continue
        if m["role"] == "user":
            content = m["content"] if isinstance(m["content"], str) else \
                [_block(part) for part in m["content"]]
            if after_tools:
                messages[-1]["content"].extend(content)
            else:
                messages.append({"role": "user", "content": content})
        else:
            calls = [{"type": "tool_use", "id": "toolu_" + c["id"], "name": c["function"]["name"],
                      "input": json.loads(c["function"]["arguments"])}
                     for c in m.get("tool_calls", [])]
            text = m["content"]
            content = ([{"type": "text", "text": text}] if text is not None else []) + calls \
                if calls else text
            messages.append({"role": "assistant", "content": content})
        after_tools = False
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
              **({"description": t["function"]["description"]}
                 if "description" in t["function"] else {})} for t in body.get("tools", [])]
    choice = body.get("tool_choice")
    choice_type = {"auto": "auto", "required": "any", "none": "none"}.get(choice) \
        if isinstance(choice, str) else "tool" if choice else None
    return {"system": system, "messages": messages, "tools": tools or None,
            "tool_choice": choice_type, "stop_sequences": body.get("stop")}


@settings(max_examples=300, deadline=None)
@given(requests())
def test_request_translation_round_trips(body: dict[str, Any]) -> None:
    call = AnthropicStyle().parse(orjson.loads(orjson.dumps(body)))
    assert call.model == MODEL and call.max_tokens == body["max_tokens"]
    assert call.openai_body["max_tokens"] == body["max_tokens"] and not call.want_usage
    assert inverse(call.openai_body) == normalised(body)


@settings(max_examples=100, deadline=None)
@given(requests(), st.sampled_from(["mode", "async", "top_logprobs"]))
def test_unknown_or_misplaced_fields_are_refused(body: dict[str, Any], name: str) -> None:
    if name == "mode":  # gateway fields are accepted, bad values are not
        body["mode"] = "fast"
    elif name == "async":
        body.update({"async": True, "stream": True})
    else:
        body[name] = 3
    with pytest.raises(RequestInvalid) as caught:
        AnthropicStyle().parse(body)
    detail: Any = caught.value.detail
    assert detail and all(item["loc"][0] == "body" for item in detail)


# ---- properties: OpenAI completion -> Anthropic message, whole and streamed ----------------

arguments = st.dictionaries(words, json_values, max_size=3)
calls = st.lists(st.tuples(idents, idents, arguments), max_size=3, unique_by=lambda c: c[0])


@settings(max_examples=200, deadline=None)
@given(st.none() | words, st.none() | words, calls)
def test_completion_translation_keeps_text_and_tool_calls(
    text: str | None, reasoning: str | None, tool_calls: list[tuple[str, str, Any]]
) -> None:
    message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning": reasoning}
    if tool_calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in tool_calls]
    finish = "tool_calls" if tool_calls else "stop"
    completion = {"id": "chatcmpl-abc", "choices": [
        {"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}}
    out = to_message(completion, MODEL, ())
    thinking = [b["thinking"] for b in out["content"] if b["type"] == "thinking"]
    texts = [b["text"] for b in out["content"] if b["type"] == "text"]
    uses = [(b["id"], b["name"], b["input"]) for b in out["content"] if b["type"] == "tool_use"]
    assert thinking == ([reasoning] if reasoning else [])
    assert texts == ([text] if text else [])
    assert uses == [("toolu_" + i, n, a) for i, n, a in tool_calls]
    assert out["stop_reason"] == ("tool_use" if tool_calls else "end_turn")
    assert out["id"] == "msg_abc" and out["usage"]["input_tokens"] == 7


def _pieces(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=4)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)
            if text[a:b]]


@settings(max_examples=200, deadline=None)
@given(st.data(), words, calls)
def test_stream_encoder_reassembles_any_chunking(
    data: st.DataObject, text: str, tool_calls: list[tuple[str, str, Any]]
) -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return orjson.dumps({"id": "chatcmpl-s", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]})

    encoder = AnthropicEncoder(MODEL, "direct:t", ())
    out = [encoder.chunk(chunk({"role": "assistant", "content": ""}))]
    out += [encoder.chunk(chunk({"content": piece})) for piece in _pieces(data, text)]
    for k, (i, name, args) in enumerate(tool_calls):
        pieces = _pieces(data, json.dumps(args))
        out.append(encoder.chunk(chunk({"tool_calls": [
            {"index": k, "id": i, "type": "function", "function": {"name": name,
                                                                    "arguments": ""}}]})))
        out += [encoder.chunk(chunk({"tool_calls": [{"index": k, "function": {
            "arguments": piece}}]})) for piece in pieces]
    out.append(encoder.chunk(chunk({}, "tool_calls" if tool_calls else "stop")))
    out.append(encoder.end({"prompt_tokens": 3, "completion_tokens": 5}))
    decoder = SSEDecoder()
    events = [(e.event, orjson.loads(e.data)) for e in decoder.feed(b"".join(out))]
    blocks: list[dict[str, Any]] = []
    for event_name, payload in events:
        if event_name == "content_block_start":
            assert payload["index"] == len(blocks)
            blocks.append({**payload["content_block"], "json": ""})
        elif event_name == "content_block_delta":
            delta, block = payload["delta"], blocks[payload["index"]]
            key = {"text_delta": "text", "input_json_delta": "json"}[delta["type"]]
            block[key] += delta["text" if key == "text" else "partial_json"]
    assert [b["text"] for b in blocks if b["type"] == "text"] == ([text] if text else [])
    assert [(b["id"], b["name"], json.loads(b["json"])) for b in blocks
            if b["type"] == "tool_use"] == [("toolu_" + i, n, a) for i, n, a in tool_calls]
    names = [event_name for event_name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == len(blocks)
    assert names.count("ping") == (1 if blocks else 0)
    assert events[-2][1]["usage"] == {"output_tokens": 5, "input_tokens": 3,
                                      "cache_read_input_tokens": 0}
