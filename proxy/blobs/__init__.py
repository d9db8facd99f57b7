"""Where finished tasks' audio, images and video are kept until they expire: never in the
ledger's Redis.

    names     `<hour>/<account digest>/<key>`: the key is `<expires_at>-<random>`, the hour
              `expires_at // 3600`; the digest is the owner's (sha256 of the account), so a
              key is found only under its owner's own name (another account's: 404), and a
              sweep deletes whole hours once every blob in them has expired
    stores    `files` (proxy.blobs.files): a folder under the gateway's data_dir, written
              atomically, on this host only; `s3` (proxy.blobs.s3): an S3-compatible bucket
              every gateway host shares, so any gateway serves any key
    quota     proxy.blobs.quota: the bytes each account keeps, capped, counted in the ledger's
              Redis (a few bytes per blob, never the blob)

proxy.blobs.media.MediaStore puts the three together; `open_blobs` picks the store backends.toml
`[media]` names.
"""

from __future__ import annotations

from proxy.blobs.base import Blobs, StoreFailed
from proxy.config import MediaSection


def open_blobs(media: MediaSection, data_dir: str) -> Blobs:
    """The configured store (the S3 client is imported only when it is used: ~20 MB)."""
    if media.store == "s3":
        from proxy.blobs.s3 import S3Blobs

        return S3Blobs(media)
    from pathlib import Path

    from proxy.blobs.files import FileBlobs

    return FileBlobs(Path(data_dir) / media.path)


async def media_problem(media: MediaSection, data_dir: str) -> str | None:
    """Why the configured store cannot be used now (`serve` refuses to start), or None."""
    blobs = open_blobs(media, data_dir)
    try:
        await blobs.check()
    except StoreFailed as exc:
        return str(exc)
    finally:
        await blobs.close()
    return None


def describe_media(media: MediaSection, data_dir: str) -> str:
    if media.store == "s3":
        return f"s3, {media.endpoint_url or 'AWS'} bucket {media.bucket}"
    from pathlib import Path

    return f"files, {Path(data_dir) / media.path}"


__all__ = ["Blobs", "describe_media", "media_problem", "open_blobs"]
