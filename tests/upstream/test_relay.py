"""The relay on its own: a real simulator's answer, taken through `Upstreams.exchange` and sent
to a real client by `relay_stream` or `send_whole`, with no gateway around it. What reaches the
client and what the `Result` says (which is what the meter charges) must agree."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from proxy.config import BackendSpec, UpstreamSection
from proxy.credits.meter import Result
from proxy.observe.metrics import Labels, Metrics
from proxy.outcome import Outcome
from proxy.styles.openai import OpenAIStyle
from proxy.styles.wire import ChunkFilter, upstream_body
from proxy.upstream.client import UpstreamFailure, Upstreams
from proxy.upstream.pool import Backend
from proxy.upstream.relay import relay_stream, send_whole

MODEL = "acme/small-chat"
STYLE = OpenAIStyle()
CALL = STYLE.parse({"model": MODEL, "stream": True,
                    "messages": [{"role": "user", "content": "Hello!"}]})
Relayed = tuple[TestClient[web.Request, web.Application], Result, list[UpstreamFailure]]


@pytest.fixture
async def relayed(simulator: Any, aiohttp_client: Any
                  ) -> Callable[..., Awaitable[Relayed]]:
    """A client of a one-route app that relays a simulator's stream (the simulator's fault
    headers as given), its Result, and the failures the relay raised instead of answering
    (the route answers them 502, as the gateway would after its one retry)."""
    sim = await simulator()
    backend = Backend(BackendSpec(name="b0", kind="vllm", url=str(sim.make_url("")).rstrip("/"),
                                  models=[MODEL]))
    metrics = Metrics(Labels([MODEL], lambda: {"max"}, ["b0"]), CollectorRegistry())
    upstreams = Upstreams(UpstreamSection(idle_timeout_s=0.5), metrics)

    async def start(faults: dict[str, str] | None = None) -> Relayed:
        result = Result(captured=[])
        failures: list[UpstreamFailure] = []

        async def handler(request: web.Request) -> web.StreamResponse:
            body = upstream_body(CALL.openai_body, True, "vllm", 8)
            headers = {"Content-Type": "application/json", **(faults or {})}
            try:
                async with upstreams.exchange(backend, "/v1/chat/completions", body,
                                              headers) as upstream:
                    return await relay_stream(request, upstream,
                                              ChunkFilter("vllm", MODEL, False),
                                              STYLE.encoder(CALL, "direct:t"), {}, result,
                                              max_s=5)
            except UpstreamFailure as failure:
                failures.append(failure)
                return web.Response(status=502)

        app = web.Application()
        app.router.add_post("/", handler)
        client = await aiohttp_client(app)
        return client, result, failures

    yield start
    await upstreams.close()


def events(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


async def test_a_whole_stream_is_relayed_and_counted(relayed: Callable[..., Awaitable[Relayed]]
                                                     ) -> None:
    client, result, failures = await relayed()
    response = await client.post("/")
    raw = await response.read()
    assert response.status == 200 and events(raw)[-1] == b"[DONE]" and failures == []
    assert result.status is Outcome.COMPLETED
    assert result.tally is not None and result.tally.chunks == 8  # the cap the body carried
    assert result.tally.usage is not None and result.tally.usage["completion_tokens"] == 8
    assert b"usage" not in raw  # hidden: the client did not ask for it
    assert b"".join(result.captured or ()) == raw  # an idempotent replay sends exactly this


async def test_a_cut_stream_ends_with_one_error_event_and_counts_what_went_out(
        relayed: Callable[..., Awaitable[Relayed]]) -> None:
    client, result, _ = await relayed({"x-sim-cut-after": "3"})
    response = await client.post("/")
    sent = events(await response.read())
    assert response.status == 200
    errors = [e for e in sent if b'"error"' in e]
    assert len(errors) == 1 and sent[-1] == b"[DONE]"
    assert result.status is Outcome.CUT
    assert result.tally is not None and result.tally.usage is None
    tokens = [e for e in sent[:-1] if b'"error"' not in e
              and orjson.loads(e)["choices"][0]["delta"].get("content")]
    assert result.tally.chunks == len(tokens) == 2  # the role chunk, then two tokens


async def test_a_silent_upstream_times_out_in_band(relayed: Callable[..., Awaitable[Relayed]]
                                                   ) -> None:
    client, result, _ = await relayed({"x-sim-hang-after": "2"})
    response = await client.post("/")
    sent = events(await response.read())
    assert b"upstream_timeout" in b"".join(sent) and sent[-1] == b"[DONE]"
    assert result.status is Outcome.TIMEOUT


async def test_a_failure_before_the_first_event_is_retryable_and_charges_nothing(
        relayed: Callable[..., Awaitable[Relayed]]) -> None:
    client, result, failures = await relayed({"x-sim-error-after": "0"})
    response = await client.post("/")
    assert response.status == 502  # no 200 went out: another backend may still answer
    [failure] = failures
    assert failure.retryable
    assert result.tally is None and result.captured == []


async def test_a_whole_answer_counts_once_it_is_out(aiohttp_client: Any) -> None:
    result = Result(status=Outcome.UPSTREAM_ERROR)

    async def handler(request: web.Request) -> web.StreamResponse:
        result.answered(usage={"prompt_tokens": 1, "completion_tokens": 2})
        assert result.status is Outcome.CLIENT_GONE  # made for the client: charged if it leaves
        return await send_whole(request, web.json_response({"ok": True}), result)

    app = web.Application()
    app.router.add_post("/", handler)
    client = await aiohttp_client(app)
    response = await client.post("/")
    assert await response.json() == {"ok": True}
    assert result.status is Outcome.COMPLETED and result.usage == {
        "prompt_tokens": 1, "completion_tokens": 2}
