"""Chaos under load (reliability.md L7, U3): kill -9 the ledger Redis, the rate-limit Redis and a
model server while keyed clients run, then audit the money and what the clients saw.

Real processes only: `serve` (master, two workers, its two embedded redis-servers), two supervised
simulators, the operator CLI for credits, sweep and reconcile.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from proxy.credits.ledger import Ledger
from tests.support.config_files import MODEL
from tests.support.embedded_redis import (
    PRICES,
    all_ready,
    cli,
    embedded_redis,
    ledger_client,
    new_funded_key,
    wait_readyz,
)
from tests.support.fleet import CHAT, Stack, settled_view, simulator

CLIENTS = 8
LOAD_S = 12.0
# When each process is killed, in seconds after the load starts.
KILLS = {"ledger redis": 2.5, "rate-limit redis": 5.5, "simulator": 8.5}
HOLD_TTL_S = 4  # longer than any request here (< 1 s), so no live hold expires
REQUEST_BOUND_S = 10.0  # a request still unanswered after this counts as a hang
DOCUMENTED = {200, 429, 502, 503, 504}
ACCOUNTS = ("acct-chaos-a", "acct-chaos-b")
CREDITS = 1000


@dataclass(slots=True)
class Seen:
    """One request as its client saw it."""

    at: float
    streamed: bool
    status: int | str  # the HTTP status, or what went wrong instead of an answer
    request_id: str | None
    retry_after: str | None


async def one_request(session: aiohttp.ClientSession, url: str, key: str, streamed: bool,
                      started: float) -> Seen:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "chaos"}],
            "max_tokens": 64, "stream": streamed}
    at = time.monotonic() - started
    try:
        async with asyncio.timeout(REQUEST_BOUND_S):
            async with session.post(url + CHAT, json=body, headers={
                    "X-API-Key": key, "x-sim-tokens": "40" if streamed else "20"}) as response:
                await response.read()  # a stream: to its end
                return Seen(at, streamed, response.status, response.headers.get("X-Request-Id"),
                            response.headers.get("Retry-After"))
    except TimeoutError:
        return Seen(at, streamed, "hang", None, None)
    except aiohttp.ClientError as exc:
        return Seen(at, streamed, type(exc).__name__, None, None)


async def client(index: int, url: str, key: str, seen: list[Seen], started: float) -> None:
    connector = aiohttp.TCPConnector(force_close=index % 2 == 0)  # half of them: any worker
    async with aiohttp.ClientSession(connector=connector) as session:
        turn = 0
        while time.monotonic() - started < LOAD_S:
            seen.append(await one_request(session, url, key, turn % 3 == index % 3, started))
            turn += 1


async def test_chaos_kill9_of_both_redis_servers_and_a_model_server_under_load(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    sims = [simulator(name, "--tokens-per-s", "200") for name in ("sim-a", "sim-b")]
    stack = Stack(tmp_path, sims, workers=2, redis_url=None, policies={
        "prices.toml": f"hold_ttl_s = {HOLD_TTL_S}\n" + PRICES},
        # Every request ends well inside a hold's life (check-config insists).
        upstream={"connect_timeout_s": 0.2, "first_byte_timeout_s": 1.0, "max_stream_s": 1.5})
    stacks.append(stack)
    stack.ready()
    keys = [new_funded_key(stack, account, str(CREDITS)) for account in ACCOUNTS]
    sim_a = await settled_view(stack.url, "sim-a", lambda b: b["state"] == "ready")
    victims = {
        "ledger redis": embedded_redis(stack, "redis"),
        "rate-limit redis": embedded_redis(stack, "redis-limits"),
        "simulator": psutil.Process(sim_a["pid"]),
    }

    seen: list[Seen] = []
    started = time.monotonic()
    load = asyncio.gather(*(client(i, stack.url, keys[i % len(keys)], seen, started)
                            for i in range(CLIENTS)))
    for name, at in KILLS.items():
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        victims[name].kill()
    await load
    load_ended = time.monotonic()

    # Everything comes back: both Redis servers (new pids) and the killed simulator.
    await wait_readyz(stack.url, all_ready, within=10, in_a_row=12)
    for name, folder in (("ledger redis", "redis"), ("rate-limit redis", "redis-limits")):
        assert embedded_redis(stack, folder).pid != victims[name].pid
    await settled_view(stack.url, "sim-a", lambda b: b["state"] == "ready" and b["restarts"] == 1
                       and b["pid"] != victims["simulator"].pid)
    assert not any(v.is_running() for v in victims.values())  # all reaped (zombies "run")

    # Clients only ever saw documented answers, in bounded time; refusals say when to retry.
    statuses = sorted({str(s.status) for s in seen})
    summary = {status: sum(str(s.status) == status for s in seen) for status in statuses}
    print(f"chaos: {len(seen)} requests, statuses {summary}")
    undocumented = [s for s in seen if s.status not in DOCUMENTED]
    assert not undocumented, (summary, undocumented[:10], events(stack))
    assert all(s.retry_after for s in seen if s.status in (429, 503)), summary
    ok = [s for s in seen if s.status == 200]
    assert len(ok) > 100 and any(s.at > KILLS["simulator"] + 1 for s in ok), summary

    # Holds left by failed settlements expire; the sweep releases them.
    await asyncio.sleep(max(0.0, load_ended + HOLD_TTL_S + 1 - time.monotonic()))
    swept = cli(stack, "credits", "sweep")
    assert swept.returncode == 0, swept.stderr
    reconciled = cli(stack, "credits", "reconcile")
    redis = ledger_client(stack)
    try:
        ledger = Ledger(redis)
        balances = {a: await ledger.balance(a) for a in ACCOUNTS}
        charges = [e for a in ACCOUNTS for e in await ledger.all_entries(a)
                   if e.get("type") == "charge" and e.get("request_id")]
    finally:
        await redis.aclose()
    print(f"chaos: balances {balances}; {swept.stdout.strip()}; {reconciled.stdout.strip()}")
    for account, balance in balances.items():
        # No over-spend: nothing spent beyond what was credited, nothing below zero.
        assert balance.credited == CREDITS * 10**6, (account, balance)
        assert 0 < balance.spent <= balance.credited and balance.available >= 0, balance
        assert balance.held == 0, (account, balance)  # no hold outlives the sweep
    assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr

    # Every answered request was settled exactly once, in the journal under its request id.
    charged = [e["request_id"] for e in charges]
    assert len(charged) == len(set(charged)), "a request was charged twice"
    missing = [s for s in ok if not s.streamed and s.request_id not in set(charged)]
    assert not missing, (len(missing), missing[:5], events(stack))
    missing_streams = [s for s in ok if s.streamed and s.request_id not in set(charged)]
    assert not missing_streams, (len(missing_streams), missing_streams[:5], events(stack))


def events(stack: Stack) -> list[str]:
    """The gateway's log lines that explain a lost settlement, for a failure message."""
    marks = ("redis-server", "settlement failed", "expired credit hold", "unhandled")
    return [line for line in stack.log.read_text().splitlines() if any(m in line for m in marks)]
