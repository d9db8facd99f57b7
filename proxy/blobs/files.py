"""Blobs in a folder on this host: `<root>/<hour>/<digest>/<key>`, each file its content type's
line and then its bytes. Written to `<root>/tmp/` and renamed into place (readers see a whole
blob or none); file work runs in threads, off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

from proxy.blobs.base import Stat, StoreFailed, hour_expired
from proxy.ids import hex_id

CHUNK = 256 * 1024
STALE_TMP_S = 3600  # a write left behind by a crash


class FileBlobs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.scope = f"files:{socket.gethostname()}:{root.resolve()}"  # one sweeper per host
        self._tmp = root / "tmp"

    async def put(self, name: str, content_type: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, name, content_type.encode() + b"\n" + data)

    def _put(self, name: str, data: bytes) -> None:
        self._tmp.mkdir(parents=True, exist_ok=True)
        final = self.root / name
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp / hex_id()
        try:
            with tmp.open("wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())  # else a crash can leave a renamed, empty file
            tmp.replace(final)
        finally:
            tmp.unlink(missing_ok=True)

    async def stat(self, name: str) -> Stat | None:
        return await asyncio.to_thread(self._stat, self.root / name)

    @staticmethod
    def _stat(path: Path) -> Stat | None:
        try:
            with path.open("rb") as blob:
                head = blob.readline(256)
                size = os.fstat(blob.fileno()).st_size - len(head)
        except OSError:
            return None
        return Stat(head.rstrip(b"\n").decode(errors="replace"), size)

    async def read(self, name: str, start: int, end: int) -> AsyncIterator[bytes]:
        blob = await asyncio.to_thread((self.root / name).open, "rb")
        try:
            offset = len(await asyncio.to_thread(blob.readline, 256))
            await asyncio.to_thread(blob.seek, offset + start)
            left = end - start + 1
            while left > 0:
                chunk = await asyncio.to_thread(blob.read, min(CHUNK, left))
                if not chunk:
                    return  # cut short (swept while read): the response ends short
                left -= len(chunk)
                yield chunk
        finally:
            blob.close()

    async def delete(self, name: str) -> None:
        await asyncio.to_thread((self.root / name).unlink, True)

    async def sweep(self, now: float) -> int:
        return await asyncio.to_thread(self._sweep, now)

    def _sweep(self, now: float) -> int:
        swept = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if entry.is_dir() and hour_expired(entry.name, now):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    swept += 1
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self._tmp):
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < time.time() - STALE_TMP_S:
                        os.unlink(entry.path)
        return swept

    async def check(self) -> None:
        try:
            await asyncio.to_thread(self._put, f"tmp/probe-{hex_id()}", b"")
            await asyncio.to_thread(self._sweep_probes)
        except OSError as exc:
            raise StoreFailed(f"cannot write in {self.root}: {exc.strerror}") from None

    def _sweep_probes(self) -> None:
        for probe in self._tmp.glob("probe-*"):
            probe.unlink(missing_ok=True)

    async def close(self) -> None:
        return None
