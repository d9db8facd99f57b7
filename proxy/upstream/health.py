"""A backend's health as one worker sees it: passive ejection and two-tier active probes. No I/O.

Passive (Envoy outlier detection, reliability U1): `threshold` consecutive upstream failures
(connect errors, 5xx, timeouts; never a client's 4xx) eject the backend for a cool-down that
doubles with each ejection in a row (`base_s`, `2 * base_s`, ... up to `max_s`). The doubling
forgets itself once the backend has stayed in for `max_s`. When the cool-down ends the backend is
half-open: it admits one request at a time, and the first probe or request to finish decides
(success: back in; failure: ejected again for the next, longer cool-down). How many backends of a
pool may be out at once is the pool's business (`ejection_allowed`); the caller says `may_eject`.

Active (TGI's two tiers, reliability U6): the cheap probe (`GET /health`) while recent traffic
succeeds, a tiny real generation while health is in doubt: after a failure, after the cheap probe
recovers, as the half-open trial, and before a newly started process gets its first request. So
a server whose `/health` says OK while every generation fails is still taken out. Any failed
probe takes the backend out until a conclusive success: a deep probe, or the cheap one for a
backend that has no deep probe.

Times are `time.monotonic()` seconds passed in by the caller, so tests drive the clock.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Probe(enum.Enum):
    CHEAP = "cheap"  # the server's health endpoint
    DEEP = "deep"  # a one-token chat completion


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    threshold: int = 5
    base_s: float = 10.0
    max_s: float = 300.0

    def cool_down(self, ejections: int) -> float:
        """The cool-down of the `ejections`-th ejection in a row (0-based)."""
        return min(self.base_s * 2.0 ** min(ejections, 62), self.max_s)


def ejection_allowed(already_ejected: int, pool_size: int, ratio: float) -> bool:
    """May one more backend of this pool be ejected? At most `ratio` of it, but always one
    (as Envoy's max_ejection_percent); a ratio of 0 turns passive ejection off."""
    if ratio <= 0:
        return False
    limit = max(1, math.floor(ratio * pool_size + 1e-9))
    return already_ejected + 1 <= limit


class BackendHealth:
    """The state machine; `admits()` is what routing asks."""

    __slots__ = ("cheap_ok", "consecutive_failures", "deep_available", "ejected_until",
                 "ejections", "in_doubt", "last_probe", "policy", "probe_down", "readmitted_at")

    def __init__(self, policy: EjectionPolicy, *, deep_available: bool,
                 verified: bool = True) -> None:
        self.policy = policy
        self.deep_available = deep_available
        self.reset(verified=verified)

    def reset(self, *, verified: bool = True) -> None:
        """A clean slate. `verified=False` (a process that just started): out of rotation until
        a conclusive probe succeeds, so a new server's first request is never a user's."""
        self.consecutive_failures = 0
        self.ejections = 0  # ejections in a row: the exponent of the next cool-down
        self.ejected_until: float | None = None  # set while ejected or half-open
        self.readmitted_at: float | None = None
        self.probe_down = not verified  # the last conclusive probe failed (or none ran yet)
        self.cheap_ok = True  # the last cheap probe answered OK
        self.in_doubt = not verified  # the next probe is a real generation
        self.last_probe: tuple[Probe, bool] | None = None

    # -- routing -------------------------------------------------------------------------------

    @property
    def ejected(self) -> bool:
        """Out of rotation by passive ejection (cooling down, or half-open awaiting its trial)."""
        return self.ejected_until is not None

    def half_open(self, now: float) -> bool:
        return self.ejected_until is not None and now >= self.ejected_until

    def admits(self, now: float, in_flight: int) -> bool:
        if self.probe_down:
            return False
        if self.ejected_until is None:
            return True
        if now < self.ejected_until:
            return False
        return in_flight == 0  # half-open: one trial at a time

    # -- passive: outcomes of real requests ----------------------------------------------------

    def record_success(self, now: float) -> None:
        self.consecutive_failures = 0
        self.in_doubt = False
        if self.half_open(now):
            self._readmit(now)

    def record_failure(self, now: float, *, may_eject: bool) -> bool:
        """Count a failure; True when it ejected the backend."""
        self.consecutive_failures += 1
        self.in_doubt = True
        if self.ejected_until is not None:
            if now >= self.ejected_until:  # the half-open trial failed
                self._eject(now)
                return True
            return False
        if self.consecutive_failures >= self.policy.threshold and may_eject:
            self._eject(now)
            return True
        return False

    # -- active probes -------------------------------------------------------------------------

    def probe_kind(self, now: float) -> Probe:
        """Which probe to send now."""
        if not self.deep_available:
            return Probe.CHEAP
        if self.ejected_until is not None and now < self.ejected_until:
            return Probe.CHEAP  # cooling down: only watch liveness; the trial comes after
        if not self.cheap_ok:
            return Probe.CHEAP  # don't ask a server that fails /health for a generation
        if self.in_doubt or self.probe_down or self.half_open(now):
            return Probe.DEEP
        return Probe.CHEAP

    def record_probe(self, now: float, kind: Probe, ok: bool) -> None:
        self.last_probe = (kind, ok)
        if kind is Probe.CHEAP:
            self.cheap_ok = ok
        if not ok:
            self.probe_down = True
            self.in_doubt = True
            if self.half_open(now):
                self._eject(now)
            return
        if kind is Probe.CHEAP and self.deep_available:
            if self.probe_down:
                self.in_doubt = True  # just recovered: a real generation decides
            return
        # Conclusive success: a deep probe, or a cheap one where there is nothing deeper.
        self.probe_down = False
        self.in_doubt = False
        self.consecutive_failures = 0
        if self.half_open(now):
            self._readmit(now)

    def next_probe_at(self, last: float, interval: float) -> float:
        """When the next probe is due: every `interval`, and at once when a cool-down ends."""
        due = last + interval
        if self.ejected_until is not None and last < self.ejected_until < due:
            return self.ejected_until
        return due

    # -- transitions ---------------------------------------------------------------------------

    def _eject(self, now: float) -> None:
        fresh = self.readmitted_at is not None and now - self.readmitted_at >= self.policy.max_s
        if fresh:
            self.ejections = 0  # it stayed in long enough: start again from the base cool-down
        self.ejected_until = now + self.policy.cool_down(self.ejections)
        self.ejections += 1
        self.readmitted_at = None

    def _readmit(self, now: float) -> None:
        self.ejected_until = None
        self.readmitted_at = now
        self.consecutive_failures = 0
