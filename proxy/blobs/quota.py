"""The bytes each account keeps in the blob store, capped (in the ledger's Redis; per account A,
one Cluster slot):

    igw:{A}:media        sorted set   `<key>:<bytes>` scored by when the blob expires
    igw:{A}:media_bytes  string       the sum of the set's sizes

Expired entries leave the sum when the account next stores or is checked (the blobs themselves
go with the sweep); both keys expire with the account's last blob.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.store.client import Store

# Drop what has expired; then (a key given) add the blob if it fits under the cap, or (no key)
# only say whether anything more fits. KEYS: set, sum. ARGV: key, bytes, expires_at, now, cap.
# Returns {fits, the sum now}.
_RESERVE = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[4])
local total = tonumber(redis.call('GET', KEYS[2]) or '0')
for _, member in ipairs(gone) do
  total = total - tonumber(string.match(member, ':(%d+)$'))
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[4]) end
if total < 0 or redis.call('ZCARD', KEYS[1]) == 0 then total = 0 end
local size, cap = tonumber(ARGV[2]), tonumber(ARGV[5])
local fits
if ARGV[1] == '' then
  fits = total < cap
else
  fits = total + size <= cap
  if fits then
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1] .. ':' .. ARGV[2])
    total = total + size
  end
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('SET', KEYS[2], total, 'EXAT', last[2])
  redis.call('EXPIREAT', KEYS[1], last[2])
else
  redis.call('DEL', KEYS[2])
end
return {fits and 1 or 0, total}
"""
# Give back a blob that could not be written. KEYS: set, sum. ARGV: key, bytes.
_RELEASE = """
if redis.call('ZREM', KEYS[1], ARGV[1] .. ':' .. ARGV[2]) == 1 then
  if redis.call('DECRBY', KEYS[2], ARGV[2]) <= 0 then redis.call('DEL', KEYS[2]) end
end
return 1
"""


def _keys(account: str) -> list[str]:
    return [f"igw:{{{account}}}:media", f"igw:{{{account}}}:media_bytes"]


@dataclass(frozen=True, slots=True)
class Usage:
    fits: bool
    stored: int  # bytes the account keeps now


class MediaQuota:
    def __init__(self, redis: Store) -> None:
        self._reserve = redis.register_script(_RESERVE)
        self._release = redis.register_script(_RELEASE)

    async def reserve(self, account: str, key: str, size: int, expires_at: int, now: int,
                      cap: int) -> Usage:
        """Count the blob for the account if it fits under `cap`."""
        fits, stored = await self._reserve(keys=_keys(account),
                                           args=[key, size, expires_at, now, cap])
        return Usage(bool(fits), int(stored))

    async def check(self, account: str, now: int, cap: int) -> Usage:
        """Whether the account keeps less than `cap` now."""
        fits, stored = await self._reserve(keys=_keys(account), args=["", 0, 0, now, cap])
        return Usage(bool(fits), int(stored))

    async def release(self, account: str, key: str, size: int) -> None:
        await self._release(keys=_keys(account), args=[key, size])
