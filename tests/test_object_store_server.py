"""The session's object server is a real S3 server, and aiobotocore's async client (the one the
gateway's media store is to use) works against it: whole and ranged reads of a ~3 MB object,
listing, deletion, and the errors a client must tell apart (a bad signature, a missing key)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
from aiobotocore.session import get_session
from botocore.exceptions import ClientError

from tests.support.object_store import S3Server, client_config

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

SIZE = 3 * 1024 * 1024 + 17  # ~3 MB, an odd size: a media file's order, not a round number


@asynccontextmanager
async def _client(server: S3Server, secret_key: str | None = None) -> AsyncIterator[S3Client]:
    async with get_session().create_client(
            "s3", endpoint_url=server.endpoint, region_name=server.region,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key if secret_key is None else secret_key,
            config=client_config()) as client:
        yield client


async def test_objects_round_trip_on_a_real_server(s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    body = os.urandom(SIZE)
    async with _client(server) as s3:
        put = await s3.put_object(Bucket=bucket, Key="media/clip.bin", Body=body,
                                  ContentType="application/octet-stream")
        assert put["ResponseMetadata"]["HTTPStatusCode"] == 200

        got = await s3.get_object(Bucket=bucket, Key="media/clip.bin")
        assert got["ContentLength"] == SIZE
        async with got["Body"] as stream:
            assert await stream.read() == body

        ranged = await s3.get_object(Bucket=bucket, Key="media/clip.bin", Range="bytes=100-199")
        assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert ranged["ContentRange"] == f"bytes 100-199/{SIZE}"
        async with ranged["Body"] as stream:
            assert await stream.read() == body[100:200]

        listed = await s3.list_objects_v2(Bucket=bucket, Prefix="media/")
        assert [(o["Key"], o["Size"]) for o in listed["Contents"]] == [("media/clip.bin", SIZE)]

        await s3.delete_object(Bucket=bucket, Key="media/clip.bin")
        assert (await s3.list_objects_v2(Bucket=bucket)).get("KeyCount") == 0
        with pytest.raises(ClientError) as missing:
            await s3.get_object(Bucket=bucket, Key="media/clip.bin")
        assert missing.value.response["Error"]["Code"] == "NoSuchKey"


async def test_a_wrong_secret_key_is_refused(s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    async with _client(server, secret_key=server.secret_key + "x") as s3:
        with pytest.raises(ClientError) as refused:
            await s3.put_object(Bucket=bucket, Key="intruder", Body=b"x")
        assert refused.value.response["Error"]["Code"] in ("AccessDenied",
                                                           "SignatureDoesNotMatch")
    async with _client(server) as s3:
        assert (await s3.list_objects_v2(Bucket=bucket)).get("KeyCount") == 0
