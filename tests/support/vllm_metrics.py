"""Reading a real vLLM's /metrics from the tier's tests (the engine's own account of its work)."""

from __future__ import annotations

import asyncio
import re

import aiohttp

from tests.support.real_engines import Replica

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def samples(text: str) -> dict[str, float]:
    """Each series' value summed over its labels, by name (`vllm:...`, `..._total`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[match[1]] = out.get(match[1], 0.0) + float(match[3])
    return out


def families(text: str) -> dict[str, str]:
    """`# TYPE` lines: family name -> prometheus type."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out[name] = kind
    return out


async def scrape(base_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(base_url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def metrics(replica: Replica) -> dict[str, float]:
    return samples(await scrape(replica.url))


async def totals(replicas: list[Replica], *names: str) -> dict[str, float]:
    """The named counters summed over the replicas."""
    each = [await metrics(r) for r in replicas]
    return {name: sum(m.get(name, 0.0) for m in each) for name in names}


async def wait_idle(replicas: list[Replica], timeout_s: float = 30.0) -> None:
    """Until no replica runs or queues a request (what an earlier test left is finished)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        busy = await totals(replicas, "vllm:num_requests_running", "vllm:num_requests_waiting")
        if not any(busy.values()):
            return
        assert loop.time() < deadline, f"replicas still busy: {busy}"
        await asyncio.sleep(0.1)
