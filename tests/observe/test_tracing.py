"""Traces ([telemetry]): each request is one trace in a real OTLP backend (Phoenix, started by
the `trace_backend` fixture), read back through its query API: the request's server span, its
stages as children, the engine call as a client span whose id went upstream in `traceparent`;
a caller's context continued only when trusted; the sampling ratio, with errors and slow
requests kept whatever it says; the trace id in the access log and as an exemplar on
`/metrics`; an async task's run linked to the request that submitted it; network mode's
replicas one span each; and `serve`'s workers exporting alike."""

from __future__ import annotations

import asyncio
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from proxy.appkeys import TRACING
from proxy.config import TelemetrySection
from proxy.observe.trace import Spans, Trace
from proxy.observe.tracing import Tracing
from proxy.store.redis_process import RedisProcess
from proxy.styles.wire import ChunkFilter
from tests.support.accounts import new_key
from tests.support.config_files import MODEL
from tests.support.fleet import Stack
from tests.support.gateway import settled
from tests.support.processes import free_port, wait_until_ready
from tests.support.trace_backend import SpanRecord, TraceBackend
from tests.support.upstreams import sim_requests

CHAT = "/v2/compat/v1/chat/completions"
ROUTE = "/v2/compat/v1/chat/completions"
PROMPT = "a prompt that must never reach a span"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-(0[01])$")


def telemetry(backend: TraceBackend, **extra: Any) -> dict[str, Any]:
    return {"endpoint": backend.otlp_url, "export_every_s": 0.2, **extra}


async def chat(gw: Any, key: str, *, stream: bool = False, headers: dict[str, str] | None = None,
               **extra: Any) -> tuple[int, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": stream,
            "max_tokens": 8, **extra}
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(CHAT), json=body,
            headers={"X-API-Key": key, **(headers or {})}) as r:
        return r.status, await r.read()


async def sent_traceparents(sim: Any) -> list[tuple[str, str, str]]:
    """(trace id, parent span id, flags) of each request the engine got, in order."""
    found = []
    for record in await sim_requests(sim):
        match = TRACEPARENT.match(record["headers"].get("traceparent", ""))
        assert match, f"no valid traceparent upstream: {record['headers']}"
        found.append((match[1], match[2], match[3]))
    return found


async def trace_of(backend: TraceBackend, trace_id: str, **wanted: Any) -> list[SpanRecord]:
    return await asyncio.to_thread(backend.trace, trace_id, **wanted)


def by_name(spans: list[SpanRecord]) -> dict[str, SpanRecord]:
    return {span["name"]: span for span in spans}


async def test_a_streamed_chat_is_one_trace_with_its_stages(
        gateway: Any, simulator: Any, trace_backend: TraceBackend) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, telemetry=telemetry(trace_backend))
    status, raw = await chat(gw, gw.api_key, stream=True)
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    await settled(gw)
    [(trace_id, client_span, flags)] = await sent_traceparents(sim)
    assert flags == "01"  # sampled (ratio 1): the engine records its spans too
    server_name = f"POST {ROUTE}"
    spans = await trace_of(trace_backend, trace_id, names=[
        server_name, "auth", "admission", "engine slot", f"chat {MODEL}", "settlement"])
    named = by_name(spans)
    server = named[server_name]
    assert server["parent_id"] is None and server["kind"] == "SERVER"
    for name in ("auth", "admission", "engine slot", f"chat {MODEL}", "settlement"):
        assert named[name]["parent_id"] == server["span_id"], name
        assert server["start_time"] <= named[name]["start_time"] <= named[name]["end_time"] \
            <= server["end_time"], name
    call = named[f"chat {MODEL}"]
    assert call["span_id"] == client_span and call["kind"] == "CLIENT"
    # The stages in the order the request went through them.
    order = [named[n]["start_time"] for n in ("auth", "admission", f"chat {MODEL}",
                                                "settlement")]
    assert order == sorted(order)
    attributes = server["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["http.response.status_code"] == 200
    assert attributes["igw.tier"] == "max"
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]  # max_tokens 8
    assert attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert call["attributes"]["igw.backend"] == "b0"
    assert call["attributes"]["gen_ai.usage.output_tokens"] == 8
    # The first call on a new connection: connected, then the answer's head, then its first token.
    assert [e["name"] for e in call["events"]] == ["connected", "response_headers",
                                                 "gen_ai.first_token"]
    # Never the key, the account or the prompt, in any span.
    text = orjson.dumps([s["attributes"] for s in spans]).decode()
    for secret in (gw.api_key, PROMPT, "acct-test"):
        assert secret not in text


@pytest.mark.parametrize("stream", [True, False])
async def test_content_is_captured_only_when_the_operator_asks(
        gateway: Any, simulator: Any, trace_backend: TraceBackend, stream: bool) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, telemetry=telemetry(trace_backend, capture_content=True))
    status, raw = await chat(gw, gw.api_key, stream=stream)
    assert status == 200
    if stream:
        text = "".join(
            orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in raw.splitlines() if line.startswith(b"data: {"))
    else:
        text = orjson.loads(raw)["choices"][0]["message"]["content"]
    assert text
    [(trace_id, _, _)] = await sent_traceparents(sim)
    server = by_name(await trace_of(trace_backend, trace_id, names=[f"POST {ROUTE}"]))[
        f"POST {ROUTE}"]
    attributes = server["attributes"]
    assert orjson.loads(attributes["gen_ai.input.messages"]) == [
        {"role": "user", "content": PROMPT}]
    assert orjson.loads(attributes["gen_ai.output.messages"]) == [{
        "role": "assistant", "parts": [{"type": "text", "content": text}],
        "finish_reason": "length"}]
    assert gw.api_key not in orjson.dumps(attributes).decode()


async def test_a_callers_context_is_continued_only_when_trusted(
        gateway: Any, simulator: Any, trace_backend: TraceBackend) -> None:
    caller_trace, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    header = {"traceparent": f"00-{caller_trace}-{caller_span}-01", "tracestate": "vendor=abc"}
    sim = await simulator("vllm")
    untrusting = await gateway(sim, telemetry=telemetry(trace_backend))
    assert (await chat(untrusting, untrusting.api_key, headers=header))[0] == 200
    [(trace_id, _, _)] = await sent_traceparents(sim)
    assert trace_id != caller_trace  # a new root: a client cannot write into others' traces
    assert "tracestate" not in (await sim_requests(sim))[0]["headers"]
    spans = await trace_of(trace_backend, trace_id, names=[f"POST {ROUTE}"])
    assert by_name(spans)[f"POST {ROUTE}"]["parent_id"] is None

    sim2 = await simulator("vllm")
    trusting = await gateway(sim2, telemetry=telemetry(trace_backend, trust_client_context=True))
    assert (await chat(trusting, trusting.api_key, headers=header))[0] == 200
    [(trace_id, _, flags)] = await sent_traceparents(sim2)
    assert trace_id == caller_trace and flags == "01"
    assert (await sim_requests(sim2))[0]["headers"]["tracestate"] == "vendor=abc"
    spans = await trace_of(trace_backend, caller_trace, names=[f"POST {ROUTE}"])
    assert by_name(spans)[f"POST {ROUTE}"]["parent_id"] == caller_span


@pytest.mark.parametrize("sent", [
    {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"},  # an all-zero trace id
    {"traceparent": "ff-" + "a" * 32 + "-" + "b" * 16 + "-01"},  # a version W3C forbids
    {"traceparent": "00-" + "a" * 4000},
    {"traceparent": "\u00e9t\u00e9", "tracestate": "x" * 4000},
    {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
     "tracestate": ",".join(f"k{i}=v" for i in range(40)) + ",=bad,\u00e9=1"},
])
async def test_a_garbled_callers_context_is_a_new_trace_never_an_error(
        gateway: Any, simulator: Any, trace_backend: TraceBackend, sent: dict[str, str]) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, telemetry=telemetry(trace_backend, trust_client_context=True))
    assert (await chat(gw, gw.api_key, headers=sent))[0] == 200
    [(trace_id, _, _)] = await sent_traceparents(sim)
    headers = (await sim_requests(sim))[0]["headers"]
    if trace_id != "a" * 32:  # refused: a new root, nothing of the caller's passed on
        assert "tracestate" not in headers
    else:  # a valid parent: its tracestate as OpenTelemetry reads it (32 entries at most)
        assert len(headers.get("tracestate", "")) < 1024


async def test_sampling_keeps_errors_and_slow_requests_whatever_the_ratio(
        gateway: Any, simulator: Any, trace_backend: TraceBackend) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, telemetry=telemetry(trace_backend, sample_ratio=0.0,
                                                keep_slower_than_s=0.4))
    assert (await chat(gw, gw.api_key))[0] == 200  # fast and fine: dropped
    assert (await chat(gw, gw.api_key, headers={"x-sim-status": "500"}))[0] == 502
    assert (await chat(gw, gw.api_key, headers={"x-sim-delay-ms": "600"}))[0] == 200
    await settled(gw)
    sent = await sent_traceparents(sim)  # one backend: one exchange per request
    assert [flags for _, _, flags in sent] == ["00", "00", "00"]  # head decision: not sampled
    assert await asyncio.to_thread(gw.app[TRACING].flush)
    fine, failed, slow = (trace_id for trace_id, _, _ in sent)
    failed_spans = await trace_of(trace_backend, failed, names=[f"POST {ROUTE}"])
    server = by_name(failed_spans)[f"POST {ROUTE}"]
    assert server["status"] == "ERROR" and server["attributes"]["error.type"] == "upstream_error"
    await trace_of(trace_backend, slow, names=[f"POST {ROUTE}"])
    assert trace_backend.spans(trace_id=fine) == []  # exported at the same time, if at all


async def test_the_trace_id_is_in_the_access_log_and_an_exemplar_on_metrics(
        gateway: Any, simulator: Any, trace_backend: TraceBackend, tmp_path: Path) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, telemetry=telemetry(trace_backend),
                       settings={"access_log": str(tmp_path / "access.log")})
    assert (await chat(gw, gw.api_key, stream=True))[0] == 200
    await settled(gw)
    [(trace_id, _, _)] = await sent_traceparents(sim)
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.make_url("/metrics"), headers={
                "Accept": "application/openmetrics-text; version=1.0.0"}) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            openmetrics = await r.text()
        async with session.get(gw.make_url("/metrics")) as r:
            plain = await r.text()
    exemplars = {}
    for family in text_string_to_metric_families(openmetrics):
        for sample in family.samples:
            if sample.exemplar is not None and sample.labels.get("route") == ROUTE:
                exemplars[sample.name] = sample
    assert set(exemplars) == {"igw_request_duration_seconds_bucket",
                              "igw_time_to_first_token_seconds_bucket"}
    for sample in exemplars.values():
        assert sample.exemplar.labels == {"trace_id": trace_id}
        assert sample.exemplar.value <= float(sample.labels["le"])
    assert "trace_id" not in plain  # the Prometheus text format has no exemplars
    await asyncio.sleep(0.2)  # the access log's writer gathers lines for 50 ms
    lines = [orjson.loads(line) for line in (tmp_path / "access.log").read_bytes().splitlines()]
    [line] = [line for line in lines if line["route"] == ROUTE]
    assert line["trace_id"] == trace_id
    await trace_of(trace_backend, trace_id, names=[f"POST {ROUTE}"])  # and the trace exists


async def test_an_async_tasks_run_is_linked_to_the_request_that_submitted_it(
        gateway: Any, simulator: Any, trace_backend: TraceBackend) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, telemetry=telemetry(trace_backend, trust_client_context=True))
    caller = secrets.token_hex(16)
    status, raw = await chat(gw, gw.api_key, headers={
        "traceparent": f"00-{caller}-{secrets.token_hex(8)}-01"}, **{"async": True})
    assert status == 202
    task_id = orjson.loads(raw)["task_id"]
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            async with session.get(gw.make_url(f"/v2/tasks/{task_id}"),
                                   headers={"X-API-Key": gw.api_key}) as r:
                if (await r.json())["status"] != "running":
                    break
            await asyncio.sleep(0.05)
    [(run_trace, _, _)] = await sent_traceparents(sim)
    assert run_trace != caller  # the run is its own trace ...
    submitted = by_name(await trace_of(trace_backend, caller, names=[f"POST {ROUTE}"]))
    run = by_name(await trace_of(trace_backend, run_trace,
                                 names=["task chat:openai", f"chat {MODEL}"]))
    consumer = run["task chat:openai"]
    assert consumer["kind"] == "CONSUMER" and consumer["parent_id"] is None
    # ... linked to the request that submitted it.
    assert consumer["links"] == [{"trace_id": caller,
                                  "span_id": submitted[f"POST {ROUTE}"]["span_id"]}]
    assert run[f"chat {MODEL}"]["parent_id"] == consumer["span_id"]


async def test_network_mode_replicas_are_one_client_span_each(
        gateway: Any, simulator: Any, trace_backend: TraceBackend, clean_redis: RedisProcess
        ) -> None:
    sims = [await simulator("vllm"), await simulator("vllm")]
    backends = [{"name": f"net-{i}", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
                 "models": [MODEL], "modes": ["network"]} for i, sim in enumerate(sims)]
    gw = await gateway(*backends, telemetry=telemetry(trace_backend), policies={
        "tiers.toml": '[tiers.guest]\nrequests_per_minute = 10\nfamilies = []\nmodels = {}\n'
                      '[tiers.max]\nrequests_per_minute = 1000\nfamilies = ["chat"]\n'
                      'models = { standard = ["direct", "network"] }\n'})
    key = await new_key(clean_redis.url, "max")
    status, _ = await chat(gw, key, mode="network")
    assert status == 200
    [(trace_id, a, _)], [(trace_id_b, b, _)] = [await sent_traceparents(s) for s in sims]
    assert trace_id == trace_id_b and a != b
    spans = await trace_of(trace_backend, trace_id, names=[f"chat {MODEL}"] * 2)
    calls = [s for s in spans if s["name"] == f"chat {MODEL}"]
    [server] = [s for s in spans if s["parent_id"] is None]
    assert {s["span_id"] for s in calls} == {a, b}
    assert {s["attributes"]["igw.backend"] for s in calls} == {"net-0", "net-1"}
    assert all(s["parent_id"] == server["span_id"] for s in calls)


def test_serve_workers_export_their_traces_and_exemplars(
        tmp_path: Path, clean_redis: RedisProcess, trace_backend: TraceBackend) -> None:
    """Through `serve` with two workers: every request's trace reaches the backend, and the
    scrape (whichever worker answers) carries exemplars from both workers' files."""
    sim_port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "vllm", "--port",
                            str(sim_port), "--model", MODEL])
    stack = Stack(tmp_path, [{"name": "b0", "kind": "vllm",
                              "url": f"http://127.0.0.1:{sim_port}", "models": [MODEL]}],
                  workers=2, redis_url=clean_redis.url,
                  gateway_extra={"access_log": "access.log"}, telemetry=telemetry(trace_backend))
    try:
        wait_until_ready(f"http://127.0.0.1:{sim_port}/health", sim)
        stack.ready()
        key = asyncio.run(new_key(clean_redis.url, "max"))
        for _ in range(6):
            answer = httpx.post(f"{stack.url}{CHAT}", headers={
                "X-API-Key": key, "Connection": "close"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200
        log = stack.folder / "access.log"
        for _ in range(100):
            lines = [orjson.loads(x) for x in log.read_bytes().splitlines()] \
                if log.exists() else []
            traced = [x["trace_id"] for x in lines if x.get("route") == ROUTE]
            if len(traced) == 6:
                break
            time.sleep(0.1)
        assert len(set(traced)) == 6
        for trace_id in traced:
            trace_backend.trace(trace_id, names=[f"POST {ROUTE}", f"chat {MODEL}"])
        text = httpx.get(f"{stack.url}/metrics", headers={
            "Accept": "application/openmetrics-text", "Connection": "close"}).text
        linked = set(re.findall(r'# \{trace_id="([0-9a-f]{32})"\}', text))
        assert linked and linked <= set(traced)
    finally:
        stack.close()
        sim.terminate()
        sim.wait(15)


# --- the pure parts -------------------------------------------------------------------------


def test_the_head_decision_follows_a_trusted_parent_and_the_ratio() -> None:
    never = Tracing(TelemetrySection(endpoint="http://127.0.0.1:9/v1/traces", sample_ratio=0.0,
                                     trust_client_context=True))
    always = Tracing(TelemetrySection(endpoint="http://127.0.0.1:9/v1/traces"))
    try:
        parent = f"00-{'ab' * 16}-{'cd' * 8}-01"
        assert never.begin({"traceparent": parent}).sampled  # the caller sampled it
        assert not never.begin({}).sampled
        assert not never.begin({"traceparent": parent[:-1] + "0"}).sampled
        untrusted = always.begin({"traceparent": parent})
        assert untrusted.parent_id is None and untrusted.trace_id != int("ab" * 16, 16)
        garbled = never.begin({"traceparent": "00-zz-cd-01"})
        assert garbled.parent_id is None and not garbled.sampled
    finally:
        never.shutdown()
        always.shutdown()


@pytest.mark.parametrize(("status", "outcome", "seconds", "kept"), [
    (200, None, 0.1, False), (503, None, 0.1, True), (200, "cut", 0.1, True),
    (429, None, 0.1, False), (200, None, 2.0, True)])
def test_what_the_tail_keeps(status: int, outcome: str | None, seconds: float,
                             kept: bool) -> None:
    tracing = Tracing(TelemetrySection(endpoint="http://127.0.0.1:9/v1/traces",
                                       sample_ratio=0.0, keep_slower_than_s=1.0))
    try:
        trace = Trace("/x", spans=Spans(1, 2, None, False))
        trace.outcome = outcome  # type: ignore[assignment]
        assert tracing.keeps(trace, status, seconds) is kept
    finally:
        tracing.shutdown()


def test_a_streams_finish_reasons_are_read_off_its_bytes() -> None:
    chunks = ChunkFilter("vllm", MODEL, want_usage=False)
    chunks.feed(b'{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}')
    chunks.feed(b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"},'
                b'{"index":1,"delta":{},"finish_reason": "length"}]}')
    assert chunks.reasons == ["stop", "length"]


async def test_the_exporter_counts_what_it_sent_and_what_it_gave_up_on(
        gateway: Any, simulator: Any, trace_backend: TraceBackend) -> None:
    sim = await simulator("vllm")
    up = await gateway(sim, telemetry=telemetry(trace_backend))
    down = await gateway(sim, telemetry={"endpoint": f"http://127.0.0.1:{free_port()}/v1/traces",
                                         "export_every_s": 0.1, "timeout_s": 0.5})
    for gw in (up, down):
        assert (await chat(gw, gw.api_key))[0] == 200

    async def spans_counted(gw: Any) -> dict[str, float]:
        async with aiohttp.ClientSession() as session, session.get(gw.make_url("/metrics")) as r:
            text = await r.text()
        return {outcome: float(value) for outcome, value in re.findall(
            r'^igw_trace_spans_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}

    counted: dict[str, dict[str, float]] = {}
    for _ in range(100):  # the down one retries for its timeout, then gives up
        counted = {"up": await spans_counted(up), "down": await spans_counted(down)}
        if counted["up"].get("sent", 0) >= 6 and counted["down"].get("failed", 0) >= 6:
            break
        await asyncio.sleep(0.1)
    assert counted["up"].get("sent", 0) >= 6 and not counted["up"].get("failed")
    assert counted["down"].get("failed", 0) >= 6 and not counted["down"].get("sent")
