"""Network mode through the gateway: the request runs on `replicas` distinct backends of the
model's network pool, the answer a quorum agrees on comes back with its task address (pollable
by its owner, the agreement recorded), priced at the network price; disagreement is a 502."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import orjson
import pytest
from redis.asyncio import Redis

from proxy.credits.ledger import Ledger
from tests.support.accounts import new_key
from tests.support.gateway import settled

LARGE = "acme/gpt-oss-120b"
CHAT = "/v2/compat/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello!"}]
PRICES = f"""
version = "net-v1"
[models."{LARGE}"]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
network = {{ prompt_per_1k_tokens = 500, completion_per_1k_tokens = 5000 }}
"""
TIERS = f"""
[groups]
large-chat = ["{LARGE}"]
[tiers.guest]
requests_per_minute = 100000
families = ["chat", "tts"]
models = {{ standard = ["direct"] }}
[tiers.pro]
requests_per_minute = 100000
families = ["chat", "tts"]
models = {{ standard = ["direct", "network"], large-chat = ["direct"] }}
[tiers.max]
requests_per_minute = 100000
families = ["chat", "tts"]
models = {{ standard = ["direct", "network"], large-chat = ["direct", "network"] }}
"""


def backend(name: str, sim: Any, model: str, modes: list[str], kind: str = "vllm"
            ) -> dict[str, Any]:
    return {"name": name, "kind": kind, "url": str(sim.make_url("/")).rstrip("/"),
            "models": [model], "modes": modes, "forward_headers": ["x-sim-*"]}


async def net_stack(gateway: Any, simulator: Any, clean_redis: Any, *, agree: bool = True,
                    direct: bool = True) -> tuple[Any, dict[str, str], Ledger, Redis, list[Any]]:
    sims = [await simulator("vllm", (LARGE,)),
            await simulator("vllm", (LARGE,), default_completion_tokens=16 if agree else 9)]
    backends = [backend("large-a", sims[0], LARGE, ["direct", "network"] if direct
                        else ["network"]),
                backend("large-b", sims[1], LARGE, ["network"])]
    gw = await gateway(*backends, policies={"prices.toml": PRICES, "tiers.toml": TIERS})
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    key = await new_key(clean_redis.url, "max", account="acct-net")
    await ledger.credit("acct-net", 10**9, {"reason": "test"})
    return gw, {"X-API-Key": key}, ledger, redis, sims


async def post(gw: Any, body: Any, headers: dict[str, str]) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(CHAT), json=body, headers=headers) as r:
        return r.status, r.headers, await r.read()


async def get(gw: Any, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(
            gw.make_url(path), headers=headers) as r:
        return r.status, await r.json()


async def sim_count(sim: Any) -> int:
    async with aiohttp.ClientSession() as session, session.get(
            sim.make_url("/_sim/requests")) as r:
        return len(await r.json())


async def test_network_mode_answers_what_the_replicas_agree_on(
        gateway: Any, simulator: Any, clean_redis: Any) -> None:
    gw, headers, ledger, redis, sims = await net_stack(gateway, simulator, clean_redis)
    try:
        status, got, raw = await post(gw, {"model": LARGE, "messages": HELLO,
                                           "mode": "network", "temperature": 0.9}, headers)
        assert status == 200, raw
        answer = orjson.loads(raw)
        address = answer["task_address"]
        assert re.fullmatch(r"[0-9a-f]{64}", address) and got["X-Task-Address"] == address
        assert answer["mode"] == "network" and answer["task_id"].startswith("network:")
        assert [await sim_count(s) for s in sims] == [1, 1]  # both replicas ran it
        async with aiohttp.ClientSession() as session, session.get(
                sims[0].make_url("/_sim/requests")) as r:
            assert (await r.json())[0]["body"]["seed"] == 0  # [network] seed, one for all
        status, record = await get(gw, f"/v2/tasks/{address}", headers)
        assert status == 200 and record["status"] == "completed"
        assert record["result"]["choices"] == answer["choices"]
        agreement = record["agreement"]
        assert (agreement["replicas"], agreement["agreeing"], agreement["quorum"]) == (2, 2, 2)
        assert sorted(agreement["backends"]) == ["large-a", "large-b"]
        other = await new_key(clean_redis.url, "max", account="acct-other")
        assert (await get(gw, f"/v2/tasks/{address}", {"X-API-Key": other}))[0] == 404
        await settled(gw)
        [charge] = [e for e in await ledger.all_entries("acct-net") if e["type"] == "charge"]
        usage = answer["usage"]
        assert charge["mode"] == "network"  # the network price, once
        assert charge["cost"] == -(-(usage["prompt_tokens"] * 500
                                     + usage["completion_tokens"] * 5000) // 1000)
    finally:
        await redis.aclose()


async def test_disagreeing_replicas_are_a_502_and_free(gateway: Any, simulator: Any,
                                                       clean_redis: Any) -> None:
    gw, headers, ledger, redis, _ = await net_stack(gateway, simulator, clean_redis,
                                                    agree=False)
    try:
        status, _, raw = await post(gw, {"model": LARGE, "messages": HELLO, "mode": "network"},
                                    headers)
        assert status == 502, raw
        assert "did not agree" in orjson.loads(raw)["error"]["message"]
        await settled(gw)
        [charge] = [e for e in await ledger.all_entries("acct-net") if e["type"] == "charge"]
        assert charge["cost"] == 0
    finally:
        await redis.aclose()


@pytest.mark.parametrize(("body", "status"), [
    ({"mode": "network", "stream": True}, 422),  # streams are direct only
    ({"mode": "network", "async": True, "stream": True}, 422),
])
async def test_network_mode_refusals(gateway: Any, simulator: Any, clean_redis: Any,
                                     body: dict[str, Any], status: int) -> None:
    gw, headers, _, redis, sims = await net_stack(gateway, simulator, clean_redis)
    try:
        got, _, raw = await post(gw, {"model": LARGE, "messages": HELLO, **body}, headers)
        assert got == status, raw
        assert [await sim_count(s) for s in sims] == [0, 0]
    finally:
        await redis.aclose()


async def test_auto_picks_direct_when_it_can_else_network(gateway: Any, simulator: Any,
                                                         clean_redis: Any) -> None:
    gw, headers, _, redis, _ = await net_stack(gateway, simulator, clean_redis)
    try:
        status, _, raw = await post(gw, {"model": LARGE, "messages": HELLO}, headers)
        assert status == 200 and orjson.loads(raw)["mode"] == "direct"
        assert orjson.loads(raw)["task_address"] is None
    finally:
        await redis.aclose()
    gw, headers, _, redis, _ = await net_stack(gateway, simulator, clean_redis,
                                               direct=False)
    try:
        status, _, raw = await post(gw, {"model": LARGE, "messages": HELLO}, headers)
        assert status == 200 and orjson.loads(raw)["mode"] == "network"
        status, _, raw = await post(gw, {"model": LARGE, "messages": HELLO, "mode": "direct"},
                                    headers)
        assert status == 404  # no direct pool for it
    finally:
        await redis.aclose()


async def test_network_mode_of_the_large_model_is_max_only(gateway: Any, simulator: Any,
                                                           clean_redis: Any) -> None:
    gw, _, _, redis, sims = await net_stack(gateway, simulator, clean_redis)
    try:
        pro = {"X-API-Key": await new_key(clean_redis.url, "pro", account="acct-pro")}
        status, _, raw = await post(gw, {"model": LARGE, "messages": HELLO, "mode": "network"},
                                    pro)
        assert status == 403, raw
        assert [await sim_count(s) for s in sims] == [0, 0]
    finally:
        await redis.aclose()


async def test_async_network_chat_and_tts(gateway: Any, simulator: Any,
                                          clean_redis: Any) -> None:
    """The "done when": async chat and TTS in network mode, polled to a verified result with
    its task address."""
    chat = [await simulator("vllm", (LARGE,)) for _ in range(2)]
    speech = [await simulator("tts", ("acme/csm-1b",)) for _ in range(2)]
    gw = await gateway(
        backend("large-a", chat[0], LARGE, ["network"]),
        backend("large-b", chat[1], LARGE, ["network"]),
        backend("tts-a", speech[0], "acme/csm-1b", ["direct", "network"], "tts"),
        backend("tts-b", speech[1], "acme/csm-1b", ["network"], "tts"),
        policies={"prices.toml": PRICES, "tiers.toml": TIERS})
    headers = {"X-API-Key": gw.api_key}
    redis = Redis.from_url(clean_redis.url)
    await Ledger(redis).credit("acct-test", 10**9, {"reason": "test"})
    await redis.aclose()
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.make_url(CHAT), headers=headers, json={
                "model": LARGE, "messages": HELLO, "mode": "network", "async": True}) as r:
            assert r.status == 202
            chat_task = await r.json()
        async with session.post(gw.make_url("/v2/audio/tts/engine"), headers=headers, json={
                "text": "Agreed speech.", "preset_voice": "Ella", "mode": "network",
                "async": True}) as r:
            assert r.status == 202
            tts_task = await r.json()
        async with session.post(gw.make_url("/v2/audio/tts/engine"), headers=headers, json={
                "text": "Agreed speech.", "preset_voice": "Ella", "mode": "network"}) as r:
            assert r.status == 200 and re.fullmatch(r"[0-9a-f]{64}", r.headers["X-Task-Address"])
            sync_wav = await r.read()
    records = [await _finished(gw, t["poll_url"], headers) for t in (chat_task, tts_task)]
    assert all(r["status"] == "completed" for r in records), records
    chat_answer, speech = records[0]["result"], records[1]["result"]
    assert chat_answer["mode"] == "network" and re.fullmatch(r"[0-9a-f]{64}",
                                                             chat_answer["task_address"])
    assert re.fullmatch(r"[0-9a-f]{64}", speech["task_address"])
    status, record = await get(gw, f"/v2/tasks/{chat_answer['task_address']}", headers)
    assert status == 200 and record["agreement"]["agreeing"] == 2
    async with aiohttp.ClientSession() as session, session.get(
            gw.make_url(speech["media_url"]), headers=headers) as r:
        assert await r.read() == sync_wav  # deterministic replicas: the same audio


async def _finished(gw: Any, poll_url: str, headers: dict[str, str]) -> dict[str, Any]:
    async with asyncio.timeout(15):
        while True:
            status, record = await get(gw, poll_url, headers)
            assert status == 200
            if record["status"] != "running":
                return record
            await asyncio.sleep(0.05)


async def test_models_list_both_modes_and_the_network_price(gateway: Any, simulator: Any,
                                                            clean_redis: Any) -> None:
    gw, headers, _, redis, _ = await net_stack(gateway, simulator, clean_redis)
    try:
        status, listing = await get(gw, "/v2/models", headers)
        assert status == 200
        [large] = [m for m in listing["data"] if m["id"] == LARGE]
        assert large["modes"] == ["direct", "network"]
        assert large["resources"] == [f"direct.compat.{LARGE}", f"network.compat.{LARGE}"]
        assert large["tiers"] == {"direct": ["pro", "max"], "network": ["max"]}
        assert large["network_price"]["completion_per_1k_tokens"] == 5000
    finally:
        await redis.aclose()


async def test_network_replicas_wait_for_their_slots_together(
        gateway: Any, simulator: Any, clean_redis: Any) -> None:
    """Engines that run one request at a time and refuse a second: a network request sent
    while a direct one runs on one of its replicas waits in the gateway's queue until both
    replicas have a slot at once, then runs on both (before the dispatcher it got 503, its
    replicas picked before any slot was free); neither engine ever sees two."""
    sims = [await simulator("vllm", (LARGE,), ttft_ms=300, max_concurrency=1, max_queued=1)
            for _ in range(2)]
    backends = [{**backend(name, sim, LARGE, modes), "max_concurrency": 1}
                for name, sim, modes in (("large-a", sims[0], ["direct", "network"]),
                                         ("large-b", sims[1], ["network"]))]
    gw = await gateway(*backends, policies={"prices.toml": PRICES, "tiers.toml": TIERS})
    redis = Redis.from_url(clean_redis.url)
    try:
        key = await new_key(clean_redis.url, "max", account="acct-net")
        await Ledger(redis).credit("acct-net", 10**9, {"reason": "test"})
        headers = {"X-API-Key": key}
        direct = asyncio.create_task(post(gw, {"model": LARGE, "messages": HELLO,
                                               "mode": "direct"}, headers))
        await asyncio.sleep(0.1)
        network = await post(gw, {"model": LARGE, "messages": HELLO, "mode": "network"},
                             headers)
        assert network[0] == 200, network[2]
        assert (await direct)[0] == 200
        records = []
        async with aiohttp.ClientSession() as session:
            for sim in sims:
                async with session.get(sim.make_url("/_sim/requests")) as r:
                    records.append(await r.json())
        assert [len(r) for r in records] == [2, 1]  # the direct one, then both replicas
        assert {r["outcome"] for rs in records for r in rs} == {"completed"}
        held = await redis.hgetall("igw:{slots}:total")
        assert not held  # every slot given back
    finally:
        await redis.aclose()


async def test_a_network_request_right_after_a_direct_one_still_runs_on_two_replicas(
        gateway: Any, simulator: Any, clean_redis: Any) -> None:
    """The direct request leaves its worker a spare slot on the backend both pools share
    (proxy.upstream.spares): the network request, needing two distinct backends at once,
    takes its slots from the ledger rather than that one spare. (Six times: the network pool
    orders its two backends at random, and only one holds the spare.)"""
    gw, headers, _, redis, sims = await net_stack(gateway, simulator, clean_redis)
    try:
        for i in range(1, 7):
            direct = await post(gw, {"model": LARGE, "messages": HELLO, "mode": "direct"},
                                headers)
            assert direct[0] == 200, direct[2]
            network = await post(gw, {"model": LARGE, "messages": HELLO, "mode": "network"},
                                 headers)
            assert network[0] == 200, network[2]
            assert orjson.loads(network[2])["mode"] == "network"
            assert [await sim_count(s) for s in sims] == [2 * i, i]
    finally:
        await redis.aclose()
