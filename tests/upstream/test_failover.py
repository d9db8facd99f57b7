"""Failover before the first byte, against simulators that fail the way a real vLLM does
(issue 18): a dead engine's 500s and its closing port, a stream that fails before its first
event, a full queue's 503. No client sees any of them while another backend can answer, a
dead backend is out of rotation at its first failure (the failure wakes its probe), and a busy
one is not taken for a broken one."""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from proxy.config import BackendSpec
from proxy.simulators.state import STATE
from proxy.upstream.health import Probe
from proxy.upstream.pool import Backend
from proxy.upstream.prober import deep_probe, probe_session
from tests.support.chat import HELLO, post, sse_payloads
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import PROBE_AGENT, SimulatorFactory, sim_requests


def entry(name: str, sim: TestServer, weight: int = 1) -> dict[str, Any]:
    return {"name": name, "kind": "vllm", "url": str(sim.make_url("")).rstrip("/"),
            "models": [MODEL], "weight": weight, "forward_headers": ["x-sim-*"]}


def users_seen(sim: TestServer) -> int:
    """Requests (not probes) the simulator saw; read in-process, so also once its port closed."""
    return sum(r.headers.get("User-Agent") != PROBE_AGENT for r in sim.app[STATE].records)


_CONVERSATIONS = itertools.count()


async def ok(gw: TestServer, stream: bool) -> bool:
    # A new conversation each time: chat pools keep one prefix on one replica, and these tests
    # need their requests spread over the pool.
    messages = [{"role": "user", "content": f"{HELLO[0]['content']} #{next(_CONVERSATIONS)}"}]
    status, _, raw = await post(gw, {"model": MODEL, "messages": messages, "stream": stream})
    if not stream:
        return status == 200 and bool(orjson.loads(raw)["choices"])
    payloads = sse_payloads(raw)
    return status == 200 and payloads[-1] == b"[DONE]" and not any(
        b'"error"' in p for p in payloads)


async def test_a_dead_engine_costs_no_request_and_is_out_at_once(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    dying, other = await simulator(), await simulator()
    gw = await gateway(entry("dying", dying), entry("other", other))
    view = {b.name: b for b in gw.app[ROUTER].backends}["dying"]
    assert all([await ok(gw, i % 2 == 1) for i in range(6)])
    before = users_seen(dying)
    async with aiohttp.ClientSession() as session, session.post(
            dying.make_url("/_sim/engine-death")) as response:
        assert response.status == 204
    results = []
    for i in range(30):  # /health 503, requests 500, then the port closes
        results.append(await ok(gw, i % 2 == 1))
        await asyncio.sleep(0.01)
    assert all(results), results
    assert not view.healthy and view.health.last_probe is not None
    assert not view.health.last_probe[1]  # taken out by its probe ...
    assert view.health.ejected_until is None  # ... not by five failures in a row
    assert users_seen(dying) - before <= 2  # what met it before its probe took it out


async def test_a_stream_that_fails_before_its_first_event_is_retried(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    # 200, then an in-band error before any event: nothing reached the client yet.
    failing, good = await simulator(fail_generation=True), await simulator()
    gw = await gateway(entry("failing", failing, weight=1000), entry("good", good))
    assert await ok(gw, stream=True)
    assert len(await sim_requests(failing)) == 1 and len(await sim_requests(good)) == 1


async def test_a_full_queue_is_retried_elsewhere_and_is_no_failure(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    full = await simulator(max_queued=0)  # vLLM's --max-num-queued-reqs, always reached
    good = await simulator()
    gw = await gateway(entry("full", full, weight=1000), entry("good", good))
    assert all([await ok(gw, i % 2 == 1) for i in range(12)])
    view = {b.name: b for b in gw.app[ROUTER].backends}["full"]
    # Busy is not broken: no failure counted, no probe woken, still in rotation.
    assert view.healthy and view.health.consecutive_failures == 0
    assert view.health.last_probe is not None and view.health.last_probe[1]
    assert len(await sim_requests(full)) >= 10
    status, headers, raw = await post(gw, {"model": MODEL, "messages": HELLO},
                                      headers={"x-sim-status": "503"})
    assert status == 503 and headers["Retry-After"] == "1"  # both full: the client is told
    assert orjson.loads(raw)["error"]["type"] == "unavailable"



async def test_a_busy_engine_passes_its_deep_probe(simulator: SimulatorFactory) -> None:
    """A real generation answered 503 (queue full) or 429 is a live engine; a 500 is not."""
    busy, failing = await simulator(max_queued=0), await simulator(fail_generation=True)
    async with probe_session(2.0) as session:
        for sim, alive in ((busy, True), (failing, False)):
            backend = Backend(BackendSpec(name="b", kind="vllm", models=[MODEL],
                                          url=str(sim.make_url("")).rstrip("/")))
            assert await deep_probe(session, backend) is alive


async def test_an_embedding_servers_deep_probe_asks_for_a_vector(
        simulator: SimulatorFactory) -> None:
    """A vLLM embedding model and a TEI are probed by embedding one word (a chat probe would
    fail on them), and a failing one fails it."""
    vllm = await simulator("vllm", ("e",), runner="pooling")
    tei, failing = await simulator("tei", ("t",)), await simulator("tei", ("t",),
                                                                    fail_generation=True)
    async with probe_session(2.0) as session:
        for sim, spec, alive in (
                (vllm, {"kind": "vllm", "family": "embed", "models": ["e"]}, True),
                (tei, {"kind": "tei", "models": ["t"]}, True),
                (failing, {"kind": "tei", "models": ["t"]}, False)):
            backend = Backend(BackendSpec(name="b", url=str(sim.make_url("")).rstrip("/"),
                                          **spec))
            assert await deep_probe(session, backend) is alive
    assert [r.path for r in vllm.app[STATE].records] == ["/v1/embeddings"]
    assert [r.path for r in tei.app[STATE].records] == ["/embed"]


async def busy_in_band(aiohttp_server: Any) -> TestServer:
    """A vLLM that admitted a stream (200) and then found its queue full: the 503 in-band."""
    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"error": {"message": "The engine is currently busy", '
                             b'"type": "Service Unavailable", "param": null, "code": 503}}\n\n'
                             b"data: [DONE]\n\n")
        return response

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    server: TestServer = await aiohttp_server(app)
    return server


async def test_a_stream_refused_in_band_as_busy_is_retried_and_no_failure(
    aiohttp_server: Any, simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    busy, good = await busy_in_band(aiohttp_server), await simulator()
    gw = await gateway(entry("busy", busy, weight=1000), entry("good", good))
    assert await ok(gw, stream=True)
    view = {b.name: b for b in gw.app[ROUTER].backends}["busy"]
    assert view.health.consecutive_failures == 0 and view.healthy
    alone = await gateway(entry("busy", busy))  # nowhere else to go: the client is told
    status, headers, raw = await post(alone, {"model": MODEL, "messages": HELLO, "stream": True})
    assert status == 503 and headers["Retry-After"] == "1"
    assert orjson.loads(raw)["error"]["type"] == "unavailable"


async def test_an_error_event_mid_stream_is_a_failure_that_wakes_the_probe(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator()
    gw = await gateway(entry("b", sim))
    view = gw.app[ROUTER].backends[0]
    assert view.health.last_probe == (Probe.CHEAP, True)  # the first round's
    status, _, raw = await post(gw, {"model": MODEL, "messages": HELLO, "stream": True},
                                headers={"x-sim-error-after": "3"})
    assert status == 200 and b'"error"' in raw  # the client got content, then the error
    for _ in range(50):
        if view.health.last_probe == (Probe.DEEP, True):
            break
        await asyncio.sleep(0.01)
    # Not a success: the failure had a real generation checked at once (it passed: still in).
    assert view.health.last_probe == (Probe.DEEP, True) and view.healthy


async def test_a_connection_reset_before_the_response_is_retried(
    aiohttp_server: Any, simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    """A server going down resets connections it had accepted: no byte came back, so another
    backend answers."""
    async def reset(request: web.Request) -> web.Response:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        assert sock is not None and request.transport is not None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        request.transport.abort()  # RST, not FIN
        return web.Response()

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", reset)
    app.router.add_get("/health", health)
    resetting: TestServer = await aiohttp_server(app)
    good = await simulator()
    gw = await gateway(entry("resetting", resetting, weight=1000), entry("good", good))
    for stream in (False, True):
        assert await ok(gw, stream)
