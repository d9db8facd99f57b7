"""Key store on a real redis-server: records, cache, revocation fan-out, CLI and admin API."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from aiohttp import web
from redis.asyncio import Redis

from proxy.admin_cli import add_commands
from proxy.app import build_app
from proxy.config import KeysPolicy, load_config
from proxy.identity import apikeys
from proxy.identity.keystore import KeyStore
from proxy.store.background import stop_task
from proxy.store.redis_process import RedisProcess
from tests.support.config_files import write_config
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
DIGEST_RE = re.compile(r"[0-9a-f]{64}")


@pytest.fixture
async def redis(redis_server: RedisProcess) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def store(redis: Redis) -> KeyStore:
    return KeyStore(redis, KeysPolicy())


async def until(check: Callable[[], bool | Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        result = check()
        if await result if not isinstance(result, bool) else result:
            return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def redis_work(redis: Redis) -> tuple[int, int]:
    """(keyspace reads, commands processed) so far; the INFO call itself counts as one command."""
    stats = await redis.info("stats")
    return stats["keyspace_hits"] + stats["keyspace_misses"], stats["total_commands_processed"]


async def assert_no_redis_work(redis: Redis, action: Callable[[], Awaitable[Any]]) -> None:
    reads, commands = await redis_work(redis)
    await action()
    assert await redis_work(redis) == (reads, commands + 1)


def typo(key: str) -> str:
    i = len(key) // 2
    return key[:i] + ("A" if key[i] != "A" else "B") + key[i + 1:]


async def test_create_and_lookup(store: KeyStore) -> None:
    raw, record = await store.create("acme", "pro", "ci runner")
    assert apikeys.well_formed(raw, "igw")
    assert record.id == apikeys.key_id(apikeys.digest(raw))
    assert (record.account, record.tier, record.status, record.label) == (
        "acme", "pro", "active", "ci runner")
    assert abs(record.created - time.time()) < 5
    assert await store.lookup(raw) == record
    minted = apikeys.generate("igw", os.urandom(32))  # well formed, unknown
    assert await store.lookup(minted) is None
    assert await store.lookup("") is None


async def test_create_refuses_bad_account_and_label(store: KeyStore) -> None:
    for account in ("", "guest:1.2.3.4", "a b", "x" * 65):
        with pytest.raises(ValueError):
            await store.create(account, "basic")
    with pytest.raises(ValueError):
        await store.create("acme", "basic", "two\nlines")


async def test_list_and_account(store: KeyStore) -> None:
    _, a1 = await store.create("acme", "pro")
    _, a2 = await store.create("acme", "basic", "second")
    _, b1 = await store.create("beta", "max")
    listed = await store.list()
    assert listed == sorted([a1, a2, b1], key=lambda r: (r.account, r.created, r.id))
    assert {r.id for r in await store.list("acme")} == {a1.id, a2.id}
    assert await store.list("nobody") == []
    view = await store.account("beta")
    assert view is not None and view.account == "beta" and view.keys == [b1]
    assert "digest" not in str(view.public())
    assert await store.account("nobody") is None


async def test_revoke_by_id_and_by_key(store: KeyStore) -> None:
    raw1, rec1 = await store.create("acme", "pro")
    raw2, _ = await store.create("acme", "pro")
    revoked = await store.revoke(rec1.id)
    assert revoked is not None and revoked.status == "revoked" and not revoked.active
    looked_up = await store.lookup(raw1)
    assert looked_up is not None and looked_up.status == "revoked"  # "revoked", not "unknown"
    assert (await store.revoke(raw2)).status == "revoked"  # type: ignore[union-attr]
    assert (await store.revoke(rec1.id)).status == "revoked"  # type: ignore[union-attr]
    assert await store.revoke("key_000000000000") is None
    assert await store.revoke(apikeys.generate("igw", os.urandom(32))) is None
    assert await store.revoke(typo(raw1)) is None
    assert len(await store.list("acme")) == 2


async def test_dump_holds_no_raw_key(store: KeyStore, redis: Redis) -> None:
    raws = [(await store.create("acme", tier, "label"))[0] for tier in ("basic", "pro", "max")]
    await store.revoke(raws[0])
    for raw in raws:
        await store.lookup(raw)
    dump: list[Any] = []  # every key name and every value, as redis-cli would show them
    for name in await redis.keys("*"):
        dump.append(name)
        kind = await redis.type(name)
        if kind == b"hash":
            for field, value in (await redis.hgetall(name)).items():
                dump += [field, value]
        elif kind == b"string":
            dump.append(await redis.get(name))
        elif kind == b"set":
            dump += list(await redis.smembers(name))
        else:
            raise AssertionError(f"unexpected {kind!r} at {name!r}")
    text = b"\n".join(dump).decode()
    assert "igw:accounts" in text and apikeys.digest(raws[1]) in text
    for raw in raws:
        assert raw not in text and raw[7:-6] not in text


async def test_mistyped_key_never_reaches_redis(store: KeyStore, redis: Redis) -> None:
    raw, _ = await store.create("acme", "basic")
    for bad in (typo(raw), raw[:-1], raw + "x", "sk-openai-style", "igw_sk_" + "0" * 38):
        await assert_no_redis_work(redis, lambda bad=bad: store.lookup(bad))  # type: ignore[misc]
        assert await store.lookup(bad) is None


async def test_cache_hit_avoids_redis(redis: Redis) -> None:
    store = KeyStore(redis, KeysPolicy(cache_ttl_s=60))
    raw, record = await store.create("acme", "basic")
    assert await store.lookup(raw) == record  # fills the cache
    await assert_no_redis_work(redis, lambda: store.lookup(raw))
    uncached = KeyStore(redis, KeysPolicy(cache_ttl_s=0))
    reads, _ = await redis_work(redis)
    await uncached.lookup(raw)
    await uncached.lookup(raw)
    assert (await redis_work(redis))[0] == reads + 2


async def test_cache_entries_expire(redis: Redis) -> None:
    store = KeyStore(redis, KeysPolicy(cache_ttl_s=0.2))
    raw, _ = await store.create("acme", "basic")
    await store.lookup(raw)
    await redis.hset(f"igw:key:{apikeys.digest(raw)}", "tier", "max")  # behind the cache's back
    assert (await store.lookup(raw)).tier == "basic"  # type: ignore[union-attr]
    await asyncio.sleep(0.25)
    assert (await store.lookup(raw)).tier == "max"  # type: ignore[union-attr]


async def test_cache_is_bounded_least_recently_used_first(redis: Redis) -> None:
    store = KeyStore(redis, KeysPolicy(), max_cache_entries=3)
    raws = [(await store.create("acme", "basic"))[0] for _ in range(4)]
    for raw in raws[:3]:
        await store.lookup(raw)
    await store.lookup(raws[0])  # now the most recently used
    await store.lookup(raws[3])  # pushes out raws[1]
    assert store.cache_size == 3
    await assert_no_redis_work(redis, lambda: store.lookup(raws[0]))
    reads, _ = await redis_work(redis)
    await store.lookup(raws[1])
    assert (await redis_work(redis))[0] == reads + 1


async def test_lookup_racing_an_eviction_does_not_cache(store: KeyStore) -> None:
    raw, _ = await store.create("acme", "basic")
    pending = asyncio.create_task(store.lookup(raw))
    await asyncio.sleep(0)  # the lookup is now waiting on Redis
    store.clear_cache()  # e.g. a revocation arrived meanwhile
    assert await pending is not None
    assert store.cache_size == 0


async def test_revoke_evicts_own_cache_at_once(redis: Redis) -> None:
    store = KeyStore(redis, KeysPolicy(cache_ttl_s=3600))
    raw, record = await store.create("acme", "basic")
    await store.lookup(raw)
    await store.revoke(record.id)
    assert (await store.lookup(raw)).status == "revoked"  # type: ignore[union-attr]


SECOND_PROCESS = r"""
import asyncio, sys
from redis.asyncio import Redis
from proxy.config import KeysPolicy, load_config
from proxy.identity.keystore import KeyStore
from proxy.store.background import stop_task

async def main() -> None:
    key = sys.stdin.readline().strip()
    redis = Redis.from_url(sys.argv[1])
    store = KeyStore(redis, KeysPolicy(cache_ttl_s=3600))  # only the push can reveal it
    listener = asyncio.create_task(store.listen_for_revocations())
    while not store.listening:
        await asyncio.sleep(0.01)
    assert (await store.lookup(key)).active
    print("ready", flush=True)
    while (await store.lookup(key)).active:
        await asyncio.sleep(0.005)
    print("revoked", flush=True)
    await stop_task(listener)
    await redis.aclose()

asyncio.run(main())
"""


async def test_revocation_reaches_another_process_within_a_second(
    store: KeyStore, redis_server: RedisProcess
) -> None:
    raw, record = await store.create("acme", "pro")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SECOND_PROCESS, redis_server.url, cwd=ROOT, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(raw.encode() + b"\n")  # not in argv, where `ps` would show it
        await child.stdin.drain()
        assert await asyncio.wait_for(child.stdout.readline(), 30) == b"ready\n"
        started = time.monotonic()
        await store.revoke(record.id)
        assert await asyncio.wait_for(child.stdout.readline(), 5) == b"revoked\n"
        assert time.monotonic() - started < 1.0
        assert await asyncio.wait_for(child.wait(), 10) == 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


async def test_reconnect_clears_cache_so_a_missed_revocation_is_not_trusted(
    redis: Redis,
) -> None:
    store = KeyStore(redis, KeysPolicy(cache_ttl_s=3600))
    listener = asyncio.create_task(store.listen_for_revocations())
    try:
        await until(lambda: store.listening)
        raw, _ = await store.create("acme", "pro")
        await store.lookup(raw)
        # Revoked while the listener could not hear it: written, never announced.
        await redis.hset(f"igw:key:{apikeys.digest(raw)}", "status", "revoked")
        assert (await store.lookup(raw)).active  # type: ignore[union-attr]
        connects = store.listener_connects
        await redis.client_kill_filter(_type="pubsub")
        await until(lambda: store.listener_connects > connects)
        assert (await store.lookup(raw)).status == "revoked"  # type: ignore[union-attr]
    finally:
        await stop_task(listener)
    assert listener.cancelled()


async def test_listener_survives_redis_restart(tmp_path: Path) -> None:
    proc = RedisProcess(tmp_path / "redis", port=free_port(), fsync="always")
    proc.start()
    redis = Redis.from_url(proc.url)
    store = KeyStore(redis, KeysPolicy(cache_ttl_s=3600))
    listener = asyncio.create_task(store.listen_for_revocations())
    try:
        await until(lambda: store.listening)
        raw, record = await store.create("acme", "pro")
        assert (await store.lookup(raw)).active  # type: ignore[union-attr]
        connects = store.listener_connects
        proc.kill()
        await asyncio.sleep(0.5)  # the listener is now retrying
        assert (await store.lookup(raw)).active  # type: ignore[union-attr]  # cache, no Redis
        await asyncio.to_thread(proc.start)
        await until(lambda: store.listener_connects > connects, within=20)
        assert store.cache_size == 0  # whatever it missed meanwhile is not trusted
        assert (await store.lookup(raw)).active  # type: ignore[union-attr]
        other = Redis.from_url(proc.url)
        try:
            await KeyStore(other, KeysPolicy()).revoke(record.id)
        finally:
            await other.aclose()

        async def revoked() -> bool:
            return (await store.lookup(raw)).status == "revoked"  # type: ignore[union-attr]

        await until(revoked, within=1.0)
    finally:
        await stop_task(listener)
        await redis.aclose()
        proc.stop()
    assert listener.cancelled()


async def test_listener_pings_a_quiet_channel_without_reconnecting(redis: Redis) -> None:
    store = KeyStore(redis, KeysPolicy(), ping_interval_s=0.05)
    listener = asyncio.create_task(store.listen_for_revocations())
    try:
        await until(lambda: store.listening)
        await asyncio.sleep(0.5)  # ten quiet intervals: each PING must be answered
        assert store.listening and store.listener_connects == 1
        raw, record = await store.create("acme", "basic")
        await store.lookup(raw)
        await KeyStore(redis, KeysPolicy()).revoke(record.id)  # another store, same Redis
        await until(lambda: store.cache_size == 0, within=1.0)
        # An unanswered PING means a dead connection (say, a half-open TCP link): reconnect.
        connects = store.listener_connects
        await redis.execute_command("CLIENT", "PAUSE", "300", "ALL")
        await until(lambda: store.listener_connects > connects, within=3.0)
    finally:
        await stop_task(listener)


async def test_listener_cancels_cleanly_while_redis_is_away() -> None:
    redis = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    store = KeyStore(redis, KeysPolicy())
    listener = asyncio.create_task(store.listen_for_revocations())
    await asyncio.sleep(0.3)
    assert not listener.done() and not store.listening
    await stop_task(listener)
    assert listener.cancelled()
    await redis.aclose()


# ---- CLI ------------------------------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="inference-gateway")
    add_commands(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    code: int = args.handler(args)
    return code


@pytest.fixture
def cli_config(tmp_path: Path, redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
               ) -> str:
    sync_redis.Redis.from_url(redis_server.url).flushdb()
    monkeypatch.setenv("GATEWAY_REDIS_URL", redis_server.url)
    return str(write_config(tmp_path / "config", []))


def lookup(url: str, raw: str) -> Any:
    async def go() -> Any:
        redis = Redis.from_url(url)
        try:
            return await KeyStore(redis, KeysPolicy()).lookup(raw)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def test_cli_create_list_show_revoke(
    cli_config: str, redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("keys", "create", "--account", "acme", "--tier", "pro", "--label", "ci",
                   "--config", cli_config) == 0
    out = capsys.readouterr()
    raw = out.out.splitlines()[0]
    assert out.out == raw + "\n"  # the key alone on stdout: `KEY=$(... keys create ...)`
    assert apikeys.well_formed(raw, "igw")
    record = lookup(redis_server.url, raw)
    assert record is not None and record.active and record.tier == "pro"
    assert f"id: {record.id}" in out.err and "not be shown again" in out.err
    printed = out.out + out.err

    assert run_cli("keys", "list", "--config", cli_config) == 0
    listing = capsys.readouterr().out
    assert re.search(rf"{record.id}\s+acme\s+pro\s+active\s+\S+Z\s+ci", listing)
    assert run_cli("accounts", "show", "acme", "--config", cli_config) == 0
    shown = capsys.readouterr().out
    assert "account: acme  keys: 1 (1 active)" in shown and record.id in shown

    assert run_cli("keys", "revoke", record.id, "--config", cli_config) == 0
    assert f"revoked {record.id}" in capsys.readouterr().out
    assert lookup(redis_server.url, raw).status == "revoked"
    assert run_cli("keys", "list", "--account", "acme", "--config", cli_config) == 0
    after = capsys.readouterr().out
    assert "revoked" in after
    for text in (listing, shown, after):
        assert raw not in text
    for text in (printed, listing, shown, after):
        assert not DIGEST_RE.search(text) and record.digest not in text


def test_cli_revoke_by_key_and_unknown(
    cli_config: str, redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("keys", "create", "--account", "acme", "--tier", "basic",
                   "--config", cli_config) == 0
    raw = capsys.readouterr().out.splitlines()[0]
    assert run_cli("keys", "revoke", typo(raw), "--config", cli_config) == 1
    err = capsys.readouterr().err
    assert "no such key" in err and typo(raw) not in err  # a near-key is never echoed
    assert run_cli("keys", "revoke", raw, "--config", cli_config) == 0
    assert raw not in capsys.readouterr().out
    assert lookup(redis_server.url, raw).status == "revoked"
    assert run_cli("accounts", "show", "nobody", "--config", cli_config) == 1


def test_cli_refuses_unknown_tier(cli_config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("keys", "create", "--account", "acme", "--tier", "gold",
                   "--config", cli_config) == 2
    assert "unknown tier 'gold'" in capsys.readouterr().err
    assert run_cli("keys", "list", "--config", cli_config) == 0
    assert "acme" not in capsys.readouterr().out


def test_cli_without_running_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GATEWAY_REDIS_URL", raising=False)
    config = str(write_config(tmp_path / "config", []))
    started = time.monotonic()
    assert run_cli("keys", "list", "--config", config) == 1
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "embedded Redis" in err and "gateway" in err and "must be running" in err


# ---- admin API ------------------------------------------------------------------------------

TOKEN = "admin-token-for-tests"


def admin_app(redis_url: str) -> web.Application:
    """The real gateway app (no backends): the admin routes as operators reach them."""
    folder = write_config(Path(tempfile.mkdtemp(prefix="admin-")), [])
    return build_app(load_config(folder), redis_url=redis_url)


ROUTES = [("POST", "/admin/keys"), ("GET", "/admin/keys"),
          ("DELETE", "/admin/keys/key_000000000000"), ("GET", "/admin/accounts/acme")]


async def test_admin_disabled_without_token(
    aiohttp_client: Any, redis: Redis, redis_server: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
        else:
            monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", value)
        client = await aiohttp_client(admin_app(redis_server.url))
        for method, path in ROUTES:
            for auth in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer x"}):
                resp = await client.request(method, path, headers=auth, json={})
                assert resp.status == 401
                assert (await resp.json())["error"]["type"] == "invalid_api_key"


async def test_admin_missing_or_wrong_token(
    aiohttp_client: Any, redis: Redis, redis_server: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    client = await aiohttp_client(admin_app(redis_server.url))
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                 {"Authorization": f"Bearer {TOKEN}x"}, {"X-API-Key": TOKEN}):
        for method, path in ROUTES:
            resp = await client.request(method, path, headers=auth,
                                        json={"account": "acme", "tier": "pro"})
            assert resp.status == 401, (auth, path)
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            body = await resp.text()
            assert TOKEN not in body
    assert await redis.dbsize() == 0  # nothing was created


async def test_admin_create_list_revoke(
    aiohttp_client: Any, redis: Redis, redis_server: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    client = await aiohttp_client(admin_app(redis_server.url))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    resp = await client.post("/admin/keys", headers=auth,
                             json={"account": "acme", "tier": "pro", "label": "web"})
    assert resp.status == 201
    assert resp.headers["Cache-Control"] == "no-store"
    created = await resp.json()
    raw, key_id = created["key"], created["id"]
    assert apikeys.well_formed(raw, "igw") and "digest" not in created
    assert created | {"created": 0} == {"key": raw, "id": key_id, "account": "acme",
                                        "tier": "pro", "status": "active", "label": "web",
                                        "created": 0}

    listing = await (await client.get("/admin/keys", headers=auth)).text()
    assert key_id in listing and raw not in listing and not DIGEST_RE.search(listing)
    only = await (await client.get("/admin/keys?account=other", headers=auth)).json()
    assert only == {"object": "list", "data": []}
    account = await (await client.get("/admin/accounts/acme", headers=auth)).json()
    assert [k["id"] for k in account["keys"]] == [key_id] and account["account"] == "acme"

    resp = await client.delete(f"/admin/keys/{key_id}", headers=auth)
    assert resp.status == 200 and (await resp.json())["status"] == "revoked"
    record = await KeyStore(redis, KeysPolicy()).lookup(raw)
    assert record is not None and record.status == "revoked"

    for path in ("/admin/keys/key_000000000000", f"/admin/keys/{raw}"):
        resp = await client.delete(path, headers=auth)
        assert resp.status == 404 and raw not in await resp.text()
    assert (await client.get("/admin/accounts/nobody", headers=auth)).status == 404


async def test_admin_bad_bodies(
    aiohttp_client: Any, redis: Redis, redis_server: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    client = await aiohttp_client(admin_app(redis_server.url))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases: list[tuple[Any, list[list[str]]]] = [
        ({}, [["body", "account"], ["body", "tier"]]),
        ({"account": "acme", "tier": "gold"}, [["body", "tier"]]),
        ({"account": "guest:1.2.3.4", "tier": "pro"}, [["body", "account"]]),
        ({"account": "acme", "tier": "pro", "label": "a\nb"}, [["body", "label"]]),
        ({"account": "acme", "tier": "pro", "owner": "x"}, [["body", "owner"]]),
    ]
    for body, locs in cases:
        resp = await client.post("/admin/keys", headers=auth, json=body)
        assert resp.status == 422, body
        answer = await resp.json()
        assert answer["error"]["type"] == "validation_error"
        assert [item["loc"] for item in answer["detail"]] == locs
    for raw_body in (b"{not json", b"[1, 2]"):
        resp = await client.post("/admin/keys", data=raw_body,
                                 headers={**auth, "Content-Type": "application/json"})
        assert resp.status == 400
    resp = await client.post("/admin/keys", headers=auth, data=b'{"account": "acme"}')
    assert resp.status == 415  # JSON only, said so by Content-Type (none here)
    assert (await resp.json())["error"]["type"] == "unsupported_media_type"
    assert await redis.dbsize() == 0


def test_cli_key_piped_to_head_exits_cleanly(cli_config: str, redis_server: RedisProcess
                                             ) -> None:
    # Scripts written for the older two-line output pipe it to `head -n1`: no traceback.
    done = subprocess.run(
        f"{sys.executable} -m proxy keys create --account piped --tier basic "
        f"--config {cli_config} | head -n1", shell=True, capture_output=True, text=True,
        timeout=30, env={**os.environ, "GATEWAY_REDIS_URL": redis_server.url})
    assert done.stdout.startswith("igw_sk_") and len(done.stdout.splitlines()) == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
