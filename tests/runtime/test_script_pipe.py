"""Admission's own command packer writes exactly what redis-py's does (pure, no server)."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from proxy.runtime.script_pipe import resp_command


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
