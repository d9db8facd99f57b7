"""The S3 media store against a real S3-compatible server (SeaweedFS, tests/support/object_store):
media made on one gateway is served by another, Range is read from the bucket, the sweep deletes
expired hours, and `serve` refuses a bucket it cannot use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import get_session

from proxy.appkeys import MEDIA
from proxy.blobs.base import HOUR_S
from tests.support.fleet import REPO
from tests.support.media_stack import MediaFactory
from tests.support.object_store import S3Server
from tests.support.processes import free_port

TTS = "/v2/audio/tts/engine"


def s3_config(server: S3Server, bucket: str) -> dict[str, Any]:
    """backends.toml's [media] for the bucket, as docs/async-network.md shows it."""
    return {"store": "s3", "endpoint_url": server.endpoint, "bucket": bucket,
            "region": server.region, "prefix": "igw-media/"}


@pytest.fixture
def s3_env(s3_bucket: tuple[S3Server, str], monkeypatch: pytest.MonkeyPatch
           ) -> tuple[S3Server, str]:
    """The credentials where every AWS client looks: the environment."""
    server, bucket = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    return server, bucket


async def objects(server: S3Server, bucket: str) -> dict[str, Any]:
    async with get_session().create_client(
            "s3", endpoint_url=server.endpoint, region_name=server.region,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key) as s3:
        listed = await s3.list_objects_v2(Bucket=bucket)
        found = {}
        for item in listed.get("Contents", []):
            head = await s3.head_object(Bucket=bucket, Key=item["Key"])
            found[item["Key"]] = head["ContentType"], item["Size"]
        return found


async def test_any_gateway_serves_media_kept_in_the_bucket(
        media: MediaFactory, s3_env: tuple[S3Server, str]) -> None:
    server, bucket = s3_env
    made_here = await media(store=s3_config(server, bucket))
    served_there = await media(store=s3_config(server, bucket))  # another host, same bucket
    headers = await made_here.key("basic", "acct-s3")
    record = await made_here.async_speech("Kept in a bucket every gateway shares. " * 6, headers)
    assert record["status"] == "completed", record
    result = record["result"]
    status, got, wav = await served_there.get(result["media_url"], headers)
    assert status == 200 and got["Content-Type"] == "audio/wav"
    assert len(wav) == result["bytes"] > 50_000
    status, got, part = await served_there.get(result["media_url"],
                                  {**headers, "Range": "bytes=44-1043"})
    assert status == 206 and part == wav[44:1044]
    assert got["Content-Range"] == f"bytes 44-1043/{len(wav)}"
    status, _, _ = await served_there.get(result["media_url"],
                             {**headers, "Range": f"bytes={len(wav) + 5}-"})
    assert status == 416
    other = await made_here.key("basic", "acct-s3-other")
    assert (await served_there.get(result["media_url"], other))[0] == 404
    # In the bucket under the prefix, with its type; in the ledger only a count.
    [(name, (content_type, size))] = (await objects(server, bucket)).items()
    assert name.startswith("igw-media/") and name.endswith(result["media_key"])
    assert (content_type, size) == ("audio/wav", len(wav))
    assert int(await made_here.redis.get("igw:{acct-s3}:media_bytes")) == len(wav)
    sizes = [await made_here.redis.memory_usage(k) or 0
             async for k in made_here.redis.scan_iter("*")]
    assert max(sizes) < 10_000
    # The sweep (either gateway) deletes the hour once all of it has expired.
    expires_at = int(result["media_key"].partition("-")[0])
    store = served_there.gateway.app[MEDIA]
    assert await store.sweep(now=expires_at) == 0 and await objects(server, bucket)
    assert await store.sweep(now=(expires_at // HOUR_S + 1) * HOUR_S) == 1
    assert await objects(server, bucket) == {}


async def test_an_unreachable_bucket_fails_the_task_uncharged(
        media: MediaFactory, s3_env: tuple[S3Server, str]) -> None:
    server, bucket = s3_env
    nowhere = {**s3_config(server, bucket), "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    m = await media(store=nowhere)
    headers = await m.key("basic", "acct-s3-down")
    record = await m.async_speech("Nowhere to go.", headers)
    assert record["status"] == "failed" and record["error"]["status"] == 503
    assert [c["cost"] for c in await m.charges("acct-s3-down")] == [0]
    assert await m.redis.get("igw:{acct-s3-down}:media_bytes") is None


@pytest.mark.parametrize(("change", "env", "reason"), [
    ({"bucket": "no-such-bucket"}, {}, "'no-such-bucket' does not exist"),
    ({}, {"AWS_SECRET_ACCESS_KEY": "wrong"}, "refuses these credentials"),
])
def test_serve_refuses_a_bucket_it_cannot_use(
        s3_env: tuple[S3Server, str], tmp_path: Path, change: dict[str, str],
        env: dict[str, str], reason: str) -> None:
    server, bucket = s3_env
    media = {**s3_config(server, bucket), **change}
    (tmp_path / "backends.toml").write_text(
        "[media]\n" + "".join(f'{k} = "{v}"\n' for k, v in media.items()))
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(tmp_path)],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 1
    assert "cannot use the media store ([media] in backends.toml): the bucket " in done.stderr
    assert reason in done.stderr
    assert server.secret_key not in done.stderr + done.stdout
