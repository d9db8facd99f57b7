"""Blobs in an S3-compatible bucket (AWS S3, SeaweedFS, MinIO, Ceph RGW, R2 ...), shared by
every gateway host: `<prefix><hour>/<digest>/<key>`, the content type as the object's own.

Credentials come from the environment as for any AWS client (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, a profile, an instance role), never from the config folder. Path-style
addressing, which every S3-compatible server answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from proxy.blobs.base import Stat, StoreFailed, hour_expired
from proxy.config import MediaSection

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

CHUNK = 256 * 1024
# Every worker's client would say where it found its credentials, at INFO.
logging.getLogger("aiobotocore.credentials").setLevel(logging.WARNING)
_MISSING = {"404", "NoSuchKey", "NotFound"}


class S3Blobs:
    def __init__(self, media: MediaSection) -> None:
        assert media.bucket is not None  # checked with the config
        self.bucket = media.bucket
        self.prefix = media.prefix
        self.scope = f"s3:{media.endpoint_url or 'aws'}/{media.bucket}/{media.prefix}"
        self._media = media
        self._client: S3Client | None = None
        self._exit: contextlib.AsyncExitStack | None = None
        self._making = asyncio.Lock()

    async def _s3(self) -> S3Client:
        """The client, made at first use (in the worker's own event loop)."""
        async with self._making:
            if self._client is None:
                self._client, self._exit = await self._make()
        return self._client

    async def _make(self) -> tuple[S3Client, contextlib.AsyncExitStack]:
        stack = contextlib.AsyncExitStack()
        config = AioConfig(s3={"addressing_style": "path"}, connect_timeout=5,
                           read_timeout=30, retries={"max_attempts": 3, "mode": "standard"})
        client = await stack.enter_async_context(get_session().create_client(
            "s3", endpoint_url=self._media.endpoint_url, region_name=self._media.region,
            config=config))
        return client, stack

    async def put(self, name: str, content_type: str, data: bytes) -> None:
        s3 = await self._s3()
        await s3.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data,
                            ContentType=content_type)

    async def stat(self, name: str) -> Stat | None:
        s3 = await self._s3()
        try:
            head = await s3.head_object(Bucket=self.bucket, Key=self.prefix + name)
        except ClientError as exc:
            if _code(exc) in _MISSING:
                return None
            raise
        return Stat(head.get("ContentType") or "application/octet-stream", head["ContentLength"])

    async def read(self, name: str, start: int, end: int) -> AsyncIterator[bytes]:
        s3 = await self._s3()
        got = await s3.get_object(Bucket=self.bucket, Key=self.prefix + name,
                                  Range=f"bytes={start}-{end}")
        body = got["Body"]
        try:
            async for chunk in body.iter_chunks(CHUNK):
                yield chunk
        finally:
            body.close()

    async def delete(self, name: str) -> None:
        s3 = await self._s3()
        await s3.delete_object(Bucket=self.bucket, Key=self.prefix + name)

    async def sweep(self, now: float) -> int:
        s3 = await self._s3()
        hours: list[str] = []
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix, Delimiter="/")
        async for page in pages:
            for common in page.get("CommonPrefixes", []):
                hour = common.get("Prefix", "")[len(self.prefix):].rstrip("/")
                if hour_expired(hour, now):
                    hours.append(hour)
        for hour in hours:
            await self._delete_under(s3, f"{self.prefix}{hour}/")
        return len(hours)

    async def _delete_under(self, s3: S3Client, prefix: str) -> None:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        async for page in pages:
            keys: list[Any] = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:  # a page holds at most 1,000: one DeleteObjects each
                await s3.delete_objects(Bucket=self.bucket,
                                        Delete={"Objects": keys, "Quiet": True})

    async def check(self) -> None:
        try:
            s3 = await self._s3()
            await s3.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = _code(exc)
            reason = {"404": "does not exist", "NoSuchBucket": "does not exist",
                      "403": "refuses these credentials (AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY)"}.get(code, f"answers {code}")
            raise StoreFailed(f"the bucket {self.bucket!r} {reason}") from None
        except (BotoCoreError, OSError) as exc:
            raise StoreFailed(f"cannot reach the S3 endpoint: {exc}") from None

    async def close(self) -> None:
        if self._exit is not None:
            await self._exit.aclose()
        self._client = self._exit = None


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
