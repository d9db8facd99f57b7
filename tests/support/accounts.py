"""Keys and credits as tests make them: a real API key (as `keys create` makes it), a funded one,
an account's journal, and the ledger check every gateway test ends with."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from proxy.config import KeysPolicy
from proxy.credits.ledger import Ledger
from proxy.identity.keystore import KeyStore


async def new_key(redis_url: str, tier: str = "max", account: str = "acct-test") -> str:
    """A real API key, created the way `keys create` does."""
    redis = Redis.from_url(redis_url)
    try:
        raw, _ = await KeyStore(redis, KeysPolicy()).create(account, tier, "test")
    finally:
        await redis.aclose()
    return raw


async def funded_key(redis_url: str, account: str = "acme", credits: int = 10**9) -> str:
    key = await new_key(redis_url, "max", account=account)
    redis = Redis.from_url(redis_url)
    try:
        await Ledger(redis).credit(account, credits, {"reason": "test"})
    finally:
        await redis.aclose()
    return key


async def journal(redis_url: str, account: str = "acme") -> list[dict[str, Any]]:
    redis = Redis.from_url(redis_url)
    try:
        return await Ledger(redis).all_entries(account)
    finally:
        await redis.aclose()


async def assert_ledger_reconciles(redis_url: str) -> None:
    """Reconcile runs clean after every test that spends (settlements may still be landing), and
    no hold is left open: every request ended its hold."""
    redis = Redis.from_url(redis_url)
    try:
        ledger = Ledger(redis)
        for _ in range(40):
            problems = await ledger.reconcile()
            for account in await ledger.accounts():
                if await ledger.open_holds(account):
                    problems.append(f"{account}: holds still open")
            if not problems:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"ledger does not reconcile: {problems}")
    finally:
        await redis.aclose()
