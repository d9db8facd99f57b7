"""The dispatcher (proxy.upstream.dispatch) on a real gateway, a real Redis and a vLLM simulator
whose batch is one request and whose own queue is none (a second request in flight would be
answered 503 by it): the engine never sees more than its slots, Max runs before a Basic burst,
accounts of one tier take turns, a tier past its longest wait is shed at once, a client that
leaves the queue is never run, and two gateways share the slots and the tier order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.upstream.signals import parse_signals
from proxy.upstream.slots import LAPSE_S, SlotLedger, Taken
from tests.support.accounts import funded_key, new_key
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.media_stack import PRICES, TTS_MODEL
from tests.support.redis_servers import RedisProcess
from tests.support.upstreams import SimulatorFactory, sim_requests

CHAT = "/v2/compat/v1/chat/completions"


def tiers(basic_wait: float = 30.0, families: str = '"chat"', headroom: float = 0.0) -> str:
    return "".join(f"""
[tiers.{name}]
requests_per_minute = 10000
families = [{families}]
models = {{ "*" = ["direct"] }}
priority = {priority}
max_queue_wait_s = {wait}
headroom = {headroom if priority < 2 else 0}
""" for name, priority, wait in [("guest", 0, 2), ("basic", 1, basic_wait), ("pro", 2, 30),
                                  ("max", 3, 30)])


async def one_slot(simulator: SimulatorFactory, gateway: GatewayFactory, *, count: int = 1,
                   basic_wait: float = 30.0) -> tuple[TestServer, list[TestServer]]:
    """An engine that runs one request at a time and queues none, behind `count` gateways."""
    sim = await simulator(ttft_ms=300, tokens_per_s=200, max_concurrency=1, max_queued=1,
                          default_completion_tokens=8)
    backend = {"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
               "models": [MODEL], "max_concurrency": 1}
    gateways = [await gateway(backend, policies={"tiers.toml": tiers(basic_wait)})
                for _ in range(count)]
    return sim, gateways


async def chat(gw: TestServer, key: str, text: str, timeout_s: float = 30.0
               ) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
            s.post(gw.make_url(CHAT), headers={"X-API-Key": key}, json={
                "model": MODEL, "messages": [{"role": "user", "content": text}]}) as r:
        return r.status, {"body": await r.json(), "headers": dict(r.headers)}, \
            time.monotonic() - started


def order(records: list[dict[str, Any]]) -> list[str]:
    """The prompts the engine received, in the order it received them."""
    return [r["body"]["messages"][-1]["content"] for r in records]


async def keys(redis_url: str, *pairs: tuple[str, str]) -> list[str]:
    made = []
    for tier, account in pairs:
        key = await new_key(redis_url, tier, account=account)
        if tier != "guest":
            await funded_key(redis_url, account=account)  # credits for the account
        made.append(key)
    return made


async def backends_once(gw: TestServer, ready: Callable[[dict[str, Any]], bool]
                        ) -> dict[str, Any]:
    """/admin/backends (admin token "ops") polled until `ready` holds of it (5 s at most)."""
    async with asyncio.timeout(5), aiohttp.ClientSession() as s:
        while True:
            async with s.get(gw.make_url("/admin/backends"),
                             headers={"Authorization": "Bearer ops"}) as r:
                view: dict[str, Any] = await r.json()
            if ready(view):
                return view
            await asyncio.sleep(0.01)


async def nothing_held(redis_url: str) -> None:
    """Wait (10 s at most) until the ledger holds no slot and nobody waits in it."""
    redis = Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(10):
            while True:
                held = await redis.hgetall("igw:{slots}:total")
                waiting = [await redis.zcard(key)
                           async for key in redis.scan_iter("igw:{slots}:wait:*")]
                if not held and not any(waiting):
                    return
                await asyncio.sleep(0.05)
    finally:
        await redis.aclose()


async def test_max_runs_before_a_basic_burst_and_the_engine_never_sees_two(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    sim, [gw] = await one_slot(simulator, gateway)
    basic, top = await keys(clean_redis.url, ("basic", "acct-basic"), ("max", "acct-max"))
    burst = [asyncio.create_task(chat(gw, basic, f"basic {i}")) for i in range(6)]
    # The burst is queued behind the first.
    view = await backends_once(gw, lambda v: v["queues"] == {f"chat/{MODEL}/direct": {"basic": 5}})
    assert view["queues"] == {f"chat/{MODEL}/direct": {"basic": 5}}
    assert view["data"][0]["slots"] == {"max": 1, "batch": 1, "in_use": 1, "spare": 0}
    first_max = asyncio.create_task(chat(gw, top, "max"))
    done = await asyncio.gather(*burst, first_max)
    assert [status for status, _, _ in done] == [200] * 7, done[0]
    seen = order(await sim_requests(sim))
    assert seen[1] == "max", seen  # next after the one already running
    assert sorted(seen) == sorted([f"basic {i}" for i in range(6)] + ["max"])
    outcomes = {r["outcome"] for r in await sim_requests(sim)}
    assert outcomes == {"completed"}  # never a 503 from the engine: one in flight at a time


async def test_lower_tiers_leave_headroom_for_the_tiers_above(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Basic's headroom 0.2 of a five-slot engine (none queued in it: engine_queue 0): a Basic
    burst runs four at a time, so a Max request sent after it finds the fifth slot free and
    runs before the queued Basic ones."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    sim = await simulator(ttft_ms=300, tokens_per_s=200, max_concurrency=5,
                          default_completion_tokens=8)
    gw = await gateway({"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
                        "models": [MODEL], "max_concurrency": 5},
                       policies={"tiers.toml": tiers(headroom=0.2)}, routing={"engine_queue": 0})
    basic, top = await keys(clean_redis.url, ("basic", "acct-hb"), ("max", "acct-hm"))
    burst = [asyncio.create_task(chat(gw, basic, f"basic {i}")) for i in range(6)]
    await backends_once(gw, lambda v: v["queues"] == {f"chat/{MODEL}/direct": {"basic": 2}}
                        and v["data"][0]["slots"]["in_use"] == 4)
    done = await asyncio.gather(*burst, chat(gw, top, "max"))
    assert [status for status, _, _ in done] == [200] * 7
    seen = order(await sim_requests(sim))
    assert seen.index("max") == 4, seen  # after the four running, before the two waiting


async def test_an_engine_of_batch_four_queues_one_request_and_max_still_runs_next(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """[routing] engine_queue 1 (the default): a vLLM engine of batch 4 is sent a fifth request
    to wait in its own queue, so its next is there when one ends; the rest of a Basic burst
    waits in the gateway, and a Max request sent after it runs right after the one queued in
    the engine. The engine (which would refuse a sixth) never sees more than five."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    sim = await simulator(ttft_ms=300, tokens_per_s=200, max_concurrency=4, max_queued=5,
                          default_completion_tokens=8)
    gw = await gateway({"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
                        "models": [MODEL], "max_concurrency": 4},
                       policies={"tiers.toml": tiers()})
    basic, top = await keys(clean_redis.url, ("basic", "acct-qb"), ("max", "acct-qm"))
    burst = [asyncio.create_task(chat(gw, basic, f"basic {i}")) for i in range(8)]
    view = await backends_once(gw, lambda v: v["queues"] == {f"chat/{MODEL}/direct": {"basic": 3}})
    async with aiohttp.ClientSession() as s, s.get(sim.make_url("/metrics")) as r:
        engine = await r.text()
    assert view["data"][0]["slots"] == {"max": 5, "batch": 4, "in_use": 5, "spare": 0}
    figures = parse_signals("vllm", engine, 0.0)
    assert figures is not None and (figures.running, figures.waiting) == (4, 1)
    done = await asyncio.gather(*burst, chat(gw, top, "max"))
    assert [status for status, _, _ in done] == [200] * 9
    seen = order(await sim_requests(sim))
    assert seen.index("max") == 5, seen  # after the four running and the one queued in it
    assert {r["outcome"] for r in await sim_requests(sim)} == {"completed"}


async def test_accounts_of_one_tier_take_turns(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    sim, [gw] = await one_slot(simulator, gateway)
    heavy, light = await keys(clean_redis.url, ("basic", "acct-heavy"), ("basic", "acct-light"))
    burst = [asyncio.create_task(chat(gw, heavy, f"heavy {i}")) for i in range(5)]
    await asyncio.sleep(0.1)
    late = [asyncio.create_task(chat(gw, light, f"light {i}")) for i in range(2)]
    await asyncio.gather(*burst, *late)
    seen = order(await sim_requests(sim))
    # One heavy request was running; then light's first (its turn is "now", heavy's next are
    # behind it), and the two accounts alternate while both wait.
    assert [who.split()[0] for who in seen] == [
        "heavy", "light", "heavy", "light", "heavy", "heavy", "heavy"], seen


async def test_accounts_take_turns_across_gateways(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """The turns are the fleet's: a light account's request sent to another gateway runs
    before the heavy account's backlog queued in the first."""
    sim, [one, other] = await one_slot(simulator, gateway, count=2)
    heavy, light = await keys(clean_redis.url, ("basic", "acct-h2"), ("basic", "acct-l2"))
    burst = [asyncio.create_task(chat(one, heavy, f"heavy {i}")) for i in range(4)]
    await asyncio.sleep(0.1)
    late = asyncio.create_task(chat(other, light, "light"))
    done = await asyncio.gather(*burst, late)
    assert [status for status, _, _ in done] == [200] * 5
    seen = order(await sim_requests(sim))
    assert seen[1] == "light", seen


async def test_a_tier_past_its_longest_wait_is_shed_at_once_and_charged_nothing(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    sim, [gw] = await one_slot(simulator, gateway, basic_wait=0.5)
    [basic] = await keys(clean_redis.url, ("basic", "acct-shed"))
    done = await asyncio.gather(*(chat(gw, basic, f"basic {i}") for i in range(5)))
    shed = [(answer, took) for status, answer, took in done if status == 503]
    assert shed and len(shed) + sum(1 for status, _, _ in done if status == 200) == 5
    for answer, _ in shed:
        assert answer["body"]["error"]["type"] == "pool_saturated"
        assert int(answer["headers"]["Retry-After"]) >= 1
        assert "would wait about" in answer["body"]["error"]["message"]
    served = [took for status, _, took in done if status == 200]
    # Refused at once: before even the first served request (one service time) was done.
    assert max(took for _, took in shed) < min(served)
    assert len(await sim_requests(sim)) == 5 - len(shed)
    await settled(gw)
    async with aiohttp.ClientSession() as s, s.get(gw.make_url("/metrics")) as r:
        text = await r.text()
    assert 'igw_queue_shed_total{model="acme/small-chat",reason="expected",tier="basic"}' in text


async def test_a_client_that_leaves_the_queue_is_never_run(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    sim, [gw] = await one_slot(simulator, gateway)
    [basic] = await keys(clean_redis.url, ("basic", "acct-leaves"))
    running = asyncio.create_task(chat(gw, basic, "runs"))
    for _ in range(200):  # it holds the one slot (50 ms was not always enough on a busy machine)
        if order(await sim_requests(sim)) == ["runs"]:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError):
        await chat(gw, basic, "gives up", timeout_s=0.1)
    assert (await running)[0] == 200
    await asyncio.sleep(0.3)
    assert order(await sim_requests(sim)) == ["runs"]
    # The gateway fixture checks at the end that every hold was released.


async def test_two_gateways_share_the_slots_and_the_tier_order(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    sim, [one, other] = await one_slot(simulator, gateway, count=2)
    basic, top = await keys(clean_redis.url, ("basic", "acct-b2"), ("max", "acct-m2"))
    burst = [asyncio.create_task(chat(one if i % 2 else other, basic, f"basic {i}"))
             for i in range(6)]
    await asyncio.sleep(0.15)
    first_max = asyncio.create_task(chat(one, top, "max"))
    done = await asyncio.gather(*burst, first_max)
    assert [status for status, _, _ in done] == [200] * 7
    records = await sim_requests(sim)
    assert {r["outcome"] for r in records} == {"completed"}  # never two at once
    assert order(records)[1] == "max", order(records)


async def test_a_crashed_process_gives_its_slots_back(clean_redis: RedisProcess) -> None:
    redis = Redis.from_url(clean_redis.url)
    crashed, alive = SlotLedger(redis), SlotLedger(redis)
    try:
        await crashed.beat()
        assert await crashed.take("pool", 3, (), "m", [("b0", 1, 0)]) == Taken(("b0",), 0, 0)
        # A second Max request waits in the crashed process (its longest wait: 0.3 s).
        assert await crashed.take("pool", 3, (), "m", [("b0", 1, 0)], member=crashed.member(),
                                  wait_s=0.3, most_ahead=5) == Taken((), 0, 1)
        await alive.beat()
        # Not yet lapsed: full, and a Basic request learns one waits ahead of it (refused:
        # it may find none ahead).
        assert await alive.take("pool", 1, (3,), "b", [("b0", 1, 0)]) == Taken((), 1, None)
        await alive.beat(now=time.time() + LAPSE_S + 1)
        assert await alive.in_flight() == {}  # the crashed process's slot is back
        # Its waiter still comes first until its longest wait (and a second's margin) ends.
        assert (await alive.take("pool", 1, (3,), "b", [("b0", 1, 0)])).backends == ()
        await asyncio.sleep(1.4)
        assert await alive.take("pool", 1, (3,), "b", [("b0", 1, 0)]) == Taken(("b0",), 0, 0)
        await alive.give_back("b0")
        await alive.give_back("b0")  # a second give-back finds nothing to give
        assert await alive.in_flight() == {}
        # Every gateway stopped at once while holding a slot, and the alive hash expired:
        # the first beat after the restart gives it back.
        assert (await crashed.take("pool", 3, (), "m", [("b0", 1, 0)])).backends == ("b0",)
        await redis.delete("igw:{slots}:alive")
        restarted = SlotLedger(redis)
        await restarted.beat()
        assert await restarted.in_flight() == {}
        await restarted.close()
    finally:
        await crashed.close()
        await alive.close()
        await redis.aclose()


async def test_the_ledger_gives_turns_by_account_across_processes(
        clean_redis: RedisProcess) -> None:
    """Fair queuing in the ledger: a heavy account's backlog in one process, a light
    account's request in another; the light one is next, a new heavy one finds the backlog
    ahead of it (refused where that is too many), a new light one does not."""
    redis = Redis.from_url(clean_redis.url)
    one, other = SlotLedger(redis), SlotLedger(redis)
    slot = [("b0", 1, 0)]
    try:
        assert await one.take("pool", 1, (), "heavy", slot) == Taken(("b0",), 0, 0)
        backlog = [one.member() for _ in range(3)]
        for tag, member in enumerate(backlog, start=1):
            assert await one.take("pool", 1, (), "heavy", slot, member=member, wait_s=30,
                                  most_ahead=10) == Taken((), tag - 1, tag)
        light = other.member()
        assert await other.take("pool", 1, (), "light", slot, member=light, wait_s=30,
                                most_ahead=10) == Taken((), 0, 0)
        await one.give_back("b0")
        # Heavy's next asks first, but light's turn (0) comes before its (1).
        assert await one.turn("pool", 1, (), "heavy", slot, backlog[0], 1) == Taken((), 1, 1)
        assert await other.turn("pool", 1, (), "light", slot, light, 0) == Taken(("b0",), 0, 0)
        # Three of heavy's wait ahead of a new heavy request: more than the one it may find.
        assert await one.take("pool", 1, (), "heavy", slot, member=one.member(), wait_s=30,
                              most_ahead=1) == Taken((), 3, None)
        # A new light request's turn (1) ties heavy's first: nobody ahead of it.
        assert await other.take("pool", 1, (), "light", slot, member=other.member(),
                                wait_s=30, most_ahead=1) == Taken((), 0, 1)
        # A heavy waiter that gives up hands its turn back only when it was its last.
        await one.leave("pool", 1, "heavy", backlog[2], 3)
        assert await redis.zscore("igw:{slots}:next:pool|1", "heavy") == 3
    finally:
        await one.close()
        await other.close()
        await redis.aclose()


async def test_a_tier_queues_in_an_engine_only_while_no_higher_tier_sends(
        clean_redis: RedisProcess) -> None:
    """A backend of batch 4 with one more queued in its engine: Basic alone takes all five;
    once Max has taken a slot of the pool, Basic takes only the batch (a Basic request queued
    in the engine would run before Max's next), Max still the fifth, and a Pro request in
    another pool is not held back by it. `HIGHER_TIER_S` after Max's last, Basic queues again."""
    redis = Redis.from_url(clean_redis.url)
    ledger = SlotLedger(redis)
    ledger.higher_tier_s = 0.5
    engine = [("b0", 5, 1)]

    async def fill(priority: int, higher: tuple[int, ...], pool: str = "pool") -> int:
        """Slots a tier takes, one request at a time, until it gets none."""
        taken = 0
        while (await ledger.take(pool, priority, higher, "a", engine)).backends:
            taken += 1
        return taken

    try:
        assert await fill(1, (3,)) == 5
        await ledger.give_back("b0", 5)
        assert (await ledger.take("pool", 3, (), "m", engine)).backends == ("b0",)
        assert await fill(1, (3,)) == 3  # the batch's other three
        assert await fill(3, ()) == 1  # Max's own next: the place in the engine's queue
        await ledger.give_back("b0", 5)
        assert await fill(2, (3,), pool="other") == 5  # another pool's Max sent nothing
        await ledger.give_back("b0", 5)
        await asyncio.sleep(0.6)
        assert await fill(1, (3,)) == 5
    finally:
        await ledger.close()
        await redis.aclose()


@pytest.mark.parametrize("scheduling", [True, False])
async def test_the_tier_priority_goes_to_an_engine_that_schedules_by_it(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess,
        scheduling: bool) -> None:
    """vLLM `--scheduling-policy priority`: the tier's priority (negated: lower runs first
    there) goes with each request; a client's own `priority` never does."""
    sim = await simulator(scheduling_policy="priority" if scheduling else "fcfs")
    gw = await gateway({"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
                        "models": [MODEL], "priority_scheduling": scheduling},
                       policies={"tiers.toml": tiers()})
    basic, top = await keys(clean_redis.url, ("basic", "acct-p1"), ("max", "acct-p2"))
    assert (await chat(gw, top, "max"))[0] == 200
    async with aiohttp.ClientSession() as s, s.post(
            gw.make_url("/v2/served/v1/chat/completions"), headers={"X-API-Key": basic},
            json={"model": MODEL, "priority": -100,
                  "messages": [{"role": "user", "content": "basic"}]}) as r:
        assert r.status == 200
    sent = {r["body"]["messages"][-1]["content"]: r["body"].get("priority")
            for r in await sim_requests(sim)}
    assert sent == ({"max": -3, "basic": -1} if scheduling else {"max": None, "basic": None})


async def test_slots_never_leak_when_clients_leave_at_any_moment(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """Clients cut off at every point (while admitted, while their slot is being taken, while
    queued, while streaming): afterwards no slot is held and nobody is counted as waiting, and
    the engine still serves the next request."""
    _, [gw] = await one_slot(simulator, gateway)
    [basic] = await keys(clean_redis.url, ("basic", "acct-cut"))
    for cut_s in (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.2, 0.4):
        tries = [asyncio.create_task(chat(gw, basic, f"cut {cut_s}", timeout_s=cut_s))
                 for _ in range(3)]
        await asyncio.gather(*tries, return_exceptions=True)
    await nothing_held(clean_redis.url)  # the cut requests end and give back what they held
    assert (await chat(gw, basic, "after"))[0] == 200


async def test_slots_never_leak_when_clients_leave_while_waiting_for_their_prompts_holder(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """Requests waiting for the busy replica that holds their prompt (a prefill elsewhere
    estimated dearer than the wait), cut off at every point: none went elsewhere, afterwards
    no slot is held and nobody waits, and the prompt's next request runs on its holder."""
    sims = [await simulator(ttft_ms=10, tokens_per_s=20, max_concurrency=1, max_queued=1,
                            default_completion_tokens=16) for _ in range(2)]
    gw = await gateway(*[{"name": f"b{i}", "kind": "vllm", "models": [MODEL],
                          "url": str(sim.make_url("/")).rstrip("/"), "max_concurrency": 1}
                         for i, sim in enumerate(sims)],
                       routing={"pick": "prefix", "prefill_ms_per_1k_tokens": 3000},
                       policies={"tiers.toml": tiers()})
    [basic] = await keys(clean_redis.url, ("basic", "acct-holder"))
    shared = "Keep to the house style and cite the handbook. " * 40
    busy = asyncio.create_task(chat(gw, basic, shared + "first"))  # ~0.8 s on its holder
    await asyncio.sleep(0.1)
    for cut_s in (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.2):
        tries = [asyncio.create_task(chat(gw, basic, shared + f"cut {cut_s}", timeout_s=cut_s))
                 for _ in range(3)]
        await asyncio.gather(*tries, return_exceptions=True)
    assert (await busy)[0] == 200
    await nothing_held(clean_redis.url)
    assert (await chat(gw, basic, shared + "after"))[0] == 200
    seen = [order(await sim_requests(sim)) for sim in sims]
    assert sorted(len(prompts) for prompts in seen) == [0, 2], seen  # first and after


async def test_an_engine_that_schedules_by_priority_runs_max_first_in_its_own_queue(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """Where the gateway lets an engine queue (its slots set above the engine's batch), a
    priority-scheduling vLLM still runs Max before the Basic requests waiting in it; the same
    engine without the policy refuses a priority (400), as vLLM does."""
    sim = await simulator(ttft_ms=300, tokens_per_s=200, max_concurrency=1,
                          default_completion_tokens=8, scheduling_policy="priority")
    gw = await gateway({"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
                        "models": [MODEL], "max_concurrency": 16, "priority_scheduling": True},
                       policies={"tiers.toml": tiers()})
    basic, top = await keys(clean_redis.url, ("basic", "acct-e1"), ("max", "acct-e2"))
    started = time.monotonic()
    burst = [asyncio.create_task(chat(gw, basic, f"basic {i}")) for i in range(4)]
    await asyncio.sleep(0.15)
    max_sent = time.monotonic() - started
    done = await asyncio.gather(*burst, chat(gw, top, "max"))
    assert [status for status, _, _ in done] == [200] * 5
    assert order(await sim_requests(sim))[4] == "max"  # the engine saw it last ...
    finished = sorted((took, i) for i, (_, _, took) in enumerate(done[:4]))
    max_finished = max_sent + done[4][2]
    # ... and ran it second: after the Basic request already running, before the other three.
    assert finished[0][0] < max_finished < finished[1][0], (finished, max_finished)
    fcfs = await simulator()
    async with aiohttp.ClientSession() as s, s.post(fcfs.make_url("/v1/chat/completions"), json={
            "model": MODEL, "priority": -3, "messages": [{"role": "user", "content": "x"}]}) as r:
        assert r.status == 400 and "Priority scheduling is not enabled" in await r.text()


async def test_speech_requests_get_slots_and_tier_order_too(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """A TTS server that synthesizes one request at a time (0.3 s each): a Basic burst waits
    in the gateway, a Max request sent after it runs next, and the server never has two."""
    sim = await simulator("tts", models=(TTS_MODEL,), ttft_ms=300, max_concurrency=1)
    backend = {"name": "tts0", "kind": "tts", "url": str(sim.make_url("/")).rstrip("/"),
               "models": [TTS_MODEL], "max_concurrency": 1}
    gw = await gateway(backend, policies={"tiers.toml": tiers(families='"chat", "tts"'),
                                          "prices.toml": PRICES})
    basic, top = await keys(clean_redis.url, ("basic", "acct-tts-b"), ("max", "acct-tts-m"))

    async def say(key: str, text: str) -> int:
        async with aiohttp.ClientSession() as s, s.post(
                gw.make_url("/v2/audio/tts/engine"), headers={"X-API-Key": key},
                json={"text": text, "preset_voice": "Emma"}) as r:
            await r.read()
            return r.status

    burst = [asyncio.create_task(say(basic, f"basic {i}")) for i in range(4)]
    await asyncio.sleep(0.15)
    first_max = asyncio.create_task(say(top, "max"))
    assert await asyncio.gather(*burst, first_max) == [200] * 5
    records = await sim_requests(sim)
    seen = [r["body"]["input"] for r in records]
    assert seen[1] == "max", seen
    # One at a time: the server refuses a second one in flight, and it never had to.
    assert {r["outcome"] for r in records} == {"completed"}


async def test_a_speech_request_refused_at_admission_gives_its_early_slot_back(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """Families take their slot beside admission's round trip, as chat does: one refused
    there (no credits: 402) gives it back, and the server never hears of it."""
    sim = await simulator("tts", models=(TTS_MODEL,), max_concurrency=1)
    gw = await gateway({"name": "tts0", "kind": "tts", "url": str(sim.make_url("/")).rstrip("/"),
                        "models": [TTS_MODEL], "max_concurrency": 1},
                       policies={"tiers.toml": tiers(families='"chat", "tts"'),
                                 "prices.toml": PRICES})
    broke = await new_key(clean_redis.url, "basic", account="acct-broke")  # no credits
    [paying] = await keys(clean_redis.url, ("basic", "acct-paying"))

    redis = Redis.from_url(clean_redis.url)
    try:
        async with aiohttp.ClientSession() as s:
            for key, status in ((broke, 402), (broke, 402), (paying, 200)):
                async with s.post(gw.make_url("/v2/audio/tts/engine"),
                                  headers={"X-API-Key": key},
                                  json={"text": "hello", "preset_voice": "Emma"}) as r:
                    await r.read()
                    assert r.status == status
        async with asyncio.timeout(5):
            while True:
                if not await redis.hgetall("igw:{slots}:total"):
                    break
                await asyncio.sleep(0.02)
        assert len(await sim_requests(sim)) == 1
    finally:
        await redis.aclose()
