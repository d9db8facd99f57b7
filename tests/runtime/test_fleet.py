"""The fleet as an operator runs it: `serve` (master + workers) with supervised simulators.

Real processes only: the gateway's master and workers, simulators started by its supervisor,
a real redis-server. Covers U1/U3/U4/U6 of reliability.md and the process model of DESIGN §5.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil
import pytest

from proxy.http.sse import SSEDecoder
from tests.support.config_files import MODEL
from tests.support.fleet import (
    ADMIN,
    BODY,
    CHAT,
    REPO,
    Stack,
    admin_backends,
    cmdline,
    gone,
    settled_view,
    simulator,
)
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import SimulatorFactory


async def chat(session: aiohttp.ClientSession, url: str, **extra: Any) -> int:
    async with session.post(url + CHAT, json={**BODY, **extra}) as response:
        await response.read()
        return response.status


async def test_killed_backend_is_restarted_and_traffic_resumes(
    tmp_path: Path, stacks: list[Stack], redis_url: str
) -> None:
    """U3: kill -9 a supervised child: reaped, restarted with backoff, ready, traffic again."""
    stack = Stack(tmp_path, [{**simulator("sim-a"), "cwd": "models"}], workers=2,
                  redis_url=redis_url)
    stacks.append(stack)
    stack.ready()
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/admin/backends") as response:
            assert response.status == 401  # admin only
        before = await settled_view(stack.url, "sim-a", lambda b: b["healthy"])
        assert before["supervised"] and before["state"] == "ready"
        assert before["restarts"] == 0 and before["kind"] == "vllm" and before["models"] == [MODEL]
        assert await chat(session, stack.url) == 200

        victim = psutil.Process(before["pid"])
        # Started as configured: cwd relative to the config folder, env merged over ours.
        assert Path(victim.cwd()) == stack.folder / "models"
        child_env = victim.environ()
        assert child_env["PYTHONPATH"] == str(REPO) and "GATEWAY_ADMIN_TOKEN" in child_env
        victim.kill()
        killed = time.monotonic()
        while await chat(session, stack.url) != 200:
            assert time.monotonic() - killed < 10, "traffic never resumed"
            await asyncio.sleep(0.05)
        resumed = time.monotonic() - killed
    after = await settled_view(stack.url, "sim-a",
                               lambda b: b["pid"] != victim.pid and b["state"] == "ready")
    assert after["state"] == "ready" and after["restarts"] == 1
    # The operator's view of the same, from whichever worker answers (each follows the
    # supervisor's records every 0.5 s).
    wanted = ('igw_backend_restarts_total{backend="sim-a"} 1.0',
              'igw_backend_state{backend="sim-a",state="ready"} 1.0',
              f'igw_backend_up{{backend="sim-a",kind="vllm",model="{MODEL}"}} 1.0')
    deadline = time.monotonic() + 5
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(stack.url + "/metrics") as r:
                scraped = await r.text()
            if all(line in scraped for line in wanted):
                break
            assert time.monotonic() < deadline, [line for line in wanted if line not in scraped]
            await asyncio.sleep(0.1)
    assert gone(victim) and not psutil.pid_exists(victim.pid)  # reaped: no zombie
    assert resumed < 6, resumed
    log = stack.log.read_text()
    # The child's own output is in the gateway's log, tagged with its name, once per start.
    assert log.count("backend.sim-a simulating vllm on") == 2, log


async def test_started_backend_whose_generation_fails_never_gets_traffic(
    tmp_path: Path, stacks: list[Stack], redis_url: str
) -> None:
    """U6: /health says OK but generation fails. A process the gateway started is proven by a
    real one-token generation before its first request, so no user request ever reaches it."""
    stack = Stack(tmp_path, [simulator("good"), simulator("bad", "--fail-generation")],
                  workers=2, redis_url=redis_url)
    stacks.append(stack)
    stack.ready()
    fresh = aiohttp.TCPConnector(force_close=True)  # each request may land on any worker
    async with aiohttp.ClientSession(connector=fresh) as session:
        assert [await chat(session, stack.url) for _ in range(40)] == [200] * 40
        views = await admin_backends(session, stack.url)
        bad_url = views["bad"]["url"]
        assert views["good"]["healthy"] and not views["bad"]["healthy"], views
        assert views["bad"]["state"] == "ready"  # the process is fine: its /health says so
        assert views["bad"]["last_probe"] == {"kind": "deep", "ok": False}
        async with session.get(bad_url + "/_sim/requests") as response:
            seen = await response.json()
    agents = {r["headers"].get("user-agent") for r in seen}
    assert seen and agents == {"inference-gateway-health"}, seen  # probes only


async def test_failing_backend_is_out_at_its_first_failure_and_no_client_sees_it(
    simulator: SimulatorFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """U1: a fronted server (not started by us, so assumed up) that fails every generation
    (500) while its /health says OK. Each failure is retried on the good one before the first
    byte, and the first failure wakes a probe whose real generation fails: out at once, not
    after a run of failures."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", ADMIN["Authorization"].split()[1])
    bad = await simulator(fail_generation=True)
    good = await simulator()
    gw = await gateway(bad, good)  # b0 = bad, b1 = good
    async with aiohttp.ClientSession() as session:
        statuses = []
        for _ in range(40):
            statuses.append(await chat(session, str(gw.make_url("")).rstrip("/")))
            await asyncio.sleep(0.02)  # steady traffic: the woken probe answers meanwhile
        assert statuses == [200] * 40, statuses
        async with session.get(gw.make_url("/admin/backends"), headers=ADMIN) as response:
            views = {b["name"]: b for b in (await response.json())["data"]}
        async with session.get(bad.make_url("/_sim/requests")) as response:
            reached = [r for r in await response.json()
                       if r["headers"].get("user-agent") != "inference-gateway-health"]
    assert not views["b0"]["healthy"] and views["b0"]["last_probe"] == {"kind": "deep",
                                                                         "ok": False}
    assert views["b0"]["ejected_until"] is None  # not by 5 failures in a row: its probe
    assert 1 <= len(reached) <= 2  # what met it before the probe took it out, retried
    assert views["b1"]["healthy"] and views["b1"]["ejected_until"] is None


async def test_all_backends_down_is_a_fast_503(
    tmp_path: Path, stacks: list[Stack], redis_url: str
) -> None:
    """U1: every backend hung (SIGSTOP: connections open, nothing answers) -> 503 at once."""
    stack = Stack(tmp_path, [simulator("a"), simulator("b")], workers=2, redis_url=redis_url,
                  upstream={"connect_timeout_s": 3.0, "first_byte_timeout_s": 10.0})
    stacks.append(stack)
    stack.ready()
    sims = [p for p in stack.tree() if "simulate" in cmdline(p)]
    assert len(sims) == 2
    async with aiohttp.ClientSession() as session:
        for sim in sims:
            sim.suspend()
        try:
            started = time.monotonic()
            while True:
                async with session.get(stack.url + "/readyz") as response:
                    if response.status == 503:
                        assert not (await response.json())["checks"]["backends"]
                        break
                assert time.monotonic() - started < 5, "never noticed the hung backends"
                await asyncio.sleep(0.1)
            for _ in range(10):
                begun = time.monotonic()
                async with session.post(stack.url + CHAT, json=BODY) as response:
                    body = await response.json()
                    took = time.monotonic() - begun
                    assert response.status == 503 and response.headers["Retry-After"] == "1"
                assert body["error"]["type"] == "unavailable"
                assert took < 0.25, f"503 took {took:.3f} s; connect timeout is 3 s"
            for name in ("a", "b"):  # the supervisor's probes time out too
                await settled_view(stack.url, name, lambda b: b["state"] == "unhealthy")
        finally:
            for sim in sims:
                sim.resume()
        started = time.monotonic()
        while await chat(session, stack.url) != 200:
            assert time.monotonic() - started < 8, "traffic never resumed"
            await asyncio.sleep(0.1)


async def _stream(session: aiohttp.ClientSession, url: str, tokens: int,
                  first_event: asyncio.Event) -> list[bytes]:
    """A streamed chat; the data payloads it got, in order."""
    decoder = SSEDecoder()
    payloads: list[bytes] = []
    async with session.post(url + CHAT, json={**BODY, "stream": True},
                            headers={"x-sim-tokens": str(tokens)}) as response:
        assert response.status == 200
        async for chunk in response.content.iter_any():
            payloads += [e.data for e in decoder.feed(chunk)]
            if payloads:
                first_event.set()
    return payloads + [e.data for e in decoder.finish()]


async def test_sigterm_drains_open_streams(
    tmp_path: Path, stacks: list[Stack], redis_url: str
) -> None:
    """U4: SIGTERM with 50 open streams: /readyz 503 and new requests 503 at once; streams that
    fit in the drain finish, the others end with one error event; everything exits in time."""
    drain = 2.0
    stack = Stack(tmp_path, [simulator("slow", "--tokens-per-s", "20")], workers=2,
                  redis_url=redis_url, drain_s=drain)
    stacks.append(stack)
    stack.ready()
    tree = stack.tree()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        events = [asyncio.Event() for _ in range(50)]
        # 25 short streams (1 s: they finish within the drain), 25 long ones (10 s: they don't).
        streams = [asyncio.create_task(_stream(session, stack.url, 20 if i % 2 else 200, e))
                   for i, e in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 10)
        stack.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        await asyncio.sleep(0.3)
        async with session.get(stack.url + "/readyz") as response:
            assert response.status == 503
            assert (await response.json())["checks"]["accepting"] is False
        async with session.post(stack.url + CHAT, json=BODY,
                                headers={"Connection": "close"}) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"
        results = await asyncio.wait_for(asyncio.gather(*streams), drain + 5)
    for i, payloads in enumerate(results):
        assert payloads[-1] == b"[DONE]", payloads
        errors = [p for p in payloads if b'"error"' in p]
        if i % 2:
            assert errors == [], payloads  # finished in time
        else:
            assert len(errors) == 1 and payloads[-2] == errors[0], payloads
            assert orjson.loads(errors[0])["error"]["type"] == "upstream_error"
    assert stack.proc.wait(drain + 2.0 + 5) == 0
    took = time.monotonic() - stopped
    # Drain, then the backends' grace at most (plus slack for a busy machine).
    assert took < drain + 2.0 + 2, (took, stack.log.read_text()[-3000:])
    assert all(gone(p) for p in tree), [(cmdline(p), p.pid) for p in tree if not gone(p)]


async def test_sigkill_of_the_master_leaves_no_child_running(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    """No orphans: workers, supervised backends and the embedded Redis die with the master."""
    stack = Stack(tmp_path, [simulator("sim-a")], workers=2, redis_url=None)
    stacks.append(stack)
    stack.ready()
    tree = stack.tree()
    names = sorted(cmdline(p).split()[0].rsplit("/", 1)[-1] for p in tree)
    assert len(stack.workers()) == 2 and any("redis-server" in n for n in names), names
    stack.proc.kill()
    stack.proc.wait()
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in tree):
        assert time.monotonic() < deadline, [cmdline(p) for p in tree if not gone(p)]
        await asyncio.sleep(0.1)


async def test_a_dead_worker_is_replaced_and_the_others_keep_serving(
    tmp_path: Path, stacks: list[Stack], redis_url: str
) -> None:
    stack = Stack(tmp_path, [simulator("sim-a")], workers=3, redis_url=redis_url)
    stacks.append(stack)
    stack.ready()
    workers = stack.workers()
    assert len(workers) == 3
    outcomes: list[tuple[float, int | str]] = []
    stop = time.monotonic() + 4.0

    async def client() -> None:
        connector = aiohttp.TCPConnector(force_close=True)  # new connections: any worker
        async with aiohttp.ClientSession(connector=connector) as session:
            while time.monotonic() < stop:
                try:
                    outcome: int | str = await chat(session, stack.url)
                except aiohttp.ClientError as exc:  # a request the dead worker was holding
                    outcome = type(exc).__name__
                outcomes.append((time.monotonic(), outcome))

    load = asyncio.gather(*(client() for _ in range(8)))
    await asyncio.sleep(1.0)
    os.kill(workers[0], signal.SIGKILL)
    killed = time.monotonic()
    await load
    failed = [(round(t - killed, 3), o) for t, o in outcomes if o != 200]
    # Only what the dead worker held or had queued fails, as a broken connection, at once.
    assert all(t < 0.5 and isinstance(o, str) for t, o in failed), failed
    assert sum(o == 200 for t, o in outcomes if t > killed + 0.5) > 100
    deadline = time.monotonic() + 10
    while len(stack.workers()) != 3 or workers[0] in stack.workers():
        assert time.monotonic() < deadline, "the dead worker was not replaced"
        await asyncio.sleep(0.1)
    assert re.search(r"worker \d exited \(code -9\); starting a replacement",
                     stack.log.read_text())
