"""Async tasks' media lives in a blob store made for it (proxy.blobs), never in the ledger's Redis:
a folder under the data dir by default, written atomically and swept by the hour; the bytes an
account keeps are capped; Range is served from the store. The S3 store: test_media_s3.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from proxy.appkeys import CONFIG, MEDIA
from proxy.blobs.base import HOUR_S
from proxy.blobs.media import MediaStore
from proxy.simulators.speech import speech_seconds
from tests.support.fleet import REPO
from tests.support.media_stack import Media, MediaFactory

TTS = "/v2/audio/tts/engine"


def wav_size(text: str) -> int:
    """The bytes of the simulator's speech for `text` (24 kHz, 16-bit, a 44-byte header)."""
    return 44 + 2 * round(speech_seconds(text, 1.0) * 24000)


def folder(m: Media) -> Path:
    return m.gateway.app[CONFIG].data_dir / "media"


def blob_path(m: Media, account: str, key: str) -> Path:
    expires_at = int(key.partition("-")[0])
    digest = hashlib.sha256(account.encode()).hexdigest()[:32]
    return folder(m) / str(expires_at // HOUR_S) / digest / key


async def test_media_goes_to_the_folder_and_never_into_the_ledger(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("basic", "acct-blob")
    text = "Kept in a folder made for blobs. " * 12
    record = await m.async_speech(text, headers)
    assert record["status"] == "completed", record
    result = record["result"]
    assert result["bytes"] == wav_size(text) > 100_000
    status, got, wav = await m.get(result["media_url"], headers)
    assert status == 200 and got["Content-Type"] == "audio/wav" and len(wav) == result["bytes"]
    assert got["X-Request-Id"] and got["Accept-Ranges"] == "bytes"
    # On disk: the content type's line, then the bytes; nothing left half-written.
    stored = blob_path(m, "acct-blob", result["media_key"]).read_bytes()
    assert stored == b"audio/wav\n" + wav
    assert list((folder(m) / "tmp").iterdir()) == []
    # The ledger's Redis holds a count of the bytes, not the bytes.
    sizes = [await m.redis.memory_usage(k) or 0 async for k in m.redis.scan_iter("*")]
    assert max(sizes) < 10_000, "a blob was written into the ledger's Redis"
    assert int(await m.redis.get("igw:{acct-blob}:media_bytes")) == len(wav)
    # Range comes from the store: a span in the middle, the tail, and one past the end.
    status, got, part = await m.get(result["media_url"], {**headers, "Range": "bytes=1000-1999"})
    assert status == 206 and part == wav[1000:2000]
    assert got["Content-Range"] == f"bytes 1000-1999/{len(wav)}"
    assert got["Content-Length"] == "1000"
    status, _, tail = await m.get(result["media_url"], {**headers, "Range": "bytes=-7"})
    assert status == 206 and tail == wav[-7:]
    status, got, _ = await m.get(result["media_url"], {**headers, "Range": f"bytes={len(wav)}-"})
    assert status == 416 and got["Content-Range"] == f"bytes */{len(wav)}"
    # Another account, a made-up key, a malformed one: 404 alike.
    other = await m.key("basic", "acct-other")
    assert (await m.get(result["media_url"], other))[0] == 404
    made_up = f"/v2/audio/media/{int(time.time()) + 600}-{'0' * 32}"
    assert (await m.get(made_up, headers))[0] == 404
    assert (await m.get("/v2/audio/media/..%2F..%2Fredis", headers))[0] == 404


async def test_the_bytes_an_account_keeps_are_capped(media: MediaFactory) -> None:
    """Past the cap a finished task fails and is not charged; while the account is at its cap,
    async requests are refused with 429 and nothing is held. Other accounts are not affected."""
    long_text, short_text = "Fifty characters of speech to fill the store, now.", "Ten chars."
    cap = wav_size(long_text) + wav_size(short_text)
    m = await media(requests_toml=f"[tasks]\nmax_media_bytes_per_account = {cap}\n")
    headers = await m.key("basic", "acct-cap")
    first = await m.async_speech(long_text, headers)
    assert first["status"] == "completed", first
    refused = await m.async_speech(long_text, headers)  # would pass the cap: fails, not charged
    assert refused["status"] == "failed"
    assert refused["error"]["type"] == "rate_limited" and refused["error"]["status"] == 429
    assert "cap" in refused["error"]["message"]
    third = await m.async_speech(short_text, headers)  # fits exactly
    assert third["status"] == "completed", third
    assert int(await m.redis.get("igw:{acct-cap}:media_bytes")) == cap
    status, got, raw = await m.post(TTS, {"text": "More.", "async": True}, headers)
    assert status == 429 and got["Retry-After"] == "60", raw
    assert orjson.loads(raw)["error"]["type"] == "rate_limited"
    charges = await m.charges("acct-cap")  # the refused two: their holds released, cost 0
    assert sorted(c.get("characters", 0) for c in charges if c["cost"]) == \
        [len(short_text), len(long_text)]
    assert len(charges) == 4 and sum(1 for c in charges if c["cost"] == 0) == 2
    # Synchronous requests keep nothing, so they still run; another account has its own cap.
    status, _, _ = await m.post(TTS, {"text": "Sync."}, headers)
    assert status == 200
    neighbour = await m.key("basic", "acct-neighbour")
    assert (await m.async_speech(long_text, neighbour))["status"] == "completed"
    # On disk: only what was kept (the refused one was never written).
    assert len(list(folder(m).glob("*/*/*"))) == 3


async def test_expired_media_leaves_the_quota_and_the_sweep_deletes_it(
        media: MediaFactory) -> None:
    m = await media(requests_toml="[tasks]\nresult_ttl_s = 60\n")
    headers = await m.key("basic", "acct-sweep")
    result = (await m.async_speech("Swept within the hour.", headers))["result"]
    store: MediaStore = m.gateway.app[MEDIA]
    path = blob_path(m, "acct-sweep", result["media_key"])
    expires_at = int(result["media_key"].partition("-")[0])
    # Before the hour is over nothing is swept; once every blob of it has expired, all goes.
    assert await store.sweep(now=expires_at) == 0 and path.exists()
    leftover = folder(m) / "tmp" / "crashed-write"
    leftover.write_bytes(b"half")
    os.utime(leftover, (time.time() - 2 * HOUR_S,) * 2)
    fresh = folder(m) / "tmp" / "write-in-progress"
    fresh.write_bytes(b"half")
    assert await store.sweep(now=(expires_at // HOUR_S + 1) * HOUR_S) == 1
    assert not path.exists() and not path.parent.parent.exists()
    assert not leftover.exists() and fresh.exists()  # only writes a crash left behind
    assert (await m.get(result["media_url"], headers))[0] == 404
    # Its bytes leave the account's count once it has expired.
    usage = await store.quota.check("acct-sweep", expires_at + 1, cap=1)
    assert usage.fits and usage.stored == 0
    assert await m.redis.get("igw:{acct-sweep}:media_bytes") is None


async def test_a_store_that_cannot_be_written_fails_the_task_uncharged(
        media: MediaFactory, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the media folder should be")
    m = await media(store={"path": str(blocked)})
    headers = await m.key("basic", "acct-broken")
    record = await m.async_speech("Nowhere to keep this.", headers)
    assert record["status"] == "failed"
    assert record["error"]["status"] == 503 and "media store" in record["error"]["message"]
    [refund] = await m.charges("acct-broken")
    assert refund["cost"] == 0 and refund["status"] == "failed"
    # Its reservation was given back.
    assert await m.redis.get("igw:{acct-broken}:media_bytes") is None


def test_serve_refuses_a_media_folder_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file, not a folder")
    (tmp_path / "backends.toml").write_text('[media]\nstore = "files"\npath = "../taken/media"\n')
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 1
    assert "cannot use the media store ([media] in backends.toml): cannot write in" \
        in done.stderr
    assert not (tmp_path / ".gateway" / "redis").exists()  # nothing was started
