"""What a blob store does, and how blobs are named (pure: no I/O)."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

HOUR_S = 3600
KEY_PATTERN = r"^([0-9]{10,12})-([0-9a-f]{32})$"  # what `new_key` makes: expiry, random part
_KEY = re.compile(KEY_PATTERN)


class StoreFailed(Exception):
    """The blob store (or the quota's Redis) could not be reached or refused the work."""


@dataclass(frozen=True, slots=True)
class Stat:
    content_type: str
    size: int


class Blobs(Protocol):
    # What one sweep covers (one sweeper per scope: a host's folder, or a shared bucket).
    scope: str

    async def put(self, name: str, content_type: str, data: bytes) -> None:
        """Write the blob whole; readers never see a part of it."""

    async def stat(self, name: str) -> Stat | None:
        """Its type and size; None when it is not there."""

    def read(self, name: str, start: int, end: int) -> AsyncIterator[bytes]:
        """Bytes `start` to `end` (inclusive), in chunks."""

    async def delete(self, name: str) -> None:
        """Gone (a blob that is not there is no error)."""

    async def sweep(self, now: float) -> int:
        """Delete every hour whose blobs have all expired by `now`; how many hours went."""

    async def check(self) -> None:
        """Usable now (`serve` asks before it starts); else StoreFailed says why."""

    async def close(self) -> None: ...


def new_key(expires_at: int) -> str:
    return f"{expires_at}-{secrets.token_hex(16)}"


def expiry(key: str) -> int | None:
    """When a well-formed key expires; None for anything else (a plain 404)."""
    match = _KEY.match(key)
    return int(match.group(1)) if match else None


def blob_name(account: str, key: str, expires_at: int) -> str:
    digest = hashlib.sha256(account.encode()).hexdigest()[:32]
    return f"{expires_at // HOUR_S}/{digest}/{key}"


def hour_expired(hour: str, now: float) -> bool:
    """An hour folder whose every blob has expired (its name is `expires_at // 3600`)."""
    return hour.isdigit() and (int(hour) + 1) * HOUR_S <= now
