"""Admission's command packer writes exactly what redis-py's pure-Python one does (no server); the
pipe's batches and its bounded handshake against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.store.redis_process import RedisProcess
from proxy.store.script_pipe import REPLY_TIMEOUT_S, ScriptPipe, resp_command


@pytest.mark.parametrize("args", [
    ("EVALSHA", "a" * 40, 4, "igw:{acct}:rl:max", "igw:{acct}:bal", 100000, 60000, "", 0),
    ("EVALSHA", "b" * 40, 1, "igw:{guest:10.0.0.1}:rl:guest", -1, 2.5, b"\x00\xffraw"),
    ("EVALSHA", "c" * 40, 0, "ünïcode ✓", 10**18),
])
def test_packs_as_redis_py_does(args: tuple[object, ...]) -> None:
    assert resp_command(args) == b"".join(Connection().pack_command(*args))


@pytest.mark.parametrize("bad", [True, None, [1]])
def test_refuses_what_redis_py_refuses(bad: object) -> None:
    with pytest.raises(DataError):
        resp_command(("EVALSHA", "a" * 40, 0, bad))


async def test_a_pipeline_answers_in_order_and_raises_its_first_error(
        clean_redis: RedisProcess) -> None:
    """The settler's batches: every command runs (an error reply does not stop the rest), the
    replies come back in order, and an error reply is raised once all are in."""
    redis = Redis.from_url(clean_redis.url)
    pipe = ScriptPipe(redis)
    try:
        assert await pipe.pipeline([("SET", "a", 1), ("INCR", "a"), ("GET", "a")]) == \
            [b"OK", 2, b"2"]
        with pytest.raises(ResponseError):
            await pipe.pipeline([("SET", "b", "x"), ("INCR", "b"), ("SET", "c", 3)])
        assert await redis.get("c") == b"3"  # after the failing one, still run
        assert await pipe.pipeline([("DEL", "a", "b", "c")]) == [3]  # the connection is fine
    finally:
        await pipe.close()
        await redis.aclose()


async def test_a_handshake_that_never_ends_is_bounded(clean_redis: RedisProcess) -> None:
    """A Redis that accepts but does not answer: the connect fails in REPLY_TIMEOUT_S, not
    never (admission answers 503 instead of hanging)."""
    admin = Redis.from_url(clean_redis.url)
    redis = Redis.from_url(clean_redis.url)
    pipe = ScriptPipe(redis)
    try:
        await admin.execute_command("CLIENT", "PAUSE", str(int(REPLY_TIMEOUT_S * 1000) + 1000))
        started = asyncio.get_running_loop().time()
        with pytest.raises(RedisTimeoutError):
            await pipe.pipeline([("PING",)])
        assert asyncio.get_running_loop().time() - started < REPLY_TIMEOUT_S + 0.5
    finally:
        await pipe.close()
        await admin.execute_command("CLIENT", "UNPAUSE")
        await redis.aclose()
        await admin.aclose()


async def test_a_script_redis_does_not_know_is_loaded_and_run(clean_redis: RedisProcess) -> None:
    """NOSCRIPT comes back as redis-py's NoScriptError (after a Redis restart the script cache is
    empty): the pipe loads the script and runs it again, once."""
    redis = Redis.from_url(clean_redis.url)
    pipe = ScriptPipe(redis)
    script = redis.register_script("return {tonumber(ARGV[1]) + 1, KEYS[1]}")
    try:
        await redis.script_flush()
        assert await pipe.call(script, ["k"], [41]) == [42, b"k"]
        assert await redis.script_exists(script.sha) == [True]
    finally:
        await pipe.close()
        await redis.aclose()


async def test_a_reply_that_never_comes_fails_the_call_and_the_next_call_connects_again(
        clean_redis: RedisProcess) -> None:
    """A Redis that stops answering an open connection (paused, hung): the waiting call fails
    within REPLY_TIMEOUT_S (admission answers 503), and once Redis answers again a new call
    gets a new connection."""
    admin = Redis.from_url(clean_redis.url)
    redis = Redis.from_url(clean_redis.url)
    pipe = ScriptPipe(redis)
    try:
        assert await pipe.pipeline([("PING",)]) == [b"PONG"]  # connected before the pause
        await admin.execute_command("CLIENT", "PAUSE", str(int(REPLY_TIMEOUT_S * 1000) + 1000))
        started = asyncio.get_running_loop().time()
        with pytest.raises(RedisTimeoutError):
            await pipe.pipeline([("INCR", "n")])
        assert asyncio.get_running_loop().time() - started < REPLY_TIMEOUT_S + 0.5
        await admin.execute_command("CLIENT", "UNPAUSE")
        assert await pipe.pipeline([("PING",)]) == [b"PONG"]
    finally:
        await pipe.close()
        await admin.execute_command("CLIENT", "UNPAUSE")
        await redis.aclose()
        await admin.aclose()


async def test_a_connection_closed_under_waiting_calls_fails_them_at_once(
        clean_redis: RedisProcess) -> None:
    """Redis closes the connection while calls wait (killed, restarted): each gets a
    ConnectionError at once, not after the reply timeout, and the next call connects again."""
    admin = Redis.from_url(clean_redis.url)
    redis = Redis.from_url(clean_redis.url)
    pipe = ScriptPipe(redis)
    try:
        waiting = asyncio.ensure_future(pipe.pipeline([("BLPOP", "nothing", "30")]))
        behind = asyncio.ensure_future(pipe.pipeline([("PING",)]))
        await asyncio.sleep(0.2)  # both sent, the first one blocked in Redis
        started = asyncio.get_running_loop().time()
        assert await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        for call in (waiting, behind):
            with pytest.raises(RedisConnectionError):
                await call
        assert asyncio.get_running_loop().time() - started < 1.0
        assert await pipe.pipeline([("PING",)]) == [b"PONG"]
    finally:
        await pipe.close()
        await redis.aclose()
        await admin.aclose()


async def test_a_resp3_connection_is_read_alike(clean_redis: RedisProcess) -> None:
    """A client whose URL asks for RESP3 (the handshake is redis-py's HELLO 3): replies in the
    new protocol's framing pair with their calls as before."""
    redis = Redis.from_url(clean_redis.url, protocol=3)
    pipe = ScriptPipe(redis)
    script = redis.register_script("return {1, KEYS[1], false}")
    try:
        assert await pipe.pipeline([("HSET", "h", "f", 1), ("HGETALL", "h"), ("PING",)]) == \
            [1, {b"f": b"1"}, b"PONG"]
        assert await pipe.call(script, ["k"], []) == [1, b"k", None]  # Lua's false: a null
    finally:
        await pipe.close()
        await redis.aclose()
