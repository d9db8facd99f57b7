"""Keeping a task's media for its owner, and finding it again: the blob store and the quota."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from aiohttp import web
from redis.exceptions import RedisError

from proxy.blobs.base import Blobs, Stat, StoreFailed, blob_name, expiry, new_key
from proxy.blobs.quota import MediaQuota, Usage
from proxy.store.client import Store

log = logging.getLogger("proxy")


@dataclass(frozen=True, slots=True)
class Stored:
    """A blob found for its owner: what it is, and a reader of any span of it."""

    stat: Stat
    blobs: Blobs
    name: str

    def read(self, start: int, end: int) -> AsyncIterator[bytes]:
        return self.blobs.read(self.name, start, end)


class MediaStore:
    def __init__(self, blobs: Blobs, redis: Store) -> None:
        self.blobs = blobs
        self.quota = MediaQuota(redis)

    async def keep(self, account: str, content_type: str, data: bytes, *, ttl_s: int,
                   cap: int) -> str | None:
        """Store the blob for `ttl_s`; its key, or None when the account's stored bytes would
        pass `cap`. Counted before it is written, given back if the write fails."""
        now = int(time.time())
        expires_at = now + ttl_s
        key = new_key(expires_at)
        try:
            usage = await self.quota.reserve(account, key, len(data), expires_at, now, cap)
        except RedisError as exc:
            raise StoreFailed("the quota could not be counted") from exc
        if not usage.fits:
            return None
        try:
            await self.blobs.put(blob_name(account, key, expires_at), content_type, data)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await self.quota.release(account, key, len(data))
            if isinstance(exc, Exception):
                raise StoreFailed("the blob could not be written") from exc
            raise
        return key

    async def room(self, account: str, cap: int) -> Usage:
        """Whether the account may store more now (checked when a task is submitted)."""
        try:
            return await self.quota.check(account, int(time.time()), cap)
        except RedisError as exc:
            raise StoreFailed("the quota could not be read") from exc

    async def find(self, account: str, key: str) -> Stored | None:
        """The caller's own blob under `key`; None when it is not theirs, expired or gone."""
        expires_at = expiry(key)
        if expires_at is None or expires_at <= time.time():
            return None
        name = blob_name(account, key, expires_at)
        try:
            stat = await self.blobs.stat(name)
        except Exception as exc:
            raise StoreFailed("the blob store could not be read") from exc
        return Stored(stat, self.blobs, name) if stat is not None else None

    async def sweep(self, now: float | None = None) -> int:
        return await self.blobs.sweep(time.time() if now is None else now)

    async def close(self) -> None:
        await self.blobs.close()


async def send_stored(request: web.Request, found: Stored, *, status: int = 200,
                      span: tuple[int, int] | None = None,
                      headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """Stream the blob (or bytes `span`, inclusive: a 206 for a Range) to the client. A store
    that fails mid-body closes the connection short of its Content-Length."""
    size = found.stat.size
    response = web.StreamResponse(status=status, headers={
        **(headers or {}), "Content-Type": found.stat.content_type, "Accept-Ranges": "bytes"})
    start, end = span or (0, size - 1)
    if span is not None:
        response.set_status(206)
        response.headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    response.content_length = end - start + 1
    await response.prepare(request)
    if request.method == "HEAD" or size == 0:
        return response
    try:
        async for chunk in found.read(start, end):
            await response.write(chunk)
    except ConnectionResetError:
        raise  # the client left
    except Exception:
        log.warning("stored media %s could not be read to the end", found.name, exc_info=True)
        if request.transport is not None:
            request.transport.close()
        return response
    await response.write_eof()
    return response


__all__ = ["MediaStore", "Stored", "Usage", "send_stored"]
