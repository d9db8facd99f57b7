"""Memory a burst freed goes back to the system (proxy.runtime.memory), measured in a process
of its own so the test's own heap does not blur the figure."""

from __future__ import annotations

import subprocess
import sys

import pytest

BURST = """
from proxy.runtime import memory

def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6

# A burst: 40 MB of 4 KB buffers (malloc's, not pymalloc's), with a survivor now and then
# (as a request's leftovers) so the heap cannot simply shrink from its top when they go.
kept, burst = [], []
for i in range(10_000):
    burst.append(bytes(4000))
    if i % 64 == 0:
        kept.append(bytes(600))
del burst
before = rss_mb()
trimmed = memory.trim()
print(before, rss_mb(), trimmed)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_gives_a_burst_s_freed_memory_back() -> None:
    out = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True,
                         check=True).stdout.split()
    before, after, trimmed = float(out[0]), float(out[1]), out[2]
    assert trimmed == "True"
    assert before - after > 20, (before, after)  # most of the 40 MB burst
