"""Task records and their queue, in Redis (their media: proxy.blobs).

Per account A (hash tag `{A}`: the poll route looks under the caller's own account, so another
account's task is simply not there: 404):

    igw:{A}:task:<id>     hash    status (running | completed | failed), spec, result or error,
                                  created_at, updated_at; expires `result_ttl_s` after it ends
                                  (while running: after `result_ttl_s` plus the longest run)
    igw:{A}:tasks_open    string  tasks submitted and not yet ended (the per-account cap)

The queue is one stream, `igw:tasks` (entries name the account and task), read by the consumer
group `igw-runners` (proxy.tasks.runner).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import orjson
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from proxy.store.client import Store
from proxy.tasks.spec import DECODER, ENCODER, TaskSpec

QUEUE = "igw:tasks"
GROUP = "igw-runners"

# Refuse past the cap; else count the task and write its record, in one step (the queue is
# another key, in another Cluster slot: `TaskStore.submit` adds the entry next).
# KEYS: open counter, task hash. ARGV: cap, spec, now, record ttl.
_SUBMIT = """
local open = tonumber(redis.call('GET', KEYS[1]) or '0')
if open >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('HSET', KEYS[2], 'status', 'running', 'spec', ARGV[2], 'created_at', ARGV[3],
           'updated_at', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""
# End a running task once: its outcome, the record's new expiry, one fewer open task.
# KEYS: task hash, open counter. ARGV: status, field (result | error), value, now, ttl.
_FINISH = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3], 'updated_at', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
local open = tonumber(redis.call('DECR', KEYS[2]))
if open < 0 then redis.call('SET', KEYS[2], 0) end
return 1
"""


def task_key(account: str, task_id: str) -> str:
    return f"igw:{{{account}}}:task:{task_id}"


def open_key(account: str) -> str:
    return f"igw:{{{account}}}:tasks_open"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class TaskStore:
    def __init__(self, redis: Store) -> None:
        self.redis = redis
        self._submit = redis.register_script(_SUBMIT)
        self._finish = redis.register_script(_FINISH)

    async def submit(self, spec: TaskSpec, *, max_open: int, record_ttl_s: int) -> bool:
        """Record and queue the task; False when the account already has `max_open` open.

        Two steps (record, then queue entry). If the entry cannot be added, the task is ended
        as failed (freeing its place under the cap) and the error raised. A process that dies
        between the two leaves a record that stays `running` until it expires, counted under
        the cap until then; its hold expires and is released."""
        done = await self._submit(
            keys=[open_key(spec.account), task_key(spec.account, spec.id)],
            args=[max_open, ENCODER.encode(spec), int(time.time()), record_ttl_s])
        if not done:
            return False
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(QUEUE, {"account": spec.account, "id": spec.id})
                # The runners' group, made with the first task (from the stream's start: nothing
                # is missed); afterwards this answers BUSYGROUP.
                pipe.xgroup_create(QUEUE, GROUP, id="0")
                added, _ = await pipe.execute(raise_on_error=False)
            if isinstance(added, Exception):
                raise added
        except RedisError:
            with contextlib.suppress(RedisError):
                await self.finish(spec.account, spec.id, ttl_s=record_ttl_s, error={
                    "type": "service_unavailable", "message": "the task could not be queued"})
            raise
        return True

    async def record(self, account: str, task_id: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(task_key(account, task_id))
        if not raw:
            return None
        return {_text(k): _text(v) for k, v in raw.items()}

    async def spec(self, account: str, task_id: str) -> tuple[str, TaskSpec] | None:
        """(status, spec) of a task, None when it is gone (expired)."""
        status, spec = await self.redis.hmget(task_key(account, task_id), "status", "spec")
        if status is None or spec is None:
            return None
        return _text(status), DECODER.decode(spec)

    async def finish(self, account: str, task_id: str, *, result: Any = None,
                     error: dict[str, Any] | None = None, ttl_s: int) -> bool:
        """End the task (completed with `result`, or failed with `error`); False when it had
        already ended (another worker finished it)."""
        status, field, value = ("failed", "error", error) if error is not None else (
            "completed", "result", result)
        done = await self._finish(
            keys=[task_key(account, task_id), open_key(account)],
            args=[status, field, orjson.dumps(value), int(time.time()), ttl_s])
        return bool(done)

    async def put_completed(self, account: str, task_id: str, result: Any, *, ttl_s: int,
                            extra: dict[str, Any] | None = None) -> None:
        """A task that ran where its caller waited (a network-mode run): completed at once."""
        now = int(time.time())
        name = task_key(account, task_id)
        fields: dict[FieldT, EncodableT] = {
            "status": "completed", "result": orjson.dumps(result), "created_at": now,
            "updated_at": now, "task_address": task_id,
            **{k: orjson.dumps(v) for k, v in (extra or {}).items()}}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(name, mapping=fields)
            pipe.expire(name, ttl_s)
            await pipe.execute()
