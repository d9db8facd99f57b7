"""Benchmark driver: the same load sent straight to an upstream simulator and through the gateway.

    python -m loadtests.bench [--duration 10] [--concurrency 32] [--completion-tokens 64]
                              [--json PATH] [--quick] [--strict]
                              [--upstream-url URL [--gateway-url URL]]

One run starts a simulator that answers instantly and a gateway in front of it (unless their URLs
are given), pins both to one core and itself to another (DESIGN §7), and measures four phases,
each on both targets: latency at concurrency 1, non-streaming throughput at concurrency C, and
streaming at concurrency 1 (time to first token) and at C (relayed events/s). Targets alternate
in ABBA order within a phase so drift on a shared machine hits both alike. The figures that
matter are the ratios and the added milliseconds; see loadtests/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from loadtests import loadgen, report
from loadtests.servers import (
    Pinning,
    Server,
    ServerFailed,
    create_key,
    free_port,
    gateway_args,
    plan_pinning,
    simulator_args,
    wait_ready,
    write_gateway_config,
)

GATEWAY_CHAT_PATH = "/v2/compat/v1/chat/completions"
DIRECT_CHAT_PATH = "/v1/chat/completions"
T = TypeVar("T")


@dataclass(frozen=True)
class Phase:
    key: str
    title: str
    stream: bool
    concurrency: int


@dataclass
class Setup:
    targets: list[loadgen.Target]
    servers: list[Server] = field(default_factory=list)
    pinning: Pinning | None = None
    notes: list[str] = field(default_factory=list)

    def cpu_seconds(self) -> dict[str, float]:
        return {s.name: cpu for s in self.servers if (cpu := s.cpu_seconds()) is not None}


def phases(concurrency: int, tokens: int) -> list[Phase]:
    return [
        Phase("latency", "latency, c=1", stream=False, concurrency=1),
        Phase("throughput", f"non-streaming, c={concurrency}", stream=False,
              concurrency=concurrency),
        Phase("stream_c1", "streaming TTFT, c=1", stream=True, concurrency=1),
        Phase("stream", f"streaming, c={concurrency}, {tokens} tok", stream=True,
              concurrency=concurrency),
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench",
        description="The same load straight to an upstream and through the gateway, side by side.",
    )
    p.add_argument("--duration", type=float, help="seconds measured per phase and target "
                   "(default 10, or 2 with --quick)")
    p.add_argument("--concurrency", type=int, default=32, help="workers for the loaded phases")
    p.add_argument("--completion-tokens", type=int, default=64,
                   help="tokens per answer (simulator length and max_tokens)")
    p.add_argument("--rounds", type=int, default=2,
                   help="slices per phase, alternating the targets in ABBA order (default 2)")
    p.add_argument("--max-requests", type=int, default=200_000,
                   help="cap on requests per phase and target (bounds memory)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--quick", action="store_true", help="2 s phases, short warm-up (smoke test)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    p.add_argument("--model", default="acme/small-chat")
    p.add_argument("--kind", choices=("vllm", "tgi"), default="vllm",
                   help="simulator to start and backend kind to configure (default vllm)")
    p.add_argument("--upstream-url", help="measure this running upstream instead of starting "
                   "a simulator (a gateway is started in front of it unless --gateway-url)")
    p.add_argument("--gateway-url", help="measure this running gateway (needs --upstream-url: "
                   "the upstream it fronts)")
    p.add_argument("--api-key", default=os.environ.get("LOADTEST_API_KEY"),
                   help="sent to the gateway as a Bearer token (default $LOADTEST_API_KEY)")
    args = p.parse_args(argv)
    if args.gateway_url and not args.upstream_url:
        p.error("--gateway-url needs --upstream-url: the direct side must be what it fronts")
    if args.concurrency < 1 or args.completion_tokens < 1 or args.rounds < 1:
        p.error("--concurrency, --completion-tokens and --rounds must be at least 1")
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.warmup = 0.3 if args.quick else 1.0
    return args


def start_servers(args: argparse.Namespace, stack: contextlib.ExitStack) -> Setup:
    """Start what was not given; each start registers its stop on `stack` before anything else
    can fail, so errors and Ctrl-C never leave a server running."""
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gateway-bench-")))
    starting = not (args.upstream_url and args.gateway_url)
    pinning = plan_pinning() if starting else None
    core = pinning.server_core if pinning else None
    setup = Setup(targets=[], pinning=pinning)

    def start(name: str, cmd: list[str]) -> Server:
        server = Server(name, cmd, workdir / f"{name}.log", core)
        stack.callback(server.stop)
        setup.servers.append(server)
        return server

    upstream = args.upstream_url
    if not upstream:
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        sim = start("simulator", simulator_args(
            args.kind, port, args.model, completion_tokens=args.completion_tokens,
            concurrency=args.concurrency))
        wait_ready(f"{upstream}/health", server=sim)
    else:
        wait_ready(f"{upstream.rstrip('/')}/health")
    gateway = args.gateway_url
    if not gateway:
        port = free_port()
        gateway = f"http://127.0.0.1:{port}"
        config = write_gateway_config(workdir / "config", port=port, upstream_url=upstream,
                                      kind=args.kind, model=args.model)
        gw = start("gateway", gateway_args(config, port))
        wait_ready(f"{gateway}/readyz", server=gw)
        if not args.api_key:
            args.api_key = create_key(config)
    else:
        wait_ready(f"{gateway.rstrip('/')}/readyz")

    if pinning:
        os.sched_setaffinity(0, {pinning.load_core})
        names = " and ".join(s.name for s in setup.servers)
        setup.notes.append(
            f"{names} pinned to core {pinning.server_core}"
            + (" (the simulator shares the gateway's core, as does the gateway's redis-server)"
               if len(setup.servers) == 2 else "")
            + f"; load generator on core {pinning.load_core}"
        )
    elif starting:
        setup.notes.append("not pinned: needs os.sched_setaffinity and at least 2 usable cores")
    else:
        setup.notes.append("servers given by URL: not started here, nothing pinned")
    gateway_headers = {"X-API-Key": args.api_key} if args.api_key else {}
    setup.targets = [
        loadgen.Target("direct", upstream.rstrip("/") + DIRECT_CHAT_PATH, {}),
        loadgen.Target("gateway", gateway.rstrip("/") + GATEWAY_CHAT_PATH, gateway_headers),
    ]
    return setup


async def measure(args: argparse.Namespace, setup: Setup) -> dict[str, dict[str, loadgen.Tally]]:
    results: dict[str, dict[str, loadgen.Tally]] = {}
    for phase in phases(args.concurrency, args.completion_tokens):
        print(f"measuring {phase.title} ...", file=sys.stderr, flush=True)
        results[phase.key] = await run_phase(phase, args, setup)
    return results


async def run_phase(
    phase: Phase, args: argparse.Namespace, setup: Setup
) -> dict[str, loadgen.Tally]:
    body = loadgen.chat_body(args.model, stream=phase.stream, max_tokens=args.completion_tokens)
    request = loadgen.stream_once if phase.stream else loadgen.chat_once
    tallies = {t.name: loadgen.Tally() for t in setup.targets}
    async with contextlib.AsyncExitStack() as sessions:
        session = {
            t.name: await sessions.enter_async_context(loadgen.new_session(t, phase.concurrency))
            for t in setup.targets
        }
        for target in setup.targets:  # opens the pooled connections; results discarded
            await loadgen.run_round(
                session[target.name], target, body, request, concurrency=phase.concurrency,
                duration_s=args.warmup, max_requests=args.max_requests, tally=loadgen.Tally(),
            )
        for i in range(args.rounds):
            for target in setup.targets if i % 2 == 0 else reversed(setup.targets):
                tally = tallies[target.name]
                cpu_before = setup.cpu_seconds()
                await loadgen.run_round(
                    session[target.name], target, body, request, concurrency=phase.concurrency,
                    duration_s=args.duration / args.rounds,
                    max_requests=max(1, args.max_requests // args.rounds), tally=tally,
                )
                for name, cpu in setup.cpu_seconds().items():
                    spent = cpu - cpu_before.get(name, cpu)
                    tally.server_cpu_s[name] = tally.server_cpu_s.get(name, 0.0) + spent
    return tallies


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed: a lighter client keeps the load generator off the
    critical path."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, through the ExitStack that stops the servers.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.time()
    usable_cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count())
    load_before = os.getloadavg()[0]
    try:
        with contextlib.ExitStack() as stack:
            setup = start_servers(args, stack)
            results = run_async(measure(args, setup))
    except KeyboardInterrupt:
        print("bench: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    except ServerFailed as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    meta = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "host": platform.node(), "python": platform.python_version(),
        "usable_cores": usable_cores,
        # Other work on a shared machine skews absolute figures; the ratios hold up better.
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "pinning": setup.pinning.__dict__ if setup.pinning else None,
        "notes": setup.notes,
        "started_servers": [s.name for s in setup.servers],
        "targets": {t.name: t.chat_url for t in setup.targets},
        "duration_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
        "concurrency": args.concurrency, "completion_tokens": args.completion_tokens,
        "model": args.model, "kind": args.kind,
    }
    figures = report.build(meta, {k: {n: t.summary() for n, t in v.items()}
                                  for k, v in results.items()},
                           titles={p.key: p.title for p in phases(args.concurrency,
                                                                  args.completion_tokens)})
    print(report.render(figures))
    if args.json:
        # NaN (a figure with nothing to measure) is written as null.
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    return 1 if args.strict and not figures["passed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
