"""The processes under test, by pid: CPU time, RSS, children, pinning, file limits. Typed here.

psutil ships no type information, so it is wrapped once in this module and nothing else imports
it. Every function tolerates processes that have gone away (they count as nothing).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil  # type: ignore[import-untyped, unused-ignore]

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


@dataclass(frozen=True)
class Child:
    pid: int
    cmdline: tuple[str, ...]


def descendants(pid: int) -> list[Child]:
    """Every process below `pid` (children, grandchildren, ...)."""
    try:
        found = psutil.Process(pid).children(recursive=True)
    except _GONE:
        return []
    out: list[Child] = []
    for proc in found:
        with contextlib.suppress(*_GONE):
            out.append(Child(int(proc.pid), tuple(str(a) for a in proc.cmdline())))
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of these processes (not of their children)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(*_GONE):
            times = psutil.Process(pid).cpu_times()
            total += float(times.user) + float(times.system)
    return total


def rss_bytes(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except _GONE:
        return None


def pin(pid: int, core: int) -> int:
    """Pin every thread of `pid` to `core` (threads it starts later inherit it); returns how many
    threads were moved. `os.sched_setaffinity(pid)` alone would move only the main thread."""
    moved = 0
    try:
        tids = [int(t.id) for t in psutil.Process(pid).threads()]
    except _GONE:
        return 0
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, {core})
            moved += 1
    return moved


def affinity(pid: int) -> set[int]:
    try:
        return set(os.sched_getaffinity(pid))
    except ProcessLookupError:
        return set()


def core_times() -> dict[int, tuple[float, float]]:
    """Per CPU: (busy seconds, total seconds) from some fixed start (differences are what count);
    busy is all but idle, whoever used the CPU (the benchmark or anything else on the machine).

    From cpuidle's residency counters where the kernel keeps them (exact). Else from /proc/stat,
    whose split is sampled on the scheduler's tick (250 Hz here) and aliases with a load that
    keeps time with it: the open loop's 1 ms schedule read there as 7 % or 50 % busy for the
    worker's core while the worker alone used 35 % of it."""
    idled = _idle_seconds()
    if idled:
        now = time.monotonic()
        return {cpu: (now - seconds, now) for cpu, seconds in idled.items()}
    out: dict[int, tuple[float, float]] = {}
    for cpu, times in enumerate(psutil.cpu_times(percpu=True)):
        total = float(sum(times))
        idle = float(times.idle) + float(getattr(times, "iowait", 0.0))
        out[cpu] = (total - idle, total)
    return out


def _idle_seconds(root: Path = Path("/sys/devices/system/cpu")) -> dict[int, float]:
    """Per CPU, the seconds spent in any idle state since boot; {} unless every CPU has them."""
    out: dict[int, float] = {}
    for cpu in range(psutil.cpu_count() or 0):
        states = list((root / f"cpu{cpu}" / "cpuidle").glob("state*/time"))
        if not states:
            return {}
        try:
            out[cpu] = sum(int(state.read_text()) for state in states) / 1e6  # microseconds
        except (OSError, ValueError):
            return {}
    return out


def busy_pct(before: dict[int, tuple[float, float]],
             after: dict[int, tuple[float, float]], core: int) -> float:
    if core not in before or core not in after:
        return float("nan")
    busy = after[core][0] - before[core][0]
    total = after[core][1] - before[core][1]
    return 100 * busy / total if total > 0 else float("nan")


def raise_nofile(wanted: int) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to `wanted` (at most the hard limit); children
    started afterwards inherit it. Returns the (soft, hard) limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)
