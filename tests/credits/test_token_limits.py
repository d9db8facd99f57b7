"""Token limits (tiers.toml tokens_per_minute / tokens_per_day) through a real gateway, a real
Redis and a vLLM simulator: concurrent requests never reserve past the limit, settlements put
the engine's count in place of the reservation, the headers the official clients read, and
the real openai client retrying through a token limit."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import openai
from redis.asyncio import Redis

from proxy.credits.ledger import AccountKeys
from proxy.credits.pricing import chat_tokens
from tests.support.accounts import funded_key, new_key
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.redis_servers import RedisProcess
from tests.support.upstreams import SimulatorFactory

CHAT = "/v2/compat/v1/chat/completions"
LIMIT = 600
TIERS = f"""
[tiers.guest]
requests_per_minute = 1000
families = ["chat"]
models = {{ "*" = ["direct"] }}
tokens_per_minute = {LIMIT}

[tiers.basic]
requests_per_minute = 1000
families = ["chat"]
models = {{ "*" = ["direct"] }}
tokens_per_minute = {LIMIT}
tokens_per_day = 100000
"""


def body(max_tokens: int, text: str = "Hello!") -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]}


async def basic_key(redis_url: str, account: str) -> str:
    await funded_key(redis_url, account=account)  # credits for the account
    return await new_key(redis_url, "basic", account=account)


async def post(gw: Any, payload: dict[str, Any], key: str | None = None, path: str = CHAT
               ) -> tuple[int, dict[str, str], Any]:
    headers = {"X-API-Key": key} if key else {}
    async with aiohttp.ClientSession() as s, s.post(gw.make_url(path), json=payload,
                                                    headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


async def basic_refusals(gw: Any) -> float:
    """429s the gateway counted for the basic tier (igw_rate_limited_total)."""
    async with aiohttp.ClientSession() as s, s.get(gw.make_url("/metrics")) as r:
        metrics = await r.text()
    refused = [line for line in metrics.splitlines()
               if line.startswith('igw_rate_limited_total{tier="basic"}')]
    return float(refused[0].split()[-1]) if refused else 0.0


async def window(redis: Redis, account: str) -> dict[str, int]:
    minute = await redis.hgetall(AccountKeys.of(account).token_window("basic", "*:tm"))
    return {k.decode(): int(v) for k, v in minute.items()}


async def test_concurrent_requests_never_pass_the_limit_and_settle_to_the_engines_count(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    sim = await simulator(ttft_ms=300, default_completion_tokens=16)
    gw = await gateway(sim, policies={"tiers.toml": TIERS})
    key = await basic_key(clean_redis.url, "acct-tpm")
    reserve = chat_tokens(body(100), 100)
    done = await asyncio.gather(*(post(gw, body(100), key) for _ in range(10)))
    served = [answer for status, _, answer in done if status == 200]
    refused = [(headers, answer) for status, headers, answer in done if status == 429]
    assert len(served) + len(refused) == 10
    assert len(served) == LIMIT // reserve  # as many as their worst cases fit, no more
    for headers, answer in refused:
        assert answer["error"]["type"] == "rate_limited"
        assert "tokens a minute" in answer["error"]["message"]
        # Room is only reserved by requests in flight: worth a retry within a second.
        assert 0 < int(headers["retry-after-ms"]) <= 1000 and headers["Retry-After"] == "1"
        assert headers["x-ratelimit-limit-tokens"] == str(LIMIT)
    await settled(gw)
    redis = Redis.from_url(clean_redis.url)
    try:
        async with asyncio.timeout(5):  # the corrections land in the background
            while True:
                counts = await window(redis, "acct-tpm")
                if not counts.get("r", 0):
                    break
                await asyncio.sleep(0.02)
        used = sum(a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"] for a in served)
        assert counts["t"] == used  # the engine's count, not the reservations
        assert not [k async for k in redis.scan_iter("igw:{acct-tpm}:tkr:*")]
    finally:
        await redis.aclose()
    # With the reservations gone, what the engine counted is all the window holds: as many
    # worst cases as fit beside it get through, and no more.
    room = (LIMIT - used) // reserve
    again = await asyncio.gather(*(post(gw, body(100), key) for _ in range(room + 2)))
    assert sorted(status for status, _, _ in again) == [200] * room + [429] * 2


async def test_the_headers_clients_read_and_a_request_that_can_never_fit(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"tiers.toml": TIERS})
    key = await basic_key(clean_redis.url, "acct-headers")
    status, headers, _ = await post(gw, body(50), key)
    assert status == 200
    reserve = chat_tokens(body(50), 50)
    assert headers["x-ratelimit-limit-requests"] == "1000"
    assert headers["x-ratelimit-remaining-requests"] == "999"
    assert headers["x-ratelimit-limit-tokens"] == str(LIMIT)
    assert headers["x-ratelimit-remaining-tokens"] == str(LIMIT - reserve)
    assert headers["x-ratelimit-reset-tokens"] == "0s"
    async with anthropic.AsyncAnthropic(base_url=str(gw.make_url("/v2/messages")), api_key=key,
                                        max_retries=0) as claude:
        raw = await claude.messages.with_raw_response.create(
            model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Hello!"}])
    assert raw.headers["anthropic-ratelimit-tokens-limit"] == str(LIMIT)
    assert int(raw.headers["anthropic-ratelimit-tokens-remaining"]) < LIMIT - reserve
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    # Worst case over the limit by itself: refused, and marked not worth retrying.
    status, headers, answer = await post(gw, body(LIMIT), key)
    assert status == 429 and headers["x-should-retry"] == "false"
    assert "ask for fewer" in answer["error"]["message"]
    # The account page shows the windows: what requests reserved or used, and what is left.
    async with aiohttp.ClientSession() as s, s.get(gw.make_url("/v2/account"),
                                                   headers={"X-API-Key": key}) as r:
        limits = (await r.json())["token_limits"]
    minute, day = limits
    assert (minute["group"], minute["kind"], minute["period"], minute["limit"]) == (
        None, "tokens", "minute", LIMIT)
    assert (day["period"], day["limit"]) == ("day", 100000)
    assert 0 < minute["used"] == day["used"] and minute["remaining"] == LIMIT - minute["used"]
    # Guests have their own window per client address, on the same terms.
    status, headers, _ = await post(gw, body(50))
    assert status == 200 and headers["x-ratelimit-limit-tokens"] == str(LIMIT)


async def test_the_openai_client_retries_through_a_token_limit(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """A long request holds most of the minute's tokens; the official client's call is refused
    (429, retry-after-ms: the room is only reserved), waits as told, and gets through once the
    first settles to what it really used."""
    sim = await simulator(ttft_ms=800, default_completion_tokens=16)
    gw = await gateway(sim, policies={"tiers.toml": TIERS})
    key = await basic_key(clean_redis.url, "acct-retry")
    first = asyncio.create_task(post(gw, body(400), key))
    await asyncio.sleep(0.2)
    client = openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")), api_key=key,
                                max_retries=4)
    completion = await client.chat.completions.create(
        model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "Hello!"}])
    await client.close()
    assert completion.choices[0].message.content
    assert (await first)[0] == 200
    assert await basic_refusals(gw) >= 1  # it was refused, then retried


async def test_an_async_request_settles_its_tokens_in_the_runner(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """The reservation goes with the task: the worker that runs it puts the engine's count in
    its place."""
    sim = await simulator(default_completion_tokens=16)
    gw = await gateway(sim, policies={"tiers.toml": TIERS})
    key = await basic_key(clean_redis.url, "acct-async")
    status, _, task = await post(gw, {**body(100), "async": True}, key)
    assert status == 202
    async with asyncio.timeout(15), aiohttp.ClientSession() as s:
        while True:
            async with s.get(gw.make_url(task["poll_url"]), headers={"X-API-Key": key}) as r:
                record = await r.json()
            if record["status"] != "running":
                break
            await asyncio.sleep(0.05)
    assert record["status"] == "completed", record
    usage = record["result"]["usage"]
    redis = Redis.from_url(clean_redis.url)
    try:
        async with asyncio.timeout(5):
            while True:
                counts = await window(redis, "acct-async")
                if not counts.get("r", 0):
                    break
                await asyncio.sleep(0.02)
        assert counts["t"] == usage["prompt_tokens"] + usage["completion_tokens"]
    finally:
        await redis.aclose()


async def test_the_anthropic_client_retries_through_a_token_limit(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """The same on the Messages route, with the official anthropic client."""
    sim = await simulator(ttft_ms=800, default_completion_tokens=16)
    gw = await gateway(sim, policies={"tiers.toml": TIERS})
    key = await basic_key(clean_redis.url, "acct-claude")
    first = asyncio.create_task(post(gw, body(400), key))
    await asyncio.sleep(0.2)
    async with anthropic.AsyncAnthropic(base_url=str(gw.make_url("/v2/messages")), api_key=key,
                                        max_retries=4) as claude:
        message = await claude.messages.create(
            model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "Hello!"}])
    assert message.content
    assert (await first)[0] == 200
    assert await basic_refusals(gw) >= 1  # it was refused, then retried


async def test_buckets_that_leave_the_window_take_their_tokens_along(
        clean_redis: RedisProcess) -> None:
    """The admission script on its own: a minute window holding 500 tokens from two minutes ago
    (as a gateway long gone left it), 7 from 61 s ago (just past the window), 20 from 30 s ago
    and 30 from now; a new request of 30 against a limit of 100 fits once the old buckets are
    dropped, the window's figures are what is left, and the next one is refused with the
    wait. And a window last trimmed long ago (more buckets behind than one read covers)."""
    from proxy.credits.ledger import Ledger

    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    keys = AccountKeys.of("acct-trim")
    minute = keys.token_window("basic", "*:tm")
    now = int((await redis.time())[0])
    await redis.hset(minute, mapping={str(now - 120): 500, str(now - 61): 7,
                                      str(now - 30): 20, str(now): 30, "t": 557,
                                      "o": str(now - 120)})

    async def admit(key: str, tokens: int) -> list[int]:
        answer = await ledger.admit_script(
            keys=[keys.window("basic"), keys.reservation(f"r{tokens}"), key],
            args=[0, 60000, "", 0, 0, "", tokens, 0, "", "tm", 100])
        return [int(answer[0]), int(answer[4][0]) if answer[4] else 0, int(answer[5])]

    try:
        status, left, _ = await admit(minute, 30)
        assert (status, left) == (1, 100 - 50 - 30)  # the old 507 are gone
        state = {k.decode(): int(v) for k, v in (await redis.hgetall(minute)).items()}
        assert state["t"] == 80 and state["o"] == now - 60, state
        assert set(state) == {str(now - 30), str(now), "t", "o", "r"}, state
        status, _, wait_ms = await admit(minute, 30)
        # 80 + 30 > 100: refused, nothing counted; the 30 reserved in flight may free room
        # within a second (else the bucket from 30 s ago leaves in ~31 s).
        assert (status, wait_ms) == (4, 1000)
        assert int(await redis.hget(minute, "t")) == 80
        quiet = AccountKeys.of("acct-quiet").token_window("basic", "*:tm")
        await redis.hset(quiet, mapping={str(now - 2000): 90, str(now - 5): 10, "t": 100,
                                         "o": str(now - 2000)})
        assert (await admit(quiet, 40))[:2] == [1, 100 - 10 - 40]
        assert int(await redis.hget(quiet, "t")) == 50
        assert not await redis.hexists(quiet, str(now - 2000))
    finally:
        await ledger.close()
        await redis.aclose()


GROUPS = f"""
[groups]
large = ["{MODEL}"]

[tiers.guest]
requests_per_minute = 1000
families = ["chat"]
models = {{ "*" = ["direct"] }}

[tiers.basic]
requests_per_minute = 1000
families = ["chat"]
models = {{ "*" = ["direct"] }}
tokens_per_minute = 100000
output_tokens_per_minute = 450

[tiers.basic.group_tokens.large]
input_tokens_per_minute = 5000
"""


async def test_group_and_output_limits_bind_each_in_its_own_unit(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """The tier's output tokens a minute, and its model group's input tokens a minute, beside
    its tokens a minute: each window reserves its own part of the worst case (the completion
    cap, the prompt's bound) and settles to the engine's count of that part; the one that
    refuses is named; the Messages route's input and output headers show them."""
    sim = await simulator(ttft_ms=300, default_completion_tokens=16)
    gw = await gateway(sim, policies={"tiers.toml": GROUPS})
    key = await basic_key(clean_redis.url, "acct-groups")
    redis = Redis.from_url(clean_redis.url)
    keys = AccountKeys.of("acct-groups")
    try:
        # Two requests with max_tokens 200 fit the 450 output tokens; a third does not.
        first = [asyncio.create_task(post(gw, body(200), key)) for _ in range(2)]
        await asyncio.sleep(0.1)
        status, headers, answer = await post(gw, body(200), key)
        assert status == 429, answer
        assert "450 output tokens a minute" in answer["error"]["message"]
        assert headers["x-ratelimit-limit-tokens"] == "450"
        assert [s for s, _, _ in await asyncio.gather(*first)] == [200, 200]
        # A prompt whose bound passes the group's 5,000 input tokens alone: never fits.
        status, headers, answer = await post(gw, body(10, "x" * 6000), key)
        assert status == 429 and headers["x-should-retry"] == "false"
        assert "5000 input tokens a minute on large models" in answer["error"]["message"]
        await settled(gw)
        charged = await charges(redis, "acct-groups")
        prompt = sum(int(e["prompt_tokens"]) for e in charged)
        completion = sum(int(e["completion_tokens"]) for e in charged)
        windows = {suffix: await hash_of(redis, keys.token_window("basic", suffix))
                   for suffix in ("*:tm", "*:om", "large:im")}
        assert windows["*:om"]["t"] == completion == 32  # the engine's 16 each, not 200
        assert windows["large:im"]["t"] == prompt > 0
        assert windows["*:tm"]["t"] == prompt + completion
        assert all(w.get("r", 0) == 0 for w in windows.values()), windows
        # Anthropic's input and output headers: each the tightest window of its kind.
        raw = await post(gw, {"model": MODEL, "max_tokens": 100, "messages": [
            {"role": "user", "content": "Hi"}]}, key, path="/v2/messages/v1/messages")
        assert raw[0] == 200, raw
        assert raw[1]["anthropic-ratelimit-output-tokens-limit"] == "450"
        assert raw[1]["anthropic-ratelimit-input-tokens-limit"] == "5000"
        assert raw[1]["anthropic-ratelimit-tokens-limit"] == "450"  # the tightest of all
        # The account page lists every window, the group's among them.
        async with aiohttp.ClientSession() as s, s.get(gw.make_url("/v2/account"),
                                                       headers={"X-API-Key": key}) as r:
            limits = (await r.json())["token_limits"]
        assert [(w["group"], w["kind"], w["period"], w["limit"]) for w in limits] == [
            (None, "tokens", "minute", 100000), (None, "output_tokens", "minute", 450),
            ("large", "input_tokens", "minute", 5000)]
    finally:
        await redis.aclose()


async def hash_of(redis: Redis, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(key)).items()}


async def charges(redis: Redis, account: str) -> list[dict[str, Any]]:
    from proxy.credits.ledger import Ledger

    ledger = Ledger(redis)
    try:
        return [e for e in await ledger.all_entries(account) if e.get("type") == "charge"]
    finally:
        await ledger.close()
