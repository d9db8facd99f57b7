"""Burst benchmark (issue 31): does a Basic burst decide a Max user's latency?

    python -m loadtests.burst [--basic 15] [--delay 1.5] [--json PATH]

One vLLM simulator that runs one request at a time (a batch of 1: `--max-concurrency 1`), a
fixed service time (time to first token plus paced tokens), and a `serve` gateway with two
workers in front of it. `--basic` Basic streams start at once; `--delay` seconds later one Max
stream. Run twice in the same invocation, each on a fresh simulator and gateway, with the
shipped tiers' queue budgets (Basic 4) and longest waits (Basic 5 s):

    on   the dispatcher (`[routing] dispatch = true`, the default), the backend's
         `max_concurrency = 1` (the engine's batch)
    off  `dispatch = false` and the shipped default `max_concurrency` (64): what the gateway
         did before, the engine's own first-in first-out queue deciding

Reported per run: the service time (one request alone, measured first), the Max request's time
to first token (the target: at most one service time + 100 ms), the Basic requests served and
shed (503) and how fast the shed ones were answered (target: < 50 ms), and the deepest the
engine's own queue got (its /metrics, sampled every 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from loadtests.servers import Server, account_keys, free_port, gateway_args, wait_ready

MODEL = "acme/burst"
TTFT_MS = 200
TOKENS = 16
TOKENS_PER_S = 40  # with TTFT_MS: ~0.6 s a request, one at a time


@dataclass
class Run:
    dispatch: bool
    service_s: float = 0.0
    max_ttft_s: float = 0.0
    basic_served: int = 0
    basic_shed: int = 0
    shed_answer_ms: list[float] = field(default_factory=list)  # 503s: how fast answered
    basic_ttft_s: list[float] = field(default_factory=list)
    engine_waiting_peak: int = 0
    errors: list[str] = field(default_factory=list)


def write_config(folder: Path, port: int, sim_url: str, dispatch: bool) -> None:
    q = json.dumps
    (folder / "backends.toml").write_text(
        f'[gateway]\nhost = "127.0.0.1"\nport = {port}\ndata_dir = {q(str(folder / "data"))}\n'
        f'drain_timeout_s = 2\naccess_log = "off"\n\n[health]\ntimeout_s = 10\n\n'
        f"[routing]\ndispatch = {'true' if dispatch else 'false'}\n\n"
        f'[[backends]]\nname = "engine"\nkind = "vllm"\nurl = {q(sim_url)}\n'
        f"models = [{q(MODEL)}]\nmax_concurrency = {1 if dispatch else 64}\n")
    policies = folder / "policies"
    policies.mkdir(exist_ok=True)
    tiers = ""
    for name, priority, wait, budget in (("guest", 0, 2, 2), ("basic", 1, 5, 4),
                                         ("max", 3, 30, None)):
        tiers += (f'[tiers.{name}]\nrequests_per_minute = 1000\nfamilies = ["chat"]\n'
                  f'models = {{ "*" = ["direct"] }}\npriority = {priority}\n'
                  f"max_queue_wait_s = {wait}\n"
                  + (f"queue_budget = {budget}\n" if budget is not None else "") + "\n")
    (policies / "tiers.toml").write_text(tiers)


async def stream(session: aiohttp.ClientSession, url: str, key: str, text: str
                 ) -> tuple[int, float, float]:
    """(status, time to first content byte or to the error answer, total)."""
    started = time.perf_counter()
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": text}]}
    async with session.post(url, json=body, headers={"X-API-Key": key}) as r:
        first = 0.0
        async for chunk in r.content.iter_any():
            if not first and (r.status != 200 or b'"content":"' in chunk):
                first = time.perf_counter() - started
        return r.status, first or (time.perf_counter() - started), time.perf_counter() - started


async def engine_waiting(session: aiohttp.ClientSession, sim: str) -> int:
    async with session.get(f"{sim}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("vllm:num_requests_waiting"):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def burst(run: Run, gateway: str, sim: str, keys: dict[str, str], basic: int,
                delay_s: float) -> None:
    url = f"{gateway}/v2/compat/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        _, _, run.service_s = await stream(session, url, keys["max"], "alone")
        sampling = True

        async def sample() -> None:
            while sampling:
                run.engine_waiting_peak = max(run.engine_waiting_peak,
                                              await engine_waiting(session, sim))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        basics = [asyncio.create_task(stream(session, url, keys["basic"], f"basic {i}"))
                  for i in range(basic)]
        await asyncio.sleep(delay_s)
        status, run.max_ttft_s, _ = await stream(session, url, keys["max"], "max")
        if status != 200:
            run.errors.append(f"max: {status}")
        for status, first, _ in await asyncio.gather(*basics):
            if status == 200:
                run.basic_served += 1
                run.basic_ttft_s.append(first)
            elif status == 503:
                run.basic_shed += 1
                run.shed_answer_ms.append(first * 1000)
            else:
                run.errors.append(f"basic: {status}")
        sampling = False
        await sampler


def one_run(dispatch: bool, basic: int, delay_s: float, root: Path) -> Run:
    run = Run(dispatch)
    folder = root / ("dispatch" if dispatch else "no-dispatch")
    folder.mkdir(parents=True)
    sim_port, gw_port = free_port(), free_port()
    sim = Server("simulator", [
        sys.executable, "-m", "proxy", "simulate", "vllm", "--host", "127.0.0.1", "--port",
        str(sim_port), "--model", MODEL, "--ttft-ms", str(TTFT_MS), "--tokens-per-s",
        str(TOKENS_PER_S), "--completion-tokens", str(TOKENS), "--max-concurrency", "1"],
        folder / "sim.log", None)
    gateway: Server | None = None
    try:
        sim_url = f"http://127.0.0.1:{sim_port}"
        wait_ready(f"{sim_url}/health", server=sim)
        write_config(folder, gw_port, sim_url, dispatch)
        gateway = Server("gateway", gateway_args(folder, gw_port, workers=2),
                         folder / "gateway.log", None)
        wait_ready(f"http://127.0.0.1:{gw_port}/readyz", server=gateway)
        keys = account_keys(folder, {"basic": "basic", "max": "max"},
                            credits_each=1_000_000)
        asyncio.run(burst(run, f"http://127.0.0.1:{gw_port}", sim_url, keys, basic, delay_s))
    finally:
        if gateway is not None:
            gateway.stop()
        sim.stop()
    return run


def report(runs: list[Run]) -> str:
    lines = ["| dispatcher | service time | Max TTFT | Max TTFT / (service + 0.1 s) | Basic "
             "served / shed | shed within 50 ms | engine queue peak |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        fast = sum(1 for ms in r.shed_answer_ms if ms < 50)
        shed = f"{fast} of {len(r.shed_answer_ms)}" if r.shed_answer_ms else "-"
        lines.append(
            f"| {'on' if r.dispatch else 'off'} | {r.service_s * 1000:.0f} ms | "
            f"{r.max_ttft_s * 1000:.0f} ms | {r.max_ttft_s / (r.service_s + 0.1):.2f} | "
            f"{r.basic_served} / {r.basic_shed} | {shed} | {r.engine_waiting_peak} |")
    for r in runs:
        if r.errors:
            lines.append(f"errors ({'on' if r.dispatch else 'off'}): {r.errors}")
        if r.basic_ttft_s:
            lines.append(f"Basic TTFT ({'on' if r.dispatch else 'off'}): median "
                         f"{statistics.median(r.basic_ttft_s):.2f} s, max "
                         f"{max(r.basic_ttft_s):.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--basic", type=int, default=15)
    parser.add_argument("--delay", type=float, default=1.5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="igw-burst-") as tmp:
        runs = [one_run(dispatch, args.basic, args.delay, Path(tmp)) for dispatch in (True, False)]
    print(report(runs))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
