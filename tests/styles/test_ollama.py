"""The Ollama-style chat route and discovery calls: official `ollama` client -> gateway -> real
simulators; plus pure property tests of the translation."""

from __future__ import annotations

import base64
import itertools
from datetime import datetime
from typing import Any

import aiohttp
import ollama
import orjson
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import ErrorKind, GatewayError
from proxy.simulators.textgen import prompt_tokens
from proxy.styles.ollama import OllamaStyle
from proxy.validate import RequestInvalid
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import PROBE_AGENT, SimulatorFactory

CHAT = "/v2/native/api/chat"
HELLO = [{"role": "user", "content": "Say hello to the world."}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def client_for(gw: TestServer, key: str | None = None, **headers: str) -> ollama.AsyncClient:
    token = key if key is not None else gw.api_key  # type: ignore[attr-defined]
    return ollama.AsyncClient(host=str(gw.make_url("/v2/native")),
                              headers={"Authorization": f"Bearer {token}", **headers})


async def sim_requests(sim: TestServer) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/_sim/requests")) as r:
        records: list[dict[str, Any]] = await r.json()
        return [r for r in records if r["headers"].get("user-agent") != PROBE_AGENT]


async def post(gw: TestServer, body: Any, path: str = CHAT, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], bytes]:
    auth = {"Authorization": f"Bearer {gw.api_key}"}  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as session, session.post(
        gw.make_url(path), data=orjson.dumps(body),
        headers={"Content-Type": "application/json", **auth, **(headers or {})},
    ) as response:
        return response.status, dict(response.headers), await response.read()


def ndjson(raw: bytes) -> list[dict[str, Any]]:
    """Strict NDJSON (protocols.md §8.2): one JSON object per `\\n`-terminated line, none blank."""
    assert raw.endswith(b"\n")
    lines = raw[:-1].split(b"\n")
    assert all(line and b"\r" not in line for line in lines)
    objects = [orjson.loads(line) for line in lines]
    assert all(isinstance(obj, dict) for obj in objects)
    return objects


def assert_final_metrics(final: dict[str, Any] | Any) -> None:
    for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[name], int) and final[name] >= 0, name
    assert final["total_duration"] > 0
    assert final["prompt_eval_duration"] + final["eval_duration"] <= final["total_duration"]
    stamp = final["created_at"]
    assert stamp.endswith("Z") and len(stamp.rpartition(".")[2]) == 10  # 9 digits + Z
    datetime.fromisoformat(stamp[:26] + "+00:00")


# ---- the route, end to end -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vllm", "tgi"])
async def test_chat_not_streamed(kind: str, simulator: SimulatorFactory, gateway: GatewayFactory
                                 ) -> None:
    sim = await simulator(kind)
    gw = await gateway(sim, kind=kind)
    async with client_for(gw) as client:
        answer = await client.chat(model=MODEL, messages=HELLO, options={"seed": 7})
    assert answer.model == MODEL and answer.message.role == "assistant"
    assert answer.message.content and answer.done is True and answer.done_reason == "stop"
    seen = (await sim_requests(sim))[-1]["body"]
    assert seen["messages"] == HELLO and seen["stream"] is False and seen["seed"] == 7
    assert "mode" not in seen and "options" not in seen
    assert answer.prompt_eval_count == prompt_tokens(seen["messages"])  # the simulator's count
    assert answer.eval_count == 16
    assert_final_metrics(answer)
    # Gateway extras ride along as extra fields.
    status, headers, raw = await post(gw, {"model": MODEL, "messages": HELLO, "stream": False})
    body = orjson.loads(raw)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert body["mode"] == "direct" and body["task_id"] == headers["X-Task-Id"]
    assert body["task_id"].startswith("direct:")


@pytest.mark.parametrize("kind", ["vllm", "tgi"])
async def test_stream_is_ndjson_by_default(kind: str, simulator: SimulatorFactory,
                                           gateway: GatewayFactory) -> None:
    sim = await simulator(kind)
    gw = await gateway(sim, kind=kind)
    status, headers, raw = await post(gw, {"model": MODEL, "messages": HELLO,
                                           "options": {"seed": 3}})  # no `stream`: true
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    lines = ndjson(raw)
    *parts, final = lines
    assert len(parts) == 16 and all(p["done"] is False and p["model"] == MODEL for p in parts)
    assert all(p["message"]["role"] == "assistant" and p["message"]["content"] for p in parts)
    assert final["done"] is True and final["done_reason"] == "stop"
    assert final["message"] == {"role": "assistant", "content": ""}
    assert final["eval_count"] == 16 and final["prompt_eval_count"] == prompt_tokens(HELLO)
    assert final["task_id"] == headers["X-Task-Id"] and final["mode"] == "direct"
    assert_final_metrics(final)
    assert (await sim_requests(sim))[-1]["body"]["stream"] is True
    # The same words as the whole answer, through the official client's stream.
    async with client_for(gw) as client:
        whole = await client.chat(model=MODEL, messages=HELLO, options={"seed": 3})
        stream = await client.chat(model=MODEL, messages=HELLO, options={"seed": 3},
                                   stream=True)
        chunks = [chunk async for chunk in stream]
    text = "".join(p["message"]["content"] for p in parts)
    assert text == whole.message.content == "".join(c.message.content or "" for c in chunks)
    assert [c.done for c in chunks] == [False] * 16 + [True]
    assert chunks[-1].eval_count == 16


@pytest.mark.parametrize("kind", ["vllm", "tgi"])
async def test_tool_calls_arrive_whole_and_answers_go_back(
    kind: str, simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator(kind)
    gw = await gateway(sim, kind=kind)
    async with client_for(gw) as client:
        first = await client.chat(model=MODEL, messages=HELLO, tools=WEATHER)
        calls = first.message.tool_calls
        assert first.done_reason == "stop" and calls and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        arguments = dict(calls[0].function.arguments)
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        # The client echoes the call without its id; the tool answer names the tool only.
        follow_up = [*HELLO, first.message,
                     {"role": "tool", "content": "12 degrees", "tool_name": "get_weather"}]
        second = await client.chat(model=MODEL, messages=follow_up)
    assert second.message.content and not second.message.tool_calls
    seen = (await sim_requests(sim))[-1]["body"]["messages"]
    assistant, tool = seen[1], seen[2]
    (call,) = assistant["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert orjson.loads(call["function"]["arguments"]) == arguments  # a JSON string upstream
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": "12 degrees"}
    # Streamed: the fragments are collected into one line with an object `arguments`.
    status, _, raw = await post(gw, {"model": MODEL, "messages": HELLO, "tools": WEATHER})
    lines = ndjson(raw)
    with_calls = [line for line in lines if line["message"].get("tool_calls")]
    assert status == 200 and len(with_calls) == 1 and with_calls[0]["done"] is False
    (streamed,) = with_calls[0]["message"]["tool_calls"]
    assert streamed["function"]["name"] == "get_weather"
    assert streamed["function"]["arguments"] == arguments and streamed["id"]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"


async def test_think_turns_on_reasoning(simulator: SimulatorFactory, gateway: GatewayFactory
                                        ) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with client_for(gw) as client:
        answer = await client.chat(model=MODEL, messages=HELLO, think=True)
        stream = await client.chat(model=MODEL, messages=HELLO, think="high", stream=True)
        chunks = [chunk async for chunk in stream]
    assert answer.message.thinking and answer.message.content
    assert len(answer.message.thinking.split()) == 8  # the simulator's reasoning length
    first, second = (r["body"] for r in await sim_requests(sim))
    assert first["chat_template_kwargs"] == {"enable_thinking": True}
    assert second["chat_template_kwargs"] == {"enable_thinking": True}
    assert second["reasoning_effort"] == "high"
    thinking = [c.message.thinking for c in chunks if c.message.thinking]
    assert "".join(thinking) == answer.message.thinking  # same prompt, same seed
    assert all(not c.message.content for c in chunks[:len(thinking)])  # thinking comes first


async def test_options_map_to_openai_fields(simulator: SimulatorFactory, gateway: GatewayFactory
                                            ) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    async with client_for(gw) as client:
        short = await client.chat(model=MODEL, messages=HELLO, options={
            "num_predict": 5, "temperature": 0.2, "top_p": 0.9, "top_k": 20, "stop": ["\n\n"],
            "repeat_penalty": 1.1, "num_ctx": 4096, "mirostat": 0})
        await client.chat(model=MODEL, messages=HELLO, format="json",
                          options={"num_predict": -1})
        await client.chat(model=MODEL, messages=HELLO, format=schema, keep_alive="5m")
    assert short.done_reason == "length" and short.eval_count == 5
    first, second, third = (r["body"] for r in await sim_requests(sim))
    assert first["max_tokens"] == 5 and first["temperature"] == 0.2 and first["top_p"] == 0.9
    assert first["top_k"] == 20 and first["stop"] == ["\n\n"]
    assert first["repetition_penalty"] == 1.1
    assert not {"num_ctx", "mirostat", "num_predict", "options", "keep_alive"} & set(first)
    # Unlimited (-1) still goes upstream capped: at what the credit hold assumed.
    assert second["response_format"] == {"type": "json_object"} and second["max_tokens"] == 4096
    assert third["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "format", "schema": schema}}


async def test_images_become_data_url_parts(simulator: SimulatorFactory,
                                            gateway: GatewayFactory) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(24)).decode()
    status, _, _ = await post(gw, {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "What is this?", "images": [png]}]})
    assert status == 200
    (message,) = (await sim_requests(sim))[-1]["body"]["messages"]
    assert message["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
    ]


async def test_discovery_calls(simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    gw = await gateway(await simulator("vllm"))
    async with client_for(gw) as client:
        listed = await client.list()
        shown = await client.show(MODEL)
        running = await client.ps()
    assert [m.model for m in listed.models] == [MODEL]
    entry = listed.models[0]
    assert entry.details is not None and entry.details.format and entry.modified_at is not None
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert "thinking" in shown.capabilities  # a vLLM backend honours `think`
    assert running.models == []
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.make_url("/v2/native/api/version")) as r:
            assert r.status == 200 and (await r.json())["version"].count(".") == 2
        async with session.get(gw.make_url("/v2/native/")) as r:
            assert r.status == 200 and await r.text() == "Ollama is running"
        async with session.head(gw.make_url("/v2/native/api/tags")) as r:
            assert r.status == 200
        async with session.get(gw.make_url("/v2/native/api/tags")) as r:  # guests may list
            assert [m["name"] for m in (await r.json())["models"]] == [MODEL]


async def test_errors_in_ollama_shape(simulator: SimulatorFactory, gateway: GatewayFactory
                                      ) -> None:
    gw = await gateway(await simulator("vllm"))
    async with client_for(gw, key="gw_sk_not-a-real-key") as bad:
        for call in (bad.chat(model=MODEL, messages=HELLO), bad.list(), bad.show(MODEL)):
            with pytest.raises(ollama.ResponseError) as caught:
                await call
            assert caught.value.status_code == 401 and "API key" in caught.value.error
    async with client_for(gw) as client:
        with pytest.raises(ollama.ResponseError) as caught:
            await client.chat(model="acme/no-such-model", messages=HELLO)
        assert caught.value.status_code == 404 and "acme/no-such-model" in caught.value.error
        with pytest.raises(ollama.ResponseError) as caught:
            await client.show("acme/no-such-model")
        assert caught.value.status_code == 404
        assert caught.value.error == "model 'acme/no-such-model' not found"
    # An empty `messages` (Ollama's "load the model") is refused, saying why.
    status, _, raw = await post(gw, {"model": MODEL, "messages": []})
    body = orjson.loads(raw)
    assert status == 422 and "load the model" in body["error"]
    assert body["detail"][0]["loc"] == ["body", "messages"]
    status, _, raw = await post(gw, {"model": MODEL, "messages": HELLO, "think": "very",
                                     "options": {"top_p": 2}})
    body = orjson.loads(raw)
    assert status == 422 and set(body) == {"error", "detail"}
    assert [item["loc"] for item in body["detail"]] == [["body", "options", "top_p"],
                                                        ["body", "think"]]


async def test_alias_route(simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    gw = await gateway(await simulator("tgi"), kind="tgi")
    status, headers, raw = await post(gw, {"model": MODEL, "messages": HELLO, "stream": False},
                                      path="/api/native/chat")
    assert status == 200 and orjson.loads(raw)["message"]["content"]
    status, headers, raw = await post(gw, {"model": MODEL, "messages": HELLO},
                                      path="/api/native/chat")
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    assert ndjson(raw)[-1]["done"] is True


@pytest.mark.parametrize("kind", ["vllm", "tgi"])
@pytest.mark.parametrize("fault", ["x-sim-cut-after", "x-sim-error-after"])
async def test_stream_broken_midway_ends_with_one_error_line(
    kind: str, fault: str, simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator(kind)
    gw = await gateway(sim, kind=kind)
    status, _, raw = await post(gw, {"model": MODEL, "messages": HELLO}, headers={fault: "3"})
    assert status == 200
    *parts, last = ndjson(raw)
    assert set(last) == {"error"} and isinstance(last["error"], str)
    assert 1 <= len(parts) <= 3 and all(p["done"] is False for p in parts)
    async with client_for(gw, **{fault: "3"}) as client:
        stream = await client.chat(model=MODEL, messages=HELLO, stream=True)
        with pytest.raises(ollama.ResponseError):
            async for _ in stream:
                pass


async def test_listings_are_not_rate_limited(simulator: SimulatorFactory,
                                             gateway: GatewayFactory) -> None:
    tight = "\n".join(f'[tiers.{tier}]\nrequests_per_minute = 1\nfamilies = ["chat"]\n'
                      'models = { "*" = ["direct"] }\n' for tier in ("guest", "max"))
    gw = await gateway(await simulator("vllm"), policies={"tiers.toml": tight})
    async with client_for(gw) as client:
        for _ in range(4):
            assert (await client.list()).models
        await client.chat(model=MODEL, messages=HELLO)
        with pytest.raises(ollama.ResponseError) as caught:
            await client.chat(model=MODEL, messages=HELLO)
    assert caught.value.status_code == 429


# ---- pure translation properties -----------------------------------------------------------

NAMES = st.sampled_from(["get_weather", "lookup", "add"])
TEXT = st.text(st.characters(codec="utf-8"), max_size=20)  # utf-8: no lone surrogates
SCALAR = st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT
KEYS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=8)
ARGS = st.dictionaries(KEYS, SCALAR | st.lists(SCALAR, max_size=3),
                       max_size=4)


@st.composite
def ollama_requests(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 4))):
        user: dict[str, Any] = {"role": "user", "content": draw(TEXT)}
        images = draw(st.lists(st.binary(min_size=1, max_size=24), max_size=2))
        if images:
            user["images"] = [base64.b64encode(image).decode() for image in images]
        messages.append(user)
        calls = draw(st.lists(st.tuples(NAMES, ARGS), max_size=3))
        if not calls:
            messages.append({"role": "assistant", "content": draw(TEXT)})
            continue
        messages.append({"role": "assistant", "content": draw(st.just("") | TEXT),
                         "tool_calls": [{"function": {"name": n, "arguments": a}}
                                        for n, a in calls]})
        messages += [{"role": "tool", "content": draw(TEXT), "tool_name": n} for n, _ in calls]
    options = draw(st.fixed_dictionaries({}, optional={
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "seed": st.integers(0, 2**31),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
        "num_predict": st.integers(-2, 4096), "top_k": st.integers(1, 100),
    }))
    return {"model": MODEL, "messages": messages, "options": options,
            "stream": draw(st.booleans())}


def back_to_ollama(body: dict[str, Any]) -> dict[str, Any]:
    """The inverse the gateway never needs, to show nothing was lost on the way out."""
    names: dict[str, str] = {}
    messages: list[dict[str, Any]] = []
    for message in body["messages"]:
        if message["role"] == "tool":
            messages.append({"role": "tool", "content": message["content"],
                             "tool_name": names[message["tool_call_id"]]})
            continue
        out: dict[str, Any] = {"role": message["role"]}
        content = message["content"]
        if isinstance(content, list):
            out["content"] = "".join(p["text"] for p in content if p["type"] == "text")
            out["images"] = [p["image_url"]["url"].partition(";base64,")[2]
                             for p in content if p["type"] == "image_url"]
        else:
            out["content"] = content or ""
        if message.get("tool_calls"):
            out["tool_calls"] = []
            for call in message["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                out["tool_calls"].append({"function": {
                    "name": call["function"]["name"],
                    "arguments": orjson.loads(call["function"]["arguments"])}})
        messages.append(out)
    options: dict[str, Any] = {k: body[k] for k in ("temperature", "top_p", "seed", "stop",
                                                    "top_k") if k in body}
    if "max_tokens" in body:
        options["num_predict"] = body["max_tokens"]
    return {"model": body["model"], "messages": messages, "options": options,
            "stream": body["stream"]}


@settings(max_examples=200, deadline=None)
@given(ollama_requests())
def test_request_translation_loses_nothing(request: dict[str, Any]) -> None:
    call = OllamaStyle().parse(orjson.loads(orjson.dumps(request)))
    assert call.stream is request["stream"] and call.model == MODEL
    expected = orjson.loads(orjson.dumps(request))
    if expected["options"].get("num_predict", 1) <= 0:  # -2, -1, 0: unlimited
        del expected["options"]["num_predict"]
    assert call.max_tokens == expected["options"].get("num_predict")
    assert back_to_ollama(call.openai_body) == expected
    ids = [c["id"] for m in call.openai_body["messages"] for c in m.get("tool_calls") or ()]
    assert len(ids) == len(set(ids))  # minted ids never collide
    # The same request always renders the same upstream body (stable minted ids).
    assert OllamaStyle().parse(orjson.loads(orjson.dumps(request))).openai_body == \
        call.openai_body


CALLS = st.lists(st.tuples(NAMES, ARGS), max_size=3)


@settings(max_examples=200, deadline=None)
@given(TEXT, CALLS, st.sampled_from(["stop", "length", "tool_calls"]),
       st.lists(st.integers(1, 7), min_size=1, max_size=10))
def test_answer_translation_keeps_text_and_tool_calls(
    text: str, calls: list[tuple[str, dict[str, Any]]], finish: str, cuts: list[int]
) -> None:
    style = OllamaStyle()
    call = style.parse({"model": MODEL, "messages": HELLO, "stream": True})
    openai_calls: list[dict[str, Any]] = [{"id": f"c{i}", "type": "function",
                     "function": {"name": n, "arguments": orjson.dumps(a).decode()}}
                    for i, (n, a) in enumerate(calls)]
    completion: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": finish, "message": {
        "role": "assistant", "content": text, "tool_calls": openai_calls}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    whole = style.response(completion, call, "direct:x", "direct")
    assert whole["message"]["content"] == text
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in whole["message"].get("tool_calls", [])] == calls
    assert whole["done_reason"] == ("length" if finish == "length" else "stop")
    assert (whole["prompt_eval_count"], whole["eval_count"]) == (3, 4)
    # Streamed: text in arbitrary fragments, tool-call arguments in arbitrary fragments.
    encoder = style.encoder(call, "direct:x")
    out = b""
    bounds = sorted({0, len(text), *(min(len(text), sum(cuts[:i])) for i in range(len(cuts)))})
    for start, stop in itertools.pairwise(bounds):
        piece = text[start:stop]
        out += encoder.chunk(orjson.dumps({"choices": [{"index": 0,
                                                        "delta": {"content": piece}}]}))
    for i, c in enumerate(openai_calls):
        args = c["function"]["arguments"]
        step = cuts[i % len(cuts)]
        for k, start in enumerate(range(0, max(len(args), 1), step)):
            fragment: dict[str, Any] = {"index": i, "function": {"arguments":
                                                                 args[start:start + step]}}
            if k == 0:
                fragment.update(id=c["id"], type="function")
                fragment["function"]["name"] = c["function"]["name"]
            out += encoder.chunk(orjson.dumps({"choices": [{"index": 0,
                                                            "delta": {"tool_calls": [fragment]}}]}))
    out += encoder.chunk(orjson.dumps({"choices": [{"index": 0, "delta": {},
                                                    "finish_reason": finish}]}))
    out += encoder.end(completion["usage"])
    lines = ndjson(out)
    assert "".join(line["message"]["content"] for line in lines) == text
    tool_lines = [line for line in lines if "tool_calls" in line["message"]]
    assert len(tool_lines) == (1 if calls else 0)
    streamed = tool_lines[0]["message"]["tool_calls"] if calls else []
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == calls
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == whole["done_reason"] and lines[-1]["eval_count"] == 4


def test_error_renderings() -> None:
    style = OllamaStyle()
    error = GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server failed")
    assert orjson.loads(style.error_body(error)) == {"error": "the model server failed"}
    call = style.parse({"model": MODEL, "messages": HELLO})
    assert style.encoder(call, "direct:x").error(error) == b'{"error":"the model server failed"}\n'
    detail = [{"loc": ["body", "model"], "msg": "Field required", "type": "missing"}]
    invalid = GatewayError(ErrorKind.VALIDATION_ERROR, "1 validation error", detail=detail)
    assert orjson.loads(style.error_body(invalid)) == {"error": "1 validation error",
                                                       "detail": detail}


def test_tool_arguments_that_are_not_an_object_are_an_upstream_error() -> None:
    style = OllamaStyle()
    call = style.parse({"model": MODEL, "messages": HELLO})
    bad: dict[str, Any] = {"id": "c1", "type": "function",
                           "function": {"name": "f", "arguments": "[1, 2"}}
    completion = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [bad]}}]}
    with pytest.raises(GatewayError) as caught:
        style.response(completion, call, "direct:x", "direct")
    assert caught.value.kind is ErrorKind.UPSTREAM_ERROR
    # Streamed, the calls go out when the stream ends (here without a finish_reason): the
    # broken call becomes the in-stream error instead of a done line.
    encoder = style.encoder(call, "direct:x")
    fragment = {"index": 0, **bad, "function": {**bad["function"], "arguments": "[1"}}
    out = encoder.chunk(orjson.dumps({"choices": [{"index": 0, "delta": {"content": "a"}}]}))
    out += encoder.chunk(orjson.dumps({"choices": [{"index": 0,
                                                    "delta": {"tool_calls": [fragment]}}]}))
    out += encoder.end(None)
    lines = ndjson(out)
    assert lines[0]["message"]["content"] == "a" and set(lines[-1]) == {"error"}
    assert len(lines) == 2


@pytest.mark.parametrize(("body", "loc"), [
    ({"model": MODEL}, ["body", "messages"]),
    ({"messages": HELLO}, ["body", "model"]),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     ["body", "messages", 0, "role"]),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": "x", "images": ["AAAA"]}]},
     ["body", "messages", 0, "images"]),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["data:x"]}]},
     ["body", "messages", 0, "images", 0]),
    ({"model": MODEL, "messages": HELLO, "format": "xml"}, ["body", "format"]),
    ({"model": MODEL, "messages": HELLO, "options": {"num_predict": -3}},
     ["body", "options", "num_predict"]),
    ({"model": MODEL, "messages": HELLO, "mode": "network"}, ["body", "stream"]),
    ({"model": MODEL, "messages": HELLO, "top_logprobs": 2}, ["body", "top_logprobs"]),
    ({"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]},
     ["body", "messages", 0, "tool_calls", 0, "function", "arguments"]),
])
def test_invalid_requests_are_422(body: dict[str, Any], loc: list[Any]) -> None:
    with pytest.raises(RequestInvalid) as caught:
        OllamaStyle().parse(body)
    assert [item["loc"] for item in caught.value.detail] == [loc]


def test_unknown_fields_are_ignored_like_ollama() -> None:
    call = OllamaStyle().parse({"model": MODEL, "messages": HELLO, "truncate": True,
                                "shift": False, "options": {"num_gpu": 1}})
    assert set(call.openai_body) == {"model", "messages", "stream"}
