"""Upstream simulators: wire formats of TGI and vLLM (protocols.md §2, §3, §8), faults, state.

Real loopback servers through pytest-aiohttp; every expected number is written out, so a
change in the token rule or a dialect quirk fails here first.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient

from proxy.simulators import CHAT_KINDS, SimConfig, build_app, cli
from proxy.simulators.textgen import (
    EOS,
    LENGTH,
    STOP_SEQUENCE,
    TOOL_CALLS,
    count_tokens,
    generate,
    pick_tool,
    prompt_key,
    prompt_tokens,
)

MODEL = "acme/small-chat"
MESSAGES = [
    {"role": "system", "content": "Be brief."},  # 4 + 3
    {"role": "user", "content": "What is the capital of France?"},  # 4 + 7
]
PROMPT_TOKENS = 18
PREFIX = {"tgi": b"data:", "vllm": b"data: "}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "extra": {"type": "object"},
            },
        },
    },
}
Json = dict[str, Any]
MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def make_client(aiohttp_client: Any) -> MakeClient:
    async def make(kind: str, models: tuple[str, ...] = (MODEL,), **config: Any) -> Any:
        client_kwargs = config.pop("client_kwargs", {})
        app = build_app(kind, SimConfig(models=models, **config))
        return await aiohttp_client(app, **client_kwargs)

    return make


def sse_payloads(raw: bytes, kind: str) -> list[bytes]:
    """Split a complete SSE body, checking the dialect's framing byte for byte."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = raw[:-2].split(b"\n\n")
    for event in events:
        assert event.startswith(PREFIX[kind]), event
        assert kind != "tgi" or not event.startswith(b"data: "), event
        assert b"\n" not in event and b"\r" not in event
    return [event[len(PREFIX[kind]) :] for event in events]


def chunks(payloads: list[bytes]) -> list[Json]:
    assert payloads[-1] == b"[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


def content_of(events: list[Json], index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or "" for e in events for c in e["choices"] if c["index"] == index
    )


async def chat(client: Any, body: Json, headers: dict[str, str] | None = None) -> Any:
    return await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, **body}, headers=headers or {}
    )


async def stream(client: Any, kind: str, body: Json, **kw: Any) -> list[Json]:
    resp = await chat(client, {"stream": True, **body}, **kw)
    assert resp.status == 200
    return chunks(sse_payloads(await resp.read(), kind))


# ---------------------------------------------------------------- textgen (pure)


def test_count_tokens_rule() -> None:
    assert count_tokens("") == 0
    assert count_tokens("Hello, world!") == 4
    assert count_tokens("  don't\tpanic ") == 4  # don ' t panic
    assert count_tokens("héllo wörld_2") == 2  # \w is Unicode-aware, _ is a word char
    assert count_tokens('{"city":"Oslo"}') == 9


def test_prompt_tokens_counts_text_parts_and_tool_calls() -> None:
    assert prompt_tokens(MESSAGES) == PROMPT_TOKENS
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "two words"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
            ],
        }
    ]
    assert prompt_tokens(parts) == 4 + 2
    call = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        }
    ]
    assert prompt_tokens(call) == 4 + 10


def test_generate_is_deterministic_and_counts_exactly() -> None:
    key = prompt_key(MODEL, MESSAGES)
    first = generate(key, 7, natural=16)
    assert first == generate(key, 7, natural=16)
    assert first.text != generate(key, 8, natural=16).text
    assert first.text != generate(prompt_key("other", MESSAGES), 7, natural=16).text
    assert (len(first.tokens), first.finish) == (16, EOS)
    assert count_tokens(first.text) == first.completion_tokens == 16
    assert all(t.startswith(" ") and t[1:].isalpha() for t in first.tokens)
    short = generate(key, 7, natural=16, limit=5)
    assert (short.tokens, short.finish) == (first.tokens[:5], LENGTH)
    assert generate(key, 7, natural=4, limit=4).finish == EOS


def test_generate_stop_sequence_cuts_before_the_match() -> None:
    key = prompt_key(MODEL, MESSAGES)
    full = generate(key, 1, natural=16)
    word = full.tokens[5]
    cut_at = full.text.index(word)
    stopped = generate(key, 1, natural=16, stop=["never", word])
    assert (stopped.finish, stopped.stop) == (STOP_SEQUENCE, word)
    assert stopped.text == full.text[:cut_at]
    assert count_tokens(stopped.text) == len(stopped.tokens) == full.text[:cut_at].count(" ")
    # a stop string in the middle of a word keeps the word's prefix as one token
    partial = generate(key, 1, natural=16, stop=[full.tokens[2][:3]])
    assert partial.text == full.text[: full.text.index(full.tokens[2][:3])]
    assert count_tokens(partial.text) == len(partial.tokens)


def test_generate_tool_call_and_reasoning() -> None:
    key = prompt_key(MODEL, MESSAGES)
    tool = pick_tool([WEATHER], "auto")
    assert tool is WEATHER["function"]
    assert pick_tool([WEATHER], "none") is None
    g = generate(key, 0, natural=16, tool=tool)
    assert g.finish == TOOL_CALLS and g.tokens == ()
    assert g.tool_call is not None and g.tool_call.name == "get_weather"
    args = orjson.loads(g.tool_call.arguments)
    assert list(args) == ["city", "days", "metric", "extra"]
    assert isinstance(args["city"], str) and isinstance(args["days"], int)
    assert args["metric"] is True and args["extra"] is None
    assert g.completion_tokens == count_tokens("get_weather" + g.tool_call.arguments)
    assert "".join(g.tool_call.fragments()) == g.tool_call.arguments
    thinking = generate(key, 0, natural=16, reasoning=True)
    assert (len(thinking.reasoning), len(thinking.tokens)) == (8, 16)
    assert thinking.completion_tokens == 24
    capped = generate(key, 0, natural=16, limit=10, reasoning=True)
    assert (len(capped.reasoning), len(capped.tokens), capped.finish) == (8, 2, LENGTH)


# ---------------------------------------------------------------- chat, both dialects


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_chat_non_stream_shape_and_usage(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    resp = await chat(client, {"model": MODEL})
    assert resp.status == 200 and resp.content_type == "application/json"
    body = await resp.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    assert count_tokens(choice["message"]["content"]) == 16
    assert body["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["total_tokens"] == PROMPT_TOKENS + 16
    if kind == "tgi":
        assert body["id"] == "" and body["system_fingerprint"] == "3.3.7-native"
        assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert resp.headers["x-prompt-tokens"] == str(PROMPT_TOKENS)
        assert resp.headers["x-generated-tokens"] == "16"
        assert "stop_reason" not in choice
    else:
        assert body["id"].startswith("chatcmpl-") and len(body["id"]) == 9 + 32
        assert body["usage"]["prompt_tokens_details"] is None
        assert choice["stop_reason"] is None and choice["message"]["reasoning"] is None


async def test_tgi_chat_stream_framing(make_client: MakeClient) -> None:
    client = await make_client("tgi")
    resp = await chat(client, {"stream": True, "max_tokens": 3})
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["X-Accel-Buffering"] == "no"
    raw = await resp.read()
    assert raw.endswith(b"\n\ndata:[DONE]\n\n")
    events = chunks(sse_payloads(raw, "tgi"))
    assert len(events) == 3  # no role chunk, no separate finish chunk, no usage chunk
    for event in events:
        assert (
            event["id"] == ""
            and event["usage"] is None
            and event["object"] == ("chat.completion.chunk")
        )
        choice = event["choices"][0]
        assert choice["delta"]["role"] == "assistant" and choice["logprobs"] is None
        assert count_tokens(choice["delta"]["content"]) == 1
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]


async def test_vllm_chat_stream_framing(make_client: MakeClient) -> None:
    client = await make_client("vllm")
    resp = await chat(client, {"stream": True, "max_tokens": 3})
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    raw = await resp.read()
    assert raw.startswith(b"data: {") and raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = chunks(sse_payloads(raw, "vllm"))
    assert len(events) == 4  # role, 3 tokens: vLLM 0.32 ends on the last token's chunk
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (events[0]["prompt_token_ids"], events[0]["prompt_text"]) == (None, None)
    assert all("usage" not in e and e["id"] == events[0]["id"] for e in events)
    assert [list(e["choices"][0]["delta"]) for e in events[1:4]] == [["content"]] * 3
    assert all(e["choices"][0]["token_ids"] is None for e in events[1:])
    last = events[-1]["choices"][0]
    assert last["delta"]["content"] and last["token_ids"] is None
    assert (last["finish_reason"], last["stop_reason"]) == ("length", None)
    # The fingerprint rides on the last chunk only (the usage chunk's when there is one).
    assert [e.get("system_fingerprint", "") for e in events][:-1] == ["", "", ""]
    assert events[-1]["system_fingerprint"].startswith("vllm-0.32.0-")
    # An end of sequence (here the natural length, 16, within the cap) gets its own chunk.
    events = chunks(sse_payloads(await (await chat(client, {"stream": True})).read(), "vllm"))
    assert len(events) == 18 and events[-1]["choices"][0]["delta"] == {"content": ""}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_stream_matches_non_stream_and_usage_chunk(
    make_client: MakeClient, kind: str
) -> None:
    client = await make_client(kind)
    whole = await (await chat(client, {"seed": 3})).json()
    events = await stream(client, kind, {"seed": 3, "stream_options": {"include_usage": True}})
    assert content_of(events) == whole["choices"][0]["message"]["content"]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 16,
        "total_tokens": PROMPT_TOKENS + 16,
    }
    assert all(e["choices"] for e in events[:-1])
    without = await stream(client, kind, {"seed": 3, "stream_options": {"include_usage": False}})
    assert all(e["choices"] for e in without) and content_of(without) == content_of(events)


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_seed_determinism(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)

    async def text(seed: int) -> str:
        body = await (await chat(client, {"seed": seed})).json()
        return str(body["choices"][0]["message"]["content"])

    assert await text(7) == await text(7)
    assert await text(7) != await text(8)


@pytest.mark.parametrize(("kind", "finish"), [("tgi", "stop_sequence"), ("vllm", "stop")])
async def test_stop_sequences(make_client: MakeClient, kind: str, finish: str) -> None:
    client = await make_client(kind)
    full = (await (await chat(client, {})).json())["choices"][0]["message"]["content"]
    word = full.split()[4]
    body = await (await chat(client, {"stop": [word]})).json()
    choice = body["choices"][0]
    expected = full[: full.index(word)].rstrip()
    assert choice["message"]["content"] == expected
    assert choice["finish_reason"] == finish
    assert body["usage"]["completion_tokens"] == count_tokens(expected)
    if kind == "vllm":
        assert choice["stop_reason"] == word
    events = await stream(client, kind, {"stop": word})
    assert content_of(events) == expected
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == [
        finish
    ]


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_max_completion_tokens_and_x_sim_tokens(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind, default_completion_tokens=6)
    body = await (await chat(client, {"max_completion_tokens": 4})).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    body = await (await chat(client, {"max_tokens": 50})).json()
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (6, "stop")
    body = await (await chat(client, {}, {"x-sim-tokens": "2"})).json()
    assert count_tokens(body["choices"][0]["message"]["content"]) == 2


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_n_choices(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    body = await (await chat(client, {"n": 2, "max_tokens": 5, "seed": 1})).json()
    texts = [c["message"]["content"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1] and texts[0] != texts[1]
    assert body["usage"]["completion_tokens"] == 10
    single = await (await chat(client, {"max_tokens": 5, "seed": 2})).json()
    assert single["choices"][0]["message"]["content"] == texts[1]  # choice i uses seed + i
    events = await stream(client, kind, {"n": 2, "max_tokens": 5, "seed": 1})
    assert [content_of(events, 0), content_of(events, 1)] == texts


async def test_tool_call_tgi_quirks(make_client: MakeClient) -> None:
    client = await make_client("tgi")
    body = await (await chat(client, {"tools": [WEATHER]})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "content" not in choice["message"]
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "0" and call["type"] == "function"
    assert call["function"]["description"] is None and call["function"]["name"] == "get_weather"
    assert set(orjson.loads(call["function"]["arguments"])) == {"city", "days", "metric", "extra"}
    assert body["usage"]["completion_tokens"] == count_tokens(
        "get_weather" + call["function"]["arguments"]
    )
    events = await stream(client, "tgi", {"tools": [WEATHER]})
    calls = [e["choices"][0]["delta"]["tool_calls"][0] for e in events]
    assert all(c["id"] == "0" and c["type"] == "function" for c in calls)
    assert [c["function"]["name"] for c in calls] == ["get_weather"] + [None] * (len(calls) - 1)
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    none = await (await chat(client, {"tools": [WEATHER], "tool_choice": "none"})).json()
    assert "tool_calls" not in none["choices"][0]["message"]
    rejected = await chat(client, {"tools": [WEATHER], "response_format": {"type": "json"}})
    assert rejected.status == 422
    assert (await rejected.json())["error_type"] == "tool_error"


async def test_tool_call_vllm(make_client: MakeClient) -> None:
    client = await make_client("vllm")
    other = {"type": "function", "function": {"name": "noop", "parameters": {}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = await (await chat(client, {"tools": [other, WEATHER], "tool_choice": named})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["function"]["name"] == "get_weather"
    events = await stream(client, "vllm", {"tools": [other, WEATHER], "tool_choice": named})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first = events[1]["choices"][0]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and "id" in first
    rest = [e["choices"][0]["delta"]["tool_calls"][0] for e in events[2:-1]]
    assert all(set(c) == {"index", "function"} for c in rest)
    assert "".join(c["function"]["arguments"] for c in rest) == call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-1]["choices"][0]["delta"] == {}


async def test_vllm_reasoning(make_client: MakeClient) -> None:
    client = await make_client("vllm")
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    body = await (await chat(client, kwargs)).json()
    assert count_tokens(body["choices"][0]["message"]["reasoning"]) == 8
    assert body["usage"]["completion_tokens"] == 24
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    events = await stream(client, "vllm", {**kwargs, "stream_options": {"include_usage": True}})
    reasoning = "".join(
        e["choices"][0]["delta"].get("reasoning", "") for e in events if e["choices"]
    )
    assert reasoning == body["choices"][0]["message"]["reasoning"]
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    tgi = await make_client("tgi")
    assert (await (await chat(tgi, kwargs)).json())["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_logprobs(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    body = await (await chat(client, {"logprobs": True, "top_logprobs": 2, "max_tokens": 3})).json()
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3 and all(len(e["top_logprobs"]) == 2 for e in entries)
    assert all(e["logprob"] <= 0 for e in entries)
    assert ("bytes" in entries[0]) is (kind == "vllm")
    if kind == "vllm":
        assert bytes(entries[0]["bytes"]).decode() == entries[0]["token"]
    events = await stream(client, kind, {"logprobs": True, "max_tokens": 3})
    streamed = [
        c["logprobs"]["content"][0]["token"] for e in events for c in e["choices"] if c["logprobs"]
    ]
    assert "".join(streamed) == "".join(e["token"] for e in entries)


async def test_model_resolution(make_client: MakeClient) -> None:
    vllm = await make_client("vllm", models=("a/one", "b/two"))
    assert (await (await chat(vllm, {"model": "b/two"})).json())["model"] == "b/two"
    assert (await (await chat(vllm, {})).json())["model"] == "a/one"
    missing = await chat(vllm, {"model": "x/y"})
    assert missing.status == 404
    assert await missing.json() == {
        "error": {
            "message": "The model `x/y` does not exist. Valid aliases: a/one, b/two.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    tgi = await make_client("tgi", models=("a/one", "b/two"))
    for name in ("tgi", "whatever/else", None):
        body = await (await chat(tgi, {"model": name} if name else {})).json()
        assert body["model"] == "a/one"


async def test_bad_requests_in_each_servers_shape(make_client: MakeClient) -> None:
    vllm, tgi = await make_client("vllm"), await make_client("tgi")
    for payload in (
        b"{not json",
        b'{"messages": "hi"}',
        b'{"messages": [], "n": 1}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
    ):
        resp = await vllm.post(
            "/v1/chat/completions", data=payload, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, None)
    syntax = await tgi.post(
        "/v1/chat/completions", data=b"{oops", headers={"Content-Type": "application/json"}
    )
    assert syntax.status == 400 and syntax.content_type == "text/plain"
    typed = await tgi.post("/v1/chat/completions", json={"messages": [{"role": 1}]})
    assert typed.status == 422 and typed.content_type == "text/plain"
    value = await chat(tgi, {"max_tokens": 0})
    assert value.status == 422 and (await value.json())["error_type"] == "validation"
    plain = await tgi.post("/v1/chat/completions", data=b"{}")
    assert plain.status == 415


ODD_CHAT_BODIES: list[object] = [
    [],
    "text",
    None,
    {"messages": [1]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [1, {"type": "text", "text": 3}]}]},
    {"messages": MESSAGES, "stop": 5},
    {"messages": MESSAGES, "stop": [1]},
    {"messages": MESSAGES, "n": 0},
    {"messages": MESSAGES, "n": True},
    {"messages": MESSAGES, "seed": -1},
    {"messages": MESSAGES, "seed": 2**64 - 1},
    {"messages": MESSAGES, "tools": [1, {"function": 3}]},
    {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": {"function": "x"}},
    {
        "messages": MESSAGES,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"properties": {"a": 3, "b": {"type": ["null", "string"]}}},
                },
            }
        ],
    },
    {"messages": MESSAGES, "stream_options": 3},
    {"messages": MESSAGES, "stream": "yes"},
    {"messages": MESSAGES, "max_tokens": 1.5},
    {"messages": MESSAGES, "top_logprobs": 50},
    {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}, "max_tokens": 1},
    {
        "messages": [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": 1, "arguments": {}}}, 7],
            }
        ]
    },
]
ODD_GENERATE_BODIES: list[object] = [
    {"inputs": "x", "parameters": 3},
    {"inputs": "x", "parameters": {"stop": "a"}},
    {"inputs": "x", "parameters": {"top_n_tokens": -1}},
    {"inputs": ""},
    {"inputs": "x", "parameters": {"max_new_tokens": 1.5}},
    {"inputs": "x", "parameters": {"temperature": 0}},
    {"inputs": ["x"]},
]


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_odd_input_never_gives_a_server_error(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    for body in ODD_CHAT_BODIES:
        for stream_flag in (False, True):
            payload = {**body, "stream": stream_flag} if isinstance(body, dict) else body
            resp = await client.post("/v1/chat/completions", json=payload)
            assert resp.status < 500, (body, resp.status, await resp.text())
            await resp.read()
    if kind == "tgi":
        for body in ODD_GENERATE_BODIES:
            for path in ("/generate", "/generate_stream", "/"):
                resp = await client.post(path, json=body)
                assert resp.status < 500, (path, body, resp.status)
                await resp.read()
    stats = await (await client.get("/_sim/stats")).json()
    assert stats["in_flight"] == 0


# ---------------------------------------------------------------- faults


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_fault_status_and_retry_after(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    resp = await chat(client, {}, {"x-sim-status": "503", "x-sim-retry-after": "7"})
    assert resp.status == 503 and resp.headers["Retry-After"] == "7"
    body = await resp.json()
    if kind == "tgi":
        assert body == {"error": "unhealthy", "error_type": "healthcheck"}
        for status, error_type in ((429, "overloaded"), (424, "generation"), (422, "validation")):
            resp = await chat(client, {}, {"x-sim-status": str(status)})
            assert resp.status == status and (await resp.json())["error_type"] == error_type
    else:
        assert body["error"]["code"] == 503 and body["error"]["param"] is None
        resp = await chat(client, {}, {"x-sim-status": "500"})
        assert (await resp.json())["error"]["type"] == "InternalServerError"
    bad = await chat(client, {}, {"x-sim-status": "200"})
    assert bad.status == 400 and "x-sim-status" in await bad.text()


async def test_fault_delay_and_gzip(make_client: MakeClient) -> None:
    client = await make_client("vllm", client_kwargs={"auto_decompress": False})
    started = time.monotonic()
    resp = await chat(client, {}, {"x-sim-delay-ms": "200", "x-sim-gzip": "1"})
    assert time.monotonic() - started >= 0.2
    assert resp.headers["Content-Encoding"] == "gzip"
    raw = await resp.read()
    assert raw[:2] == b"\x1f\x8b"
    assert orjson.loads(gzip.decompress(raw))["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_fault_refuse(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    with pytest.raises(aiohttp.ClientConnectionError):
        await chat(client, {}, {"x-sim-refuse": "1"})
    records = await (await client.get("/_sim/requests")).json()
    assert records[-1]["outcome"] == "cut"


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_fault_cut_after(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    resp = await chat(client, {"stream": True}, {"x-sim-cut-after": "3"})
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for chunk in resp.content.iter_any():
            received += chunk
    assert len(sse_payloads(received, kind)) == 3
    assert b"[DONE]" not in received


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_fault_hang_after(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind)
    resp = await chat(client, {"stream": True}, {"x-sim-hang-after": "2"})
    for _ in range(2):
        await resp.content.readuntil(b"\n\n")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.3)
    resp.close()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(chat(client, {}, {"x-sim-hang-after": "0"}), 0.3)
    await wait_for_stats(client, cancelled=2)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (
            "tgi",
            b'data:{"error":{"message":"simulated error after 2 events",'
            b'"http_status_code":422}}\n\ndata:[DONE]\n\n',
        ),
        (
            "vllm",
            b'data: {"error":{"message":"simulated error after 2 events",'
            b'"type":"InternalServerError","param":null,"code":500}}\n\ndata: [DONE]\n\n',
        ),
    ],
)
async def test_fault_error_after(make_client: MakeClient, kind: str, expected: bytes) -> None:
    client = await make_client(kind)
    resp = await chat(client, {"stream": True}, {"x-sim-error-after": "2"})
    assert resp.status == 200
    raw = await resp.read()
    assert len(sse_payloads(raw, kind)) == 4 and raw.endswith(expected)
    records = await (await client.get("/_sim/requests")).json()
    assert records[-1]["outcome"] == "error"


async def wait_for_stats(client: Any, **expected: int) -> Json:
    for _ in range(40):
        stats: Json = await (await client.get("/_sim/stats")).json()
        if all(stats[k] == v for k, v in expected.items()):
            return stats
        await asyncio.sleep(0.025)
    raise AssertionError(f"stats never reached {expected}: {stats}")


@pytest.mark.parametrize("kind", CHAT_KINDS)
async def test_client_disconnect_is_cancelled(make_client: MakeClient, kind: str) -> None:
    client = await make_client(kind, tokens_per_s=20)
    resp = await chat(client, {"stream": True})
    await resp.content.readuntil(b"\n\n")
    assert (await wait_for_stats(client, in_flight=1))["cancelled"] == 0
    resp.close()
    assert await wait_for_stats(client, in_flight=0, cancelled=1, total=1)
    records = await (await client.get("/_sim/requests")).json()
    assert records[0]["outcome"] == "cancelled"
    metrics = await (await client.get("/metrics")).text()
    if kind == "tgi":
        assert 'tgi_request_failure{err="dropped"} 1' in metrics
    else:
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",' in metrics


async def test_pacing_ttft_and_tokens_per_s(make_client: MakeClient) -> None:
    client = await make_client("vllm", ttft_ms=100, tokens_per_s=10)
    started = time.monotonic()
    resp = await chat(client, {"stream": True, "max_tokens": 4})
    await resp.content.readuntil(b"\n\n")
    first = time.monotonic() - started
    await resp.read()
    total = time.monotonic() - started
    assert 0.1 <= first < 0.3  # the first token does not wait for the others
    assert total >= 0.1 + 3 / 10
    started = time.monotonic()
    await (await chat(client, {"max_tokens": 4})).json()
    assert time.monotonic() - started >= 0.1 + 3 / 10


# ---------------------------------------------------------------- TGI native routes


async def test_tgi_generate(make_client: MakeClient) -> None:
    client = await make_client("tgi")
    request = {"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 4}}
    resp = await client.post("/generate", json=request)
    body = await resp.json()
    assert list(body) == ["generated_text"]  # details only when asked
    assert count_tokens(body["generated_text"]) == 4
    assert resp.headers["x-prompt-tokens"] == "5" and resp.headers["x-generated-tokens"] == "4"
    assert resp.headers["x-compute-type"] == "gpu+optimized"
    assert {"x-total-time", "x-queue-time", "x-time-per-token"} <= set(resp.headers)
    detailed = {
        "inputs": request["inputs"],
        "parameters": {"max_new_tokens": 4, "details": True, "seed": 5, "top_n_tokens": 2},
    }
    body = await (await client.post("/generate", json=detailed)).json()
    details = body["details"]
    assert (details["finish_reason"], details["generated_tokens"], details["seed"]) == (
        "length",
        4,
        5,
    )
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]
    assert all(t["special"] is False for t in details["tokens"])
    assert [len(top) for top in details["top_tokens"]] == [2] * 4
    natural = await (await client.post("/generate", json={"inputs": "x"})).json()
    assert count_tokens(natural["generated_text"]) == 16
    compat = await client.post("/", json=request)
    assert await compat.json() == [
        {
            "generated_text": (await (await client.post("/generate", json=request)).json())[
                "generated_text"
            ]
        }
    ]
    bad = await client.post("/generate", json={"inputs": "x", "parameters": {"stop": ["a"] * 5}})
    assert bad.status == 422 and (await bad.json())["error_type"] == "validation"
    missing = await client.post("/generate", json={"parameters": {}})
    assert missing.status == 422 and missing.content_type == "text/plain"


async def test_tgi_generate_stream(make_client: MakeClient) -> None:
    client = await make_client("tgi")
    request = {
        "inputs": "What is Deep Learning?",
        "parameters": {"max_new_tokens": 3, "details": True},
    }
    resp = await client.post("/generate_stream", json=request)
    assert resp.headers["Content-Type"] == "text/event-stream"
    raw = await resp.read()
    assert b"[DONE]" not in raw
    events = [orjson.loads(p) for p in sse_payloads(raw, "tgi")]
    assert [e["index"] for e in events] == [1, 2, 3]
    assert [e["generated_text"] for e in events[:2]] == [None, None]
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"] == {
        "finish_reason": "length",
        "generated_tokens": 3,
        "seed": None,
        "input_length": 5,
    }
    plain = await client.post("/generate_stream", json={"inputs": "hi"})
    last = [orjson.loads(p) for p in sse_payloads(await plain.read(), "tgi")][-1]
    assert last["details"] is None and last["generated_text"] is not None
    compat = await client.post("/", json={**request, "stream": True})
    assert sse_payloads(await compat.read(), "tgi")[-1].startswith(b'{"index":3,')


async def test_tgi_generate_stream_errors_in_band(make_client: MakeClient) -> None:
    client = await make_client("tgi")
    invalid = await client.post(
        "/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 0}}
    )
    assert invalid.status == 200
    assert await invalid.read() == (
        b'data:{"error":"Input validation error: `max_new_tokens` must be strictly positive",'
        b'"error_type":"validation"}\n\n'
    )
    resp = await client.post(
        "/generate_stream", json={"inputs": "x"}, headers={"x-sim-error-after": "1"}
    )
    payloads = sse_payloads(await resp.read(), "tgi")
    assert len(payloads) == 2
    assert orjson.loads(payloads[1]) == {
        "error": "simulated error after 1 events",
        "error_type": "generation",
    }


async def test_tgi_overload(make_client: MakeClient) -> None:
    client = await make_client("tgi", max_concurrency=1, ttft_ms=300)
    first = asyncio.ensure_future(chat(client, {}))
    await wait_for_stats(client, in_flight=1)
    busy = await chat(client, {})
    assert busy.status == 429
    assert await busy.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    in_band = await chat(client, {"stream": True})
    assert in_band.status == 200
    assert await in_band.read() == (
        b'data:{"error":{"message":"Model is overloaded",'
        b'"http_status_code":422}}\n\ndata:[DONE]\n\n'
    )
    assert (await first).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'tgi_request_failure{err="overloaded"} 2' in metrics
    assert "tgi_request_success 1\n" in metrics and "tgi_request_count 3\n" in metrics


async def test_vllm_queues_instead_of_429(make_client: MakeClient) -> None:
    client = await make_client("vllm", max_concurrency=1, ttft_ms=300)
    both = asyncio.gather(chat(client, {}), chat(client, {}))
    await wait_for_stats(client, in_flight=2)
    metrics = await (await client.get("/metrics")).text()
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 1.0' in metrics
    assert f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0' in metrics
    assert [r.status for r in await both] == [200, 200]


@pytest.mark.parametrize(("kind", "status"), [("tgi", 424), ("vllm", 500)])
async def test_fail_generation_keeps_health_ok(
    make_client: MakeClient, kind: str, status: int
) -> None:
    client = await make_client(kind, fail_generation=True)
    assert (await client.get("/health")).status == 200
    resp = await chat(client, {})
    assert resp.status == status
    body = await resp.json()
    assert body["error_type"] == "generation" if kind == "tgi" else body["error"]["code"] == 500
    raw = await (await chat(client, {"stream": True})).read()
    payloads = sse_payloads(raw, kind)
    assert b'"error"' in payloads[0] and payloads[-1] == b"[DONE]"
    if kind == "tgi":
        generate = await client.post("/generate", json={"inputs": "x"})
        assert generate.status == 424


# ---------------------------------------------------------------- health, info, models, metrics


async def test_tgi_info_health_models_metrics(make_client: MakeClient) -> None:
    client = await make_client("tgi", models=("org/first", "org/second"), max_concurrency=7)
    health = await client.get("/health")
    assert health.status == 200 and await health.read() == b""
    info = await (await client.get("/info")).json()
    assert info["model_id"] == "org/first" and info["max_concurrent_requests"] == 7
    assert {"max_input_tokens", "max_total_tokens", "version", "router"} <= set(info)
    assert await (await client.get("/v1/models")).json() == {
        "object": "list",
        "data": [{"id": "org/first", "object": "model", "created": 0, "owned_by": "org/first"}],
    }
    await chat(client, {})
    metrics = await (await client.get("/metrics")).text()
    assert "tgi_request_count 1\n" in metrics and "tgi_request_success 1\n" in metrics
    assert not re.search(r"_total[{ ]", metrics) and "tgi_queue_size 0\n" in metrics
    await client.post("/_sim/health", json={"healthy": False})
    down = await client.get("/health")
    assert down.status == 503
    assert await down.json() == {"error": "unhealthy", "error_type": "healthcheck"}


async def test_vllm_health_models_version_metrics(make_client: MakeClient) -> None:
    client = await make_client("vllm", models=("org/first", "org/second"))
    health = await client.get("/health")
    assert health.status == 200 and await health.read() == b""
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["org/first", "org/second"]
    entry = models["data"][0]
    assert (entry["owned_by"], entry["root"], entry["parent"]) == ("vllm", "org/first", None)
    assert entry["permission"][0]["object"] == "model_permission"
    assert "version" in await (await client.get("/version")).json()
    await chat(client, {"model": "org/second", "max_tokens": 4})
    metrics = await (await client.get("/metrics")).text()
    labels = 'engine="0",model_name="org/first"'
    assert f"vllm:prompt_tokens_total{{{labels}}} {float(PROMPT_TOKENS)}" in metrics
    assert f"vllm:generation_tokens_total{{{labels}}} 4.0" in metrics
    reason = 'engine="0",finished_reason="length",model_name="org/first"'  # alphabetical
    assert f"vllm:request_success_total{{{reason}}} 1.0" in metrics
    await client.post("/_sim/health", json={"healthy": False})
    down = await client.get("/health")
    assert down.status == 503 and await down.read() == b""


# ---------------------------------------------------------------- introspection, app, CLI


async def test_sim_requests_stats_and_reset(make_client: MakeClient) -> None:
    client = await make_client("vllm")
    await chat(client, {"max_tokens": 2}, {"X-Custom-Header": "Yes"})
    (record,) = await (await client.get("/_sim/requests")).json()
    assert record["path"] == "/v1/chat/completions" and record["outcome"] == "completed"
    assert record["headers"]["x-custom-header"] == "Yes"
    assert record["body"] == {"messages": MESSAGES, "max_tokens": 2}
    assert await (await client.get("/_sim/stats")).json() == {
        "in_flight": 0,
        "total": 1,
        "cancelled": 0,
    }
    assert (await client.post("/_sim/reset")).status == 204
    assert await (await client.get("/_sim/requests")).json() == []
    assert (await (await client.get("/_sim/stats")).json())["total"] == 0


async def test_startup_delay_keeps_port_closed(make_client: MakeClient) -> None:
    started = time.monotonic()
    client = await make_client("tgi", startup_delay_s=0.2)
    assert time.monotonic() - started >= 0.2
    assert (await client.get("/health")).status == 200


def test_build_app_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown simulator kind"):
        build_app("ollama", SimConfig(models=(MODEL,)))
    with pytest.raises(ValueError, match="at least one model"):
        build_app("tgi", SimConfig(models=()))


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "vllm",
            "--model",
            "a/b",
            "--model",
            "c/d",
            "--ttft-ms",
            "5",
            "--fail-generation",
            "--completion-tokens",
            "3",
        ]
    )
    assert args.port is None and args.host == "127.0.0.1"
    assert cli.config_from(args) == SimConfig(
        models=("a/b", "c/d"), ttft_ms=5.0, fail_generation=True, default_completion_tokens=3
    )
    defaults = cli.config_from(parser.parse_args(["tgi"]))
    assert defaults == SimConfig(models=("acme/small-chat",))
    assert (cli.DEFAULT_PORTS["tgi"], cli.DEFAULT_PORTS["vllm"]) == (3000, 8000)
