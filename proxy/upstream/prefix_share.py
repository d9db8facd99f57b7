"""Every worker's prefix placements, told to every other worker of every gateway host, so each
one's picture of the replicas' caches (proxy.upstream.prefixes) is the fleet's, not its own.

    publish   each placement (pool, backend, the prompt's block names) is written at once as an
              entry of a Redis stream in the rate-limit Redis (soft state), off the request's
              path: no request waits for it. While one write is on its way, the placements
              made meanwhile wait for it and go together in the next (one write per round
              trip, however many requests)
    follow    each worker reads the stream from where it joined and adds the other workers'
              placements to its own index; its own it has already
    bound     what the sharing loses is a placement made elsewhere in the last two round trips
              or so: two workers seeing a new prefix at that moment may place it on two
              replicas (both then hold it, and both are matched later). While the Redis is
              unreachable each worker goes by its own placements only.

The stream keeps its last `KEEP` entries; a worker that falls further behind skips to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import cast

import msgspec
from redis.exceptions import RedisError

from proxy.store.client import Store
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.prefixes import Prompt, pack, unpack
from proxy.upstream.slots import process_id

log = logging.getLogger("proxy.prefixes")

STREAM = "igw:{prefixes}:placed"
KEEP = 20_000
READ_BLOCK_MS = 500  # below the rate-limit client's 1 s socket timeout
RETRY_S = 1.0

# One stream entry: the writer, then (pool key, backend, prompt bytes, packed block names) per
# placement.
Placement = tuple[str, str, int, bytes]
Entry = tuple[str, list[Placement]]
_Read = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None


class PrefixShare:
    def __init__(self, redis: Store, pool_of: Callable[[str], Pool | None]) -> None:
        self.redis = redis
        self.process = process_id()
        self._pool_of = pool_of
        self._pending: list[Placement] = []
        self._writing: asyncio.Task[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Entry)

    def placed(self, pool: Pool, backend: Backend, prompt: Prompt) -> None:
        """A placement of this worker's (`Pool.on_placed`): written now, or with the next
        write when one is on its way."""
        if not prompt.blocks:
            return
        self._pending.append((pool.key, backend.name, prompt.chars, pack(prompt.blocks)))
        if self._writing is None:
            self._writing = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                with contextlib.suppress(RedisError):  # lost: the others go by what they know
                    await self.redis.xadd(
                        STREAM, {"p": self._encoder.encode((self.process, batch))},
                        maxlen=KEEP, approximate=True)
        finally:
            self._writing = None

    async def run(self) -> None:
        """Forever: the other workers' placements into this worker's indexes."""
        last: bytes | str = "$"
        while True:
            try:
                read = cast(_Read, await self.redis.xread({STREAM: last}, count=200,
                                                          block=READ_BLOCK_MS))
            except RedisError:
                await asyncio.sleep(RETRY_S)
                continue
            for _stream, entries in read or ():
                for entry_id, fields in entries:
                    last = entry_id
                    self._apply(fields.get(b"p"))

    def _apply(self, raw: bytes | None) -> None:
        if not raw:
            return
        try:
            writer, placements = self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # not ours: another version's entry
        if writer == self.process:
            return
        for pool_key, backend, chars, blocks in placements:
            pool = self._pool_of(pool_key)
            if pool is not None and pool.index is not None:
                pool.hold(backend, Prompt(unpack(blocks), chars))

    async def close(self) -> None:
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
