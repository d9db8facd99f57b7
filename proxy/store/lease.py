"""Background work that must run once across every worker of every gateway: held by a lease.

The lease is one Redis key (`igw:lease:<job>`), set NX with an expiry by whichever process asks
first and renewed by its holder each time it asks again; the others find it taken and skip their
turn. A holder that dies stops renewing, and the lease passes to another process once it
expires. One key per lease, so it lives in one Cluster slot.

Not a lock for correctness: the jobs it guards (the hold sweeper, claiming a dead worker's
tasks) are safe when two run at once (a hold ends once; a claim moves an entry once); the lease
only keeps N workers x M hosts from all doing the same scan.
"""

from __future__ import annotations

import contextlib
import os
import socket

from redis.exceptions import RedisError

from proxy.ids import hex_id
from proxy.store.client import Store

# Take the lease if free, keep it if ours; 1 when held by us after this call.
# KEYS: the lease. ARGV: holder, ttl ms.
_TAKE_OR_RENEW = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lease_key(job: str) -> str:
    return f"igw:lease:{job}"


class Lease:
    def __init__(self, redis: Store, job: str) -> None:
        self.key = lease_key(job)
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{hex_id()}"
        self._take = redis.register_script(_TAKE_OR_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def hold(self, ttl_s: float) -> bool:
        """Take or renew the lease for `ttl_s`: True when this process holds it now. An
        unreachable store means no: work that needs the lease waits for the store too."""
        ttl_ms = max(1, int(ttl_s * 1000))
        try:
            return bool(await self._take(keys=[self.key], args=[self.holder, ttl_ms]))
        except RedisError:
            return False

    async def release(self) -> None:
        """Give it up (at shutdown), so another process need not wait out the expiry."""
        with contextlib.suppress(RedisError):
            await self._release(keys=[self.key], args=[self.holder])


__all__ = ["Lease", "lease_key"]
