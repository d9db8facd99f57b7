"""What the master tells the workers about supervised backends, and the restart backoff. No I/O.

The master's supervisor owns the processes; the HTTP workers only need to know whether each one
may take traffic. The master writes one Redis hash per gateway instance,

    igw:fleet:backends:<hostname>:<config folder>    field = backend name
                                                      value = JSON {state, since, restarts, pid,
                                                                    exit_code}

on every state change and again every `REFRESH_S` (the hash expires if the master is gone), and
each worker reads it every `POLL_S`. A supervised backend is routable only while its state is
`ready`; a worker that has no record yet (startup, Redis away) treats it as `starting`.

    starting --probe OK--> ready --probe fails--> unhealthy --probe OK--> ready
       |                     |                       |
       +-----exit or startup timeout-----------------+--> backing_off --delay--> starting
    (any) --gateway stops--> stopped
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Literal

import msgspec

State = Literal["starting", "ready", "unhealthy", "backing_off", "stopped"]
STARTING: State = "starting"
READY: State = "ready"
UNHEALTHY: State = "unhealthy"
BACKING_OFF: State = "backing_off"
STOPPED: State = "stopped"

REFRESH_S = 2.0  # the master rewrites every record this often ...
EXPIRE_S = 30  # ... and the hash disappears this long after the master stopped writing
POLL_S = 0.5  # how often a worker reads it: the delay before a worker follows a change


class FleetRecord(msgspec.Struct, frozen=True, kw_only=True):
    state: State
    since: float  # unix time of the last state change
    restarts: int = 0
    pid: int | None = None
    exit_code: int | None = None

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def decode(raw: bytes | str) -> FleetRecord | None:
        """None for anything unreadable (another version wrote it): treated as no record."""
        try:
            return msgspec.json.decode(raw, type=FleetRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None


def fleet_key(config_root: str) -> str:
    """One hash per gateway instance: several gateways may share one Redis."""
    return f"igw:fleet:backends:{socket.gethostname()}:{config_root}"


def signals_key(config_root: str) -> str:
    """The engines' load as the master last read it (proxy.runtime.signal_scraper)."""
    return f"igw:fleet:signals:{socket.gethostname()}:{config_root}"


@dataclass(slots=True)
class RestartBackoff:
    """Exponential restart delay: `base_s` doubling to `max_s`, forgotten after a stable run.

    A run counts as stable when the process stayed ready for `stable_s`; then the next crash is
    treated as the first one again.
    """

    base_s: float
    max_s: float
    stable_s: float
    failures: int = 0
    _ready_at: float | None = None

    def ready(self, now: float) -> None:
        self._ready_at = now

    def exited(self, now: float) -> float:
        """The process ended (crash, exit or startup timeout): seconds to wait before the next."""
        if self._ready_at is not None and now - self._ready_at >= self.stable_s:
            self.failures = 0
        self._ready_at = None
        delay = min(self.base_s * 2.0 ** min(self.failures, 62), self.max_s)
        self.failures += 1
        return delay
