"""The embedded redis-servers of `serve`, supervised by the master like its backends.

Without a configured Redis, `serve` runs two: the ledger's (`data_dir/redis`, AOF with
`appendfsync always`) and, unless a rate-limit Redis is named, one without persistence for the
rate-limit counters (`data_dir/redis-limits`). Each is a child of the master, in its own session
(a Ctrl-C on the terminal reaches only the master, which stops Redis last) and tied to it by
PR_SET_PDEATHSIG. The master watches each one:

  - it exits (crash, kill -9, OOM killer): reaped at once, logged, and started again with the
    same command on the same unix socket after a backoff (0.05 s doubling to 10 s, forgotten
    once it served for 10 s). The ledger's server replays its AOF as it starts: every write it
    acknowledged is there. The counters' server comes back empty (the last minute is forgotten);
  - while it is away the workers' /readyz says so, metered requests get 503 and rate limits fall
    back as each tier's `store_down` says. The workers need no signal: their clients reconnect
    on the next command (`connect_redis`);
  - on stop (after the workers and the backends): SIGTERM, `_GRACE_S`, SIGKILL, reaped.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from contextlib import suppress

from proxy.runtime.supervisor import terminate, tie_to_parent, wait_event
from proxy.store.redis_process import RedisProcess
from proxy.upstream.fleet_state import RestartBackoff

log = logging.getLogger("proxy.runtime.redis")

# Every keyed request waits for this server, and the workers' clients retry for 0.3 s: back
# well within that after one crash; a crash loop still backs off to 10 s within 8 tries.
_BACKOFF_BASE_S = 0.05
_BACKOFF_MAX_S = 10.0
_STABLE_S = 10.0
_START_TIMEOUT_S = 10.0  # the first start only: a restart may replay a long AOF
_POLL_S = 0.02
_GRACE_S = 5.0  # SIGTERM makes redis-server fsync and exit; this is plenty


class RedisStartError(Exception):
    pass


class SupervisedRedis:
    """One embedded redis-server: started, watched, restarted, stopped."""

    def __init__(self, name: str, server: RedisProcess) -> None:
        self.name = name
        self.server = server
        self.restarts = 0
        self.backoff = RestartBackoff(_BACKOFF_BASE_S, _BACKOFF_MAX_S, stable_s=_STABLE_S)
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return self.server.url

    async def start(self) -> None:
        """Start it and keep it running; RedisStartError if it does not come up the first time."""
        try:
            proc = await self._spawn()
        except (OSError, RuntimeError) as exc:  # e.g. another gateway serves this data dir
            raise RedisStartError(f"cannot start redis-server ({self.name}): {exc}") from None
        if not await self._until_ready(proc, _START_TIMEOUT_S):
            await terminate(proc, _GRACE_S)
            raise RedisStartError(f"redis-server ({self.name}) did not start; see "
                                  f"{self.server.data_dir / 'redis.log'}")
        self.backoff.ready(time.monotonic())
        log.info("embedded redis-server %s ready (pid %d) on %s", self.name, proc.pid,
                 self.server.url)
        self._task = asyncio.create_task(self._supervise(proc))

    async def stop(self) -> None:
        """SIGTERM, grace, SIGKILL; no restart after this."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            log.info("embedded redis-server %s stopped", self.name)

    async def _supervise(self, proc: asyncio.subprocess.Process | None) -> None:
        """Until stop(): wait for the process to end, then start another after the backoff.
        This task alone owns the process, so a stop() during a restart cannot miss one."""
        died = time.monotonic()
        delay = 0.0
        while True:
            if proc is not None:
                code = await self._wait_exit(proc)
                if code is None:  # stopping
                    if proc.returncode is None:
                        await terminate(proc, _GRACE_S)
                    return
                died = time.monotonic()
                delay = self.backoff.exited(died)
                log.error("embedded redis-server %s (pid %d) died (code %s); restarting it on "
                          "%s in %.1f s", self.name, proc.pid, code, self.server.url, delay)
                proc = None
            if await wait_event(self._stopping, delay):
                return
            try:
                proc = await self._spawn()
            except (OSError, RuntimeError) as exc:
                delay = self.backoff.exited(time.monotonic())
                log.error("embedded redis-server %s: cannot start it (%s); trying again in "
                          "%.1f s", self.name, exc, delay)
                continue
            self.restarts += 1
            # No deadline: a live server that does not answer yet is replaying its AOF.
            if await self._until_ready(proc, None):
                self.backoff.ready(time.monotonic())
                log.warning("embedded redis-server %s serving again (pid %d, restart %d), "
                            "%.2f s after it died%s", self.name, proc.pid, self.restarts,
                            time.monotonic() - died,
                            "; its AOF is replayed" if self.server.persistent else
                            "; it starts empty")

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.server.prepare()
        return await asyncio.create_subprocess_exec(
            *self.server.command(), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            preexec_fn=tie_to_parent(signal.SIGTERM), start_new_session=True,
        )

    async def _wait_exit(self, proc: asyncio.subprocess.Process) -> int | None:
        """The exit code once the process ends, or None when stop() was asked first."""
        exited = asyncio.ensure_future(proc.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if self._stopping.is_set():
            exited.cancel()
            return None
        return exited.result()

    async def _until_ready(self, proc: asyncio.subprocess.Process, within: float | None
                           ) -> bool:
        """True once it answers PING; False if it exits, stop() is asked or `within` s pass."""
        deadline = None if within is None else time.monotonic() + within
        while proc.returncode is None and not self._stopping.is_set():
            if await self._answers():
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            await wait_event(self._stopping, _POLL_S)
        return False

    async def _answers(self) -> bool:
        """PING answered with PONG (a server loading its AOF answers -LOADING)."""
        try:
            async with asyncio.timeout(0.5):
                if self.server.port is None:
                    reader, writer = await asyncio.open_unix_connection(self.server.socket_path)
                else:
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
                try:
                    writer.write(b"PING\r\n")
                    return (await reader.readline()).startswith(b"+PONG")
                finally:
                    writer.close()
                    with suppress(OSError):
                        await writer.wait_closed()
        except (OSError, TimeoutError):
            return False


__all__ = ["RedisStartError", "SupervisedRedis"]
