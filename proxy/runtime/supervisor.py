"""Supervised backends: the model servers the gateway starts itself (`command` in backends.toml).

Runs in the master process. For each such backend:
  - start `command` (an argv list; no shell) in `cwd` (relative to the config folder; default the
    folder itself) with the gateway's environment plus `env`. The directory of the gateway's own
    Python comes first on PATH, so `python` and `inference-gateway` mean the gateway's own;
  - log its stdout and stderr line by line, tagged `backend.<name>`;
  - ready once its health probe answers 2xx (for `health_path = ""`: once its port accepts a
    connection). Connection refused while it loads is normal, up to `startup_timeout_s`;
  - probe it every `[health] interval_s` while it runs: `ready` <-> `unhealthy`. An unhealthy
    process is left running (it may recover) but gets no traffic;
  - when it exits (or never gets ready), start it again after a backoff (`backoff_base_s`
    doubling to `backoff_max_s`, forgotten once it stayed ready for `backoff_max_s`);
  - on stop: SIGTERM to its process group, `grace_s`, then SIGKILL, and reap it.

Each child is in its own session (a Ctrl-C on the gateway's terminal reaches only the master,
which stops things in order) and has PR_SET_PDEATHSIG, so it is signalled if the master dies,
even by SIGKILL. States are published for the workers in Redis (`fleet_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from redis.exceptions import RedisError

from proxy.config import BackendSpec, Config, HealthSection, SupervisorSection
from proxy.store.client import Store
from proxy.upstream.fleet_state import (
    BACKING_OFF,
    EXPIRE_S,
    READY,
    REFRESH_S,
    STARTING,
    STOPPED,
    UNHEALTHY,
    FleetRecord,
    RestartBackoff,
    State,
    fleet_key,
)
from proxy.upstream.pool import health_path
from proxy.upstream.prober import PROBE_HEADERS, probe_session

log = logging.getLogger("proxy.supervisor")

_STARTUP_POLL_S = 0.2  # readiness probe cadence while a server loads
_LINE_LIMIT = 1 << 20
_PR_SET_PDEATHSIG = 1
try:  # resolved now: a child between fork and exec must not load libraries
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for `event` up to `seconds`; True if it was set. (Not `asyncio.wait_for`, which
    on Python 3.11 can swallow a cancellation that races with the event.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()


def tie_to_parent(death_signal: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets `death_signal` when this process dies."""
    parent = os.getpid()

    def setup() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, death_signal)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), death_signal)

    return setup


async def terminate(proc: asyncio.subprocess.Process, grace: float) -> None:
    """SIGTERM to the child's process group, `grace` seconds, SIGKILL; then reap it."""
    if proc.returncode is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log.warning("pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, grace)
    _signal_group(proc, signal.SIGKILL)  # also whatever it started and left behind
    await proc.wait()


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # each child leads its own session, so pgid == pid
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


class SupervisedBackend:
    """One supervised server: its process, its state, its restarts."""

    def __init__(self, spec: BackendSpec, root: Path, health: HealthSection,
                 settings: SupervisorSection, session: aiohttp.ClientSession,
                 changed: Callable[[], None]) -> None:
        assert spec.command is not None
        self.spec = spec
        self.name = spec.name
        self.command = list(spec.command)
        self.cwd = root / spec.cwd if spec.cwd else root
        self.health = health
        self.settings = settings
        self.session = session
        self._changed = changed
        self.state: State = STARTING
        self.since = time.time()
        self.restarts = 0
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.backoff = RestartBackoff(settings.backoff_base_s, settings.backoff_max_s,
                                      stable_s=settings.backoff_max_s)
        self.output = logging.getLogger(f"backend.{spec.name}")
        self._stopping = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None

    def record(self) -> FleetRecord:
        return FleetRecord(state=self.state, since=self.since, restarts=self.restarts,
                           pid=self.pid, exit_code=self.exit_code)

    def _set(self, state: State) -> None:
        if state != self.state:
            log.info("backend %r: %s -> %s", self.name, self.state, state)
            self.state, self.since = state, time.time()
        self._changed()

    async def run(self) -> None:
        """Start, watch and restart the process until `stop()`."""
        while not self._stopping.is_set():
            await self._run_once()
            if self._stopping.is_set():
                break
            delay = self.backoff.exited(time.monotonic())
            log.warning("backend %r exited (code %s); restarting in %.1f s", self.name,
                        self.exit_code, delay)
            self._set(BACKING_OFF)
            if not await wait_event(self._stopping, delay):
                self.restarts += 1
        self._set(STOPPED)

    async def stop(self) -> None:
        self._stopping.set()
        if self._proc is not None:
            await terminate(self._proc, self.settings.grace_s)

    async def _run_once(self) -> None:
        try:
            proc = await self._spawn()
        except OSError as exc:  # command not found, cwd missing, ...
            log.error("backend %r: cannot start %r: %s", self.name, self.command[0],
                      exc.strerror or type(exc).__name__)
            self.exit_code = None
            return
        self._proc, self.pid, self.exit_code = proc, proc.pid, None
        self._set(STARTING)
        assert proc.stdout is not None
        pump = asyncio.create_task(self._pump(proc.stdout))
        exited = asyncio.create_task(proc.wait())
        try:
            if self._stopping.is_set():
                await terminate(proc, self.settings.grace_s)
            elif await self._until_ready(exited):
                self.backoff.ready(time.monotonic())
                self._set(READY)
                await self._watch(exited)
            elif not exited.done() and not self._stopping.is_set():
                log.error("backend %r not ready after %.0f s; restarting it", self.name,
                          self.settings.startup_timeout_s)
                await terminate(proc, self.settings.grace_s)
            await exited
        finally:
            if proc.returncode is None:  # cancelled: never leave it behind
                await asyncio.shield(terminate(proc, self.settings.grace_s))
            self._proc, self.pid, self.exit_code = None, None, proc.returncode
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pump, 1.0)  # the last lines it wrote

    async def _spawn(self) -> asyncio.subprocess.Process:
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        # Unbuffered, so a Python server's lines reach the log as they are written.
        env = {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1", **self.spec.env}
        log.info("backend %r: starting %s", self.name, " ".join(self.command))
        return await asyncio.create_subprocess_exec(
            *self.command, cwd=self.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            preexec_fn=tie_to_parent(signal.SIGTERM), start_new_session=True,
            limit=_LINE_LIMIT,
        )

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        """The child's output, one log line per line it writes."""
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the limit: skipped, the rest still flows
                self.output.warning("(an over-long output line was dropped)")
                continue
            if not line:
                return
            self.output.info("%s", line.decode(errors="replace").rstrip())

    async def _until_ready(self, exited: asyncio.Task[int]) -> bool:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            if exited.done():
                return False
            if await self._probe():
                return not exited.done()
            await asyncio.wait({exited}, timeout=_STARTUP_POLL_S)
        return False

    async def _watch(self, exited: asyncio.Task[int]) -> None:
        while not exited.done():
            await asyncio.wait({exited}, timeout=self.health.interval_s)
            if exited.done() or self._stopping.is_set():
                return
            ok = await self._probe()
            if not exited.done():
                self._set(READY if ok else UNHEALTHY)

    async def _probe(self) -> bool:
        path = health_path(self.spec)
        if not path:  # no health endpoint: an open port is all we can know
            url = urlsplit(self.spec.url)
            port = url.port or (443 if url.scheme == "https" else 80)
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(url.hostname, port), self.health.timeout_s)
            except (OSError, TimeoutError):
                return False
            writer.close()
            return True
        try:
            async with self.session.get(self.spec.url.rstrip("/") + path,
                                        headers=PROBE_HEADERS, allow_redirects=False) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False


class Supervisor:
    """All supervised backends of one gateway, and the Redis hash that tells the workers."""

    def __init__(self, config: Config, redis: Store) -> None:
        self.redis = redis
        self.key = fleet_key(config.root)
        self.session = probe_session(config.health.timeout_s)
        self._changed = asyncio.Event()
        self.backends = [
            SupervisedBackend(spec, Path(config.root), config.health, config.supervisor,
                              self.session, self._changed.set)
            for spec in config.backends if spec.command is not None
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._publisher: asyncio.Task[None] | None = None
        self._closing = False
        self._store_down = False

    async def start(self) -> None:
        if not self.backends:
            return
        await self._publish()  # replaces whatever an earlier run left
        self._publisher = asyncio.create_task(self._publish_loop())
        self._tasks = [asyncio.create_task(b.run()) for b in self.backends]

    async def stop(self) -> None:
        """Stop every backend (in parallel), then say so in Redis."""
        await asyncio.gather(*(b.stop() for b in self.backends))
        await asyncio.gather(*self._tasks)
        if self._publisher is not None:
            self._closing = True  # the loop publishes once more and ends
            self._changed.set()
            await self._publisher
        await self.session.close()

    async def _publish_loop(self) -> None:
        while not self._closing:
            await wait_event(self._changed, REFRESH_S)
            self._changed.clear()
            await self._publish()
        await self._publish()  # the last word: every backend stopped

    async def _publish(self) -> None:
        records = {b.name: b.record().encode() for b in self.backends}
        try:
            async with asyncio.timeout(REFRESH_S):  # never stall supervision on the store
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.delete(self.key)  # exactly the configured names, nothing stale
                    pipe.hset(self.key, mapping=records)  # type: ignore[arg-type]
                    pipe.expire(self.key, EXPIRE_S)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._store_down:
                log.warning("cannot publish backend states to Redis (%s); workers keep the "
                            "last ones they saw", type(exc).__name__)
            self._store_down = True
            return
        self._store_down = False
