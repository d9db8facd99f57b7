"""What the gateway adds to an embeddings request (issue 35): `python -m loadtests.embeddings
[--rate 300] [--rounds 8] [--slice 2] [--inputs 8]`.

One TEI simulator (no processing time: what is measured is the two paths, not a model) and a
gateway with one worker in front of it (its worker pinned alone on one core, the rest on the
other, as `loadtests.bench` pins them). Open-loop slices at `--rate` requests/s alternate, in
ABBA order, between the simulator's own OpenAI route (`/v1/embeddings`) and the gateway's
(`/v2/compat/v1/embeddings`, which sends TEI's `/embed` and encodes the vectors itself), the
same body each time: `--inputs` texts, base64 (what the OpenAI client asks for). Beside them,
in the same rounds, a vLLM simulator's chat completion straight and through the same gateway:
the anchor (what the gateway adds to a chat request on this harness, whose upstreams share a
core with the load generator and the gateway's Redis). The figures are the added milliseconds
at p50 and p99 (gateway minus direct), median over rounds, for each."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from loadtests import loadgen
from loadtests.servers import (
    Backend,
    Server,
    create_keys,
    free_port,
    gateway_args,
    gateway_worker_pid,
    plan_pinning,
    simulator_args,
    wait_ready,
    write_gateway_config,
)

MODEL = "acme/embed-small"
CHAT_MODEL = "acme/small-chat"


async def _once(session: aiohttp.ClientSession, target: loadgen.Target, body: bytes,
                tally: loadgen.Tally, due: float | None = None) -> None:
    start = due if due is not None else time.perf_counter()
    try:
        async with session.post(target.chat_url, data=body,
                                headers={**target.headers(False),
                                         "Content-Type": "application/json"}) as resp:
            payload = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.fail(type(exc).__name__)
        return
    if status != 200:
        tally.fail(loadgen.http_problem(status, payload))
        return
    tally.latencies_s.append(time.perf_counter() - start)


async def _slices(targets: list[loadgen.Target], body: bytes, rate: float, seconds: float,
                  rounds: int) -> dict[str, list[loadgen.Tally]]:
    found: dict[str, list[loadgen.Tally]] = {t.name: [] for t in targets}
    async with loadgen.new_session(512) as session:
        for target in targets:  # warm both paths (connections, caches)
            await loadgen.run_open_loop(session, target, body, _once, rate=rate,
                                        duration_s=0.5, tally=loadgen.Tally())
        for round_ in range(rounds):
            order = targets if round_ % 2 == 0 else list(reversed(targets))  # ABBA
            for target in order:
                tally = loadgen.Tally()
                await loadgen.run_open_loop(session, target, body, _once, rate=rate,
                                            duration_s=seconds, tally=tally)
                found[target.name].append(tally)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--slice", type=float, default=2.0, help="seconds per slice")
    parser.add_argument("--inputs", type=int, default=8)
    args = parser.parse_args()
    pinning = plan_pinning()
    other_core = pinning.load_core if pinning else None
    with tempfile.TemporaryDirectory(prefix="embed-bench-") as tmp:
        folder = Path(tmp)
        sim_port, chat_port, gw_port = free_port(), free_port(), free_port()
        servers = [Server("tei", [sys.executable, "-m", "proxy", "simulate", "tei", "--port",
                                  str(sim_port), "--model", MODEL, "--max-concurrency",
                                  "100000"], folder / "tei.log", other_core),
                   Server("vllm", simulator_args("vllm", chat_port, CHAT_MODEL,
                                                 completion_tokens=16),
                          folder / "vllm.log", other_core)]
        try:
            wait_ready(f"http://127.0.0.1:{sim_port}/health", server=servers[0])
            wait_ready(f"http://127.0.0.1:{chat_port}/health", server=servers[1])
            config = write_gateway_config(
                folder / "gateway", port=gw_port, access_log="off",
                backends=[Backend("tei-a", "tei", f"http://127.0.0.1:{sim_port}", MODEL),
                          Backend("chat-a", "vllm", f"http://127.0.0.1:{chat_port}",
                                  CHAT_MODEL)])
            servers.append(Server("gateway", gateway_args(config, gw_port), folder / "gw.log",
                                  other_core))
            wait_ready(f"http://127.0.0.1:{gw_port}/readyz", server=servers[2], in_a_row=3)
            keys = create_keys(config, 50, credits_each=10**6)
            if pinning is not None:
                os.sched_setaffinity(gateway_worker_pid(servers[2].pid), {pinning.worker_core})
                os.sched_setaffinity(0, {pinning.load_core})
            texts = [f"sentence number {i} about the weather in Paris" for i in
                     range(args.inputs)]
            body = orjson.dumps({"model": MODEL, "input": texts, "encoding_format": "base64"})
            chat = loadgen.chat_body(CHAT_MODEL, stream=False, max_tokens=16)
            pairs = [
                ("embeddings", body, loadgen.Target(
                    "direct", f"http://127.0.0.1:{sim_port}/v1/embeddings"), loadgen.Target(
                    "gateway", f"http://127.0.0.1:{gw_port}/v2/compat/v1/embeddings",
                    tuple(keys))),
                ("chat", chat, loadgen.Target(
                    "direct", f"http://127.0.0.1:{chat_port}/v1/chat/completions"),
                 loadgen.Target("gateway",
                                f"http://127.0.0.1:{gw_port}/v2/compat/v1/chat/completions",
                                tuple(keys)))]
            results = {name: asyncio.run(_slices([direct, gateway], request_body, args.rate,
                                                 args.slice, args.rounds))
                       for name, request_body, direct, gateway in pairs}
        finally:
            for server in reversed(servers):
                server.stop()
    print(f"embeddings: {args.inputs} texts a request, base64; chat: 16 tokens; open loop at "
          f"{args.rate:g}/s, {args.rounds} rounds of {args.slice:g} s slices (ABBA)")
    for name, found in results.items():
        for side, tallies in found.items():
            errors = sum(sum(t.errors.values()) for t in tallies)
            p50 = statistics.median(loadgen.percentile(t.latencies_s, 50) for t in tallies)
            p99 = statistics.median(loadgen.percentile(t.latencies_s, 99) for t in tallies)
            print(f"  {name:<10} {side:<8} p50 {p50 * 1000:6.2f} ms  p99 {p99 * 1000:6.2f} ms  "
                  f"errors {errors}")
        added = [statistics.median(
            (loadgen.percentile(g.latencies_s, pct) - loadgen.percentile(d.latencies_s, pct))
            * 1000 for d, g in zip(found["direct"], found["gateway"], strict=True))
            for pct in (50, 99)]
        print(f"  {name:<10} added by the gateway: p50 {added[0]:+.2f} ms, p99 {added[1]:+.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
