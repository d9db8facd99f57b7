"""The open loops' clock: wait until a due time has passed, to the microsecond, never before.

uvloop keeps timers in whole milliseconds, counted from a clock it reads once per loop iteration,
so `asyncio.sleep(d)` can return up to ~1 ms before `d` has passed. At 1,000 req/s that started
half the open-loop requests more than 0.2 ms off their schedule, a quarter of them early, and an
early request's latency, timed from its due time, came out short (the fastest below zero). On
Linux a timerfd wakes the event loop at the due time (the kernel's high-resolution timers);
elsewhere the loop sleeps again until the due time has passed: late by up to a timer tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import sys
import time

# timerfd_create(2) and timerfd_settime(2); the clock is time.perf_counter()'s on Linux.
_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
PRECISE = sys.platform == "linux" and \
    time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Clock:
    """`await clock.until(t)` returns once `time.perf_counter() >= t`. `close()` when done."""

    def __init__(self, precise: bool = PRECISE) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True) if precise else None
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None  # reading the timerfd
        self._waiter: asyncio.Future[None] | None = None

    async def until(self, due: float) -> None:
        # Polling the clock is the point: whatever woke us, sleep again until `due` has passed.
        while (left := due - time.perf_counter()) > 0:
            if self._libc is None:
                await asyncio.sleep(max(left, 0.001))  # a shorter sleep may return at once
                continue
            self._arm(math.ceil(due * 1e9))
            assert self._loop is not None
            self._waiter = self._loop.create_future()
            await self._waiter

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _arm(self, due_ns: int) -> None:
        """One expiry at `due_ns` on the monotonic clock (replacing any earlier one)."""
        assert self._libc is not None
        if self._fd < 0:
            # TFD_CLOEXEC and TFD_NONBLOCK are O_CLOEXEC and O_NONBLOCK by definition.
            self._fd = self._libc.timerfd_create(_CLOCK_MONOTONIC,
                                                 os.O_CLOEXEC | os.O_NONBLOCK)
            if self._fd < 0:
                raise OSError(ctypes.get_errno(), "timerfd_create")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self._expired)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(*divmod(due_ns, 1_000_000_000)))
        if self._libc.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec),
                                      None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")

    def _expired(self) -> None:
        with contextlib.suppress(BlockingIOError):  # read: the timerfd is readable no more
            os.read(self._fd, 8)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
