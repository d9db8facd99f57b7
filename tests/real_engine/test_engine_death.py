"""One engine's core dies (kill -9 of its EngineCore) under steady traffic through the gateway.

vLLM then answers 500 (`EngineDeadError`) for a moment, its /health says 503, and its port
closes. No client may see an error except the streams that were live on that engine, which end
with an in-band error event; every other request is retried on the other replica before its
first byte, and the dead engine is out of rotation at once, not after a run of errors.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from tests.support.gateway import GatewayFactory
from tests.support.real_engines import SERVED, Engines, backend
from tests.support.vllm_metrics import wait_idle

pytestmark = [pytest.mark.real_engine, pytest.mark.kills_engine,
              pytest.mark.timeout(240, func_only=True)]

log = logging.getLogger(__name__)
SERVED_CHAT = "/v2/served/v1/chat/completions"


@dataclass
class Call:
    stream: bool
    started: float
    status: int = 0
    content: int = 0  # content events received
    error_event: bool = False  # an in-band `data: {"error": ...}`
    done: bool = False  # `data: [DONE]` (streams) or a whole JSON answer
    problem: str = ""  # an exception on the client's side

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error_event and not self.problem


async def one(session: aiohttp.ClientSession, gw: TestServer, stream: bool) -> Call:
    loop = asyncio.get_running_loop()
    call = Call(stream, loop.time())
    body = {"model": SERVED, "messages": [{"role": "user", "content": "go on"}],
            "ignore_eos": True, "stream": stream, "max_tokens": 64 if stream else 8}
    try:
        async with session.post(gw.make_url(SERVED_CHAT), json=body, headers={
                "Authorization": f"Bearer {gw.api_key}"}) as response:  # type: ignore[attr-defined]
            call.status = response.status
            if not stream:
                answer = await response.json()
                call.done = response.status == 200 and bool(answer.get("choices"))
                return call
            async for line in response.content:
                if line.startswith(b'data: {"error"'):
                    call.error_event = True
                elif line.startswith(b"data: [DONE]"):
                    call.done = True
                elif line.startswith(b"data: {") and b'"content":"' in line:
                    call.content += 1
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        call.problem = type(exc).__name__
    return call


async def test_a_dead_core_costs_only_the_streams_live_on_it(
    replicas: Engines, gateway: GatewayFactory
) -> None:
    dying, surviving = replicas[0], replicas[1]
    gw = await gateway(backend(dying), backend(surviving))
    await wait_idle(replicas.replicas)
    gateway_view = {b.name: b for b in gw.app[ROUTER].backends}[dying.name]
    loop = asyncio.get_running_loop()
    calls: list[Call] = []
    stop = asyncio.Event()

    async def steady(stream: bool) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                calls.append(await one(session, gw, stream))

    workers = [asyncio.create_task(steady(stream)) for stream in (True, False) * 3]
    await asyncio.sleep(2.0)  # steady traffic on both replicas
    assert len(calls) > 10 and all(c.ok for c in calls), calls
    dying.kill_core()
    killed = loop.time()
    out_after = None
    while loop.time() - killed < 8.0:  # through the 500s, the /health 503 and the port closing
        if out_after is None and not gateway_view.healthy:
            out_after = loop.time() - killed
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.gather(*workers)

    after = [c for c in calls if c.started > killed]
    failed = [c for c in calls if not c.ok]
    log.warning("engine death: %d calls after the kill, %d failed (live streams); out of "
                "rotation after %s s by %s", len(after), len(failed), out_after,
                gateway_view.health.last_probe)
    assert len(after) > 30 and all(c.ok for c in after), [c for c in after if not c.ok]
    for call in failed:  # only streams that were live on the dead engine, ended in-band
        assert call.stream and call.started < killed, call
        assert call.status == 200 and call.error_event and call.done and not call.problem, call
    assert out_after is not None and out_after < 1.5
    assert not dying.running  # vLLM's API server exits once its engine is dead
