"""Benchmark driver: the same load sent straight to an upstream mock and through the gateway.

    python -m loadtests.bench [--duration 10] [--concurrency 64] [--rate 1000] [--streams 1000]
                              [--json PATH] [--quick] [--strict] [--mock auto|nginx|simulator]
                              [--upstream-url URL [--gateway-url URL]]

One run starts an upstream that answers instantly (an nginx mock when nginx is installed, else the
Python simulator), a slow simulator for the open-streams phase, and a gateway with one worker in
front of both; provisions 200 API keys with credits; pins the gateway's worker alone on one core
and everything else (this load generator, the upstreams, the gateway's master and redis-servers)
on the other; and measures four phases (loadtests/README.md):

  throughput  non-streamed requests/s, closed loop at --concurrency
  stream      streamed responses/s (52 SSE events each), closed loop at --concurrency
  open_loop   added p50/p99 latency at a fixed --rate of requests/s, timed from the schedule
  rss         the worker's RSS while it holds --streams open streams (gateway only)

The first three run on both targets, alternating in ABBA order within a phase so drift on a
shared machine hits both alike. The figures that matter are the ratios and the added ms.
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
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson

from loadtests import loadgen, mock, procs, report
from loadtests.servers import (
    ROOT,
    Backend,
    Pinning,
    Server,
    ServerFailed,
    create_keys,
    free_port,
    gateway_args,
    gateway_worker_pid,
    nginx_args,
    nginx_binary,
    plan_pinning,
    redis_pids,
    simulator_args,
    wait_ready,
    write_gateway_config,
)

GATEWAY_CHAT_PATH = "/v2/compat/v1/chat/completions"
DIRECT_CHAT_PATH = "/v1/chat/completions"
# The open-streams phase: a second model whose streams trickle (nginx, or a slow simulator).
SLOW_MODEL = "acme/slow-chat"
SLOW_TOKENS = 64  # at 0.2 tokens/s (the simulator) over 5 min: outlasts the phase
MAX_TOKENS = 64  # sent by the client; the upstreams answer COMPLETION_TOKENS (48) and stop
CREDITS_PER_ACCOUNT = 1000
# The settings the latency and memory targets are stated for.
TARGET_RATE = 1000.0
TARGET_STREAMS = 1000
PHASE_KEYS = ("throughput", "stream", "open_loop", "rss")
T = TypeVar("T")


@dataclass(frozen=True)
class Phase:
    key: str
    title: str
    kind: Literal["closed", "open", "hold"]
    stream: bool


@dataclass
class Setup:
    targets: list[loadgen.Target]
    slow_target: loadgen.Target | None = None
    servers: list[Server] = field(default_factory=list)
    pinning: Pinning | None = None
    worker_pid: int | None = None
    groups: dict[str, list[int]] = field(default_factory=dict)  # CPU accounting by role
    notes: list[str] = field(default_factory=list)
    upstream: str = ""

    def cores(self) -> dict[str, int]:
        if self.pinning is None:
            return {}
        return {"worker": self.pinning.worker_core, "load": self.pinning.load_core}


def phases(args: argparse.Namespace) -> list[Phase]:
    return [
        Phase("throughput", f"non-streamed, closed loop c={args.concurrency}", "closed", False),
        Phase("stream", f"streamed ({mock.STREAM_EVENTS} events), closed loop "
              f"c={args.concurrency}", "closed", True),
        Phase("open_loop", f"open loop, {args.rate:,.0f} req/s", "open", False),
        Phase("rss", f"{args.streams} open streams (gateway only)", "hold", True),
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench",
        description="The same load straight to an upstream and through the gateway, side by side.",
    )
    p.add_argument("--duration", type=float, help="seconds measured per loaded phase and target "
                   "(default 10, or 1 with --quick)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="workers for the closed-loop phases (default 64)")
    p.add_argument("--rate", type=float, help="requests/s of the open-loop phase "
                   "(default 1000, or 200 with --quick)")
    p.add_argument("--streams", type=int, help="streams held open for the memory figure "
                   "(default 1000, or 50 with --quick)")
    p.add_argument("--hold", type=float, help="seconds the streams are held open while the "
                   "worker's RSS is sampled (default 3, or 0.5 with --quick)")
    p.add_argument("--keys", type=int, help="API keys (one account each) rotated per request "
                   "(default 200, or 20 with --quick)")
    p.add_argument("--phases", default=",".join(PHASE_KEYS), metavar="LIST",
                   help="comma-separated phases to run (default: all, "
                   f"{','.join(PHASE_KEYS)})")
    p.add_argument("--rounds", type=int, default=2,
                   help="slices per phase, alternating the targets in ABBA order (default 2)")
    p.add_argument("--max-requests", type=int, default=500_000,
                   help="cap on requests per closed-loop phase and target (bounds memory)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--quick", action="store_true", help="a smoke test: short phases, the Python "
                   "simulator, 50 streams; only errors are judged (CI runs this)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any check fails")
    p.add_argument("--ledger-fsync", choices=("always", "everysec"), default="always",
                   help="the gateway's embedded ledger Redis appendfsync (default: always)")
    p.add_argument("--access-log", choices=("stderr", "off"), default="stderr",
                   help="the gateway's access log (default: stderr, as shipped; written to the "
                        "gateway's log file here)")
    p.add_argument("--mock", choices=("auto", "nginx", "simulator"), default="auto",
                   help="the upstream to start: auto = nginx when installed (not with --quick), "
                   "else the Python simulator")
    p.add_argument("--model", default=mock.MODEL)
    p.add_argument("--kind", choices=("vllm", "tgi"), default="vllm",
                   help="the simulator to start, or what --upstream-url is (default vllm)")
    p.add_argument("--upstream-url", help="measure this running upstream instead of starting "
                   "one (a gateway is started in front of it unless --gateway-url)")
    p.add_argument("--gateway-url", help="measure this running gateway (needs --upstream-url: "
                   "the upstream it fronts; nothing is started or pinned, no memory phase)")
    p.add_argument("--api-key", default=os.environ.get("LOADTEST_API_KEY"),
                   help="with --gateway-url: its API key(s), comma-separated, rotated per request "
                   "(default $LOADTEST_API_KEY); a gateway started here gets --keys new ones")
    args = p.parse_args(argv)
    if args.gateway_url and not args.upstream_url:
        p.error("--gateway-url needs --upstream-url: the direct side must be what it fronts")
    if args.gateway_url and not args.api_key:
        p.error("--gateway-url needs --api-key: keys can only be created in a gateway started here")
    if args.mock == "nginx" and args.kind != "vllm":
        p.error("the nginx mock speaks vLLM's dialect; use --mock simulator with --kind tgi")
    args.phases = [k.strip() for k in args.phases.split(",") if k.strip()]
    if not args.phases or set(args.phases) - set(PHASE_KEYS):
        p.error(f"--phases: choose from {', '.join(PHASE_KEYS)}")
    args.duration = args.duration or (1.0 if args.quick else 10.0)
    args.rate = args.rate or (200.0 if args.quick else TARGET_RATE)
    args.streams = args.streams or (50 if args.quick else TARGET_STREAMS)
    args.hold = args.hold if args.hold is not None else (0.5 if args.quick else 3.0)
    args.keys = args.keys or (20 if args.quick else 200)
    if min(args.concurrency, args.rounds, args.streams, args.keys) < 1 or args.rate <= 0:
        p.error("--concurrency, --rounds, --streams, --keys and --rate must be positive")
    args.warmup = 0.3 if args.quick else 1.0
    return args


def choose_mock(args: argparse.Namespace) -> tuple[str | None, str]:
    """(nginx binary or None for the simulator, why)."""
    binary = nginx_binary()
    if args.mock == "nginx":
        if binary is None:
            raise ServerFailed("--mock nginx: nginx is not installed (apt-get install nginx-light)")
        return binary, "nginx mock"
    if args.mock == "simulator":
        return None, "the Python simulator (--mock simulator)"
    if args.quick:
        return None, "the Python simulator (--quick)"
    if args.kind != "vllm":
        return None, f"the Python simulator (--kind {args.kind}: the nginx mock speaks vLLM)"
    if binary is None:
        return None, ("the Python simulator: nginx is NOT installed, so the upstream costs more "
                      "CPU on the load core than the nginx mock would (apt-get install "
                      "nginx-light)")
    return binary, "nginx mock"


def start_servers(args: argparse.Namespace, stack: contextlib.ExitStack,
                  root: Path = ROOT, *, limits: str | None = None,
                  tracing: float | None = None, shadow: bool = False,
                  routing: Mapping[str, str | float] | None = None) -> Setup:
    """Start what was not given; each start registers its stop on `stack` before anything else
    can fail, so errors and Ctrl-C never leave a server running. `root`: the checkout whose
    `proxy` the started servers run (loadtests.paired starts a base one beside this one);
    `limits`: "tokens" (its tier with token limits), "budgets" (its accounts with budgets) or
    "both", never binding; `tracing`: traces on at that sample ratio, exported to the upstream
    mock (nginx answers OTLP's /v1/traces; the simulator refuses it: the export's work is done
    all the same); `shadow`: shadow policies judge every request (never binding); `routing`:
    the gateway's [routing] section (e.g. the dispatcher off)."""
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gateway-bench-")))
    starting = not args.gateway_url
    pinning = plan_pinning() if starting else None
    load_core = pinning.load_core if pinning else None
    if pinning:
        os.sched_setaffinity(0, {pinning.load_core})  # the load generator, before any thread
    setup = Setup(targets=[], pinning=pinning)

    def start(name: str, cmd: list[str]) -> Server:
        server = Server(name, cmd, workdir / f"{name.split()[0]}.log", load_core, root)
        stack.callback(server.stop)
        setup.servers.append(server)
        return server

    upstream = args.upstream_url
    slow_upstream: str | None = None  # serves SLOW_MODEL's trickling streams
    if upstream:
        upstream = upstream.rstrip("/")
        wait_ready(f"{upstream}/health")
        setup.upstream = f"given: {upstream}"
    else:
        binary, why = choose_mock(args)
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        if binary:
            conf = mock.write_conf(workdir / "nginx", port=port, model=args.model,
                                   slow_model=SLOW_MODEL,
                                   max_connections=max(4096, 2 * args.streams + 1024))
            server = start("upstream (nginx)", nginx_args(binary, conf))
            slow_upstream = upstream + mock.SLOW_PREFIX
            setup.upstream = (f"{why} ({binary}, one worker): fixed answers, "
                              f"{mock.COMPLETION_TOKENS} tokens, {mock.STREAM_EVENTS} SSE events "
                              f"per stream; slow streams trickle at {mock.SLOW_RATE} B/s")
        else:
            server = start("upstream (simulator)", simulator_args(
                args.kind, port, args.model, completion_tokens=mock.COMPLETION_TOKENS,
                max_concurrency=max(1024, 4 * args.concurrency)))
            setup.upstream = (f"{why}, {args.kind}, answering instantly: "
                              f"{mock.COMPLETION_TOKENS} tokens, {mock.STREAM_EVENTS} SSE "
                              "events per stream; slow streams from a second simulator, one token "
                              "every 5 s")
        wait_ready(f"{upstream}/health", server=server)
        setup.groups["upstream"] = server.pids()

    gateway = args.gateway_url
    if not gateway:
        if slow_upstream is None:
            slow_port = free_port()
            slow_upstream = f"http://127.0.0.1:{slow_port}"
            slow = start("slow simulator", simulator_args(
                "vllm", slow_port, SLOW_MODEL, completion_tokens=SLOW_TOKENS, tokens_per_s=0.2,
                max_concurrency=args.streams + 100))
            wait_ready(f"{slow_upstream}/health", server=slow)
            setup.groups["slow simulator"] = slow.pids()
        port = free_port()
        gateway = f"http://127.0.0.1:{port}"
        config = write_gateway_config(workdir / "config", port=port, backends=[
            Backend("bench", args.kind, upstream, args.model),
            Backend("slow", "vllm", slow_upstream, SLOW_MODEL),
        ], ledger_fsync=args.ledger_fsync, access_log=args.access_log,
            limits=limits in ("tokens", "both"),
            traces_to=f"{upstream}/v1/traces" if tracing is not None else None,
            sample_ratio=tracing if tracing is not None else 1.0, shadow=shadow,
            routing=routing)
        gw = start("gateway", gateway_args(config, port))
        wait_ready(f"{gateway}/readyz", server=gw)
        setup.worker_pid = gateway_worker_pid(gw.pid)
        setup.groups["gateway worker"] = [setup.worker_pid]
        setup.groups["gateway master"] = [gw.pid]
        setup.groups["redis"] = redis_pids(gw.pid)
        # A gateway started here has an empty key store: its keys are always made here.
        keys = tuple(create_keys(config, args.keys, credits_each=CREDITS_PER_ACCOUNT,
                                 budgets=limits in ("budgets", "both")))
        if pinning:
            threads = procs.pin(setup.worker_pid, pinning.worker_core)
            if procs.affinity(setup.worker_pid) != {pinning.worker_core}:
                raise gw.failed("could not pin the gateway worker")
            setup.notes.append(
                f"pinned: gateway worker (pid {setup.worker_pid}, {threads} threads) alone on "
                f"core {pinning.worker_core}; load generator, upstream mock(s), gateway master "
                f"and its {len(setup.groups['redis'])} redis-servers on core {pinning.load_core}")
        else:
            setup.notes.append("not pinned: needs os.sched_setaffinity and at least 2 usable "
                               "cores")
        setup.slow_target = loadgen.Target("gateway", gateway + GATEWAY_CHAT_PATH, keys)
    else:
        gateway = gateway.rstrip("/")
        wait_ready(f"{gateway}/readyz")
        keys = _given_keys(args.api_key)
        setup.notes.append("servers given by URL: not started here, nothing pinned, no memory "
                           "phase")
    setup.notes.append(f"upstream: {setup.upstream}")
    how = "given" if args.gateway_url else "created here, one account each, all with credits"
    setup.notes.append(f"{len(keys)} API keys ({how}) rotated round robin, one tier whose "
                       "limit never binds; gateway route " + GATEWAY_CHAT_PATH)
    setup.targets = [
        loadgen.Target("direct", upstream + DIRECT_CHAT_PATH),
        loadgen.Target("gateway", gateway + GATEWAY_CHAT_PATH, keys),
    ]
    return setup


def _given_keys(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


Snapshot = tuple[dict[str, float], dict[int, tuple[float, float]]]


def snapshot(setup: Setup) -> Snapshot:
    return ({name: procs.cpu_seconds(pids) for name, pids in setup.groups.items()},
            procs.core_times())


def account(setup: Setup, tally: loadgen.Tally, before: Snapshot) -> None:
    """Add the server CPU and core busy time since `before` to `tally`."""
    cpu, cores = snapshot(setup)
    for name, seconds in cpu.items():
        spent = seconds - before[0].get(name, seconds)
        tally.server_cpu_s[name] = tally.server_cpu_s.get(name, 0.0) + spent
    for role, core in setup.cores().items():
        if core in cores and core in before[1]:
            busy = tally.core_busy_s.setdefault(role, [0.0, 0.0])
            busy[0] += cores[core][0] - before[1][core][0]
            busy[1] += cores[core][1] - before[1][core][1]


async def measure(args: argparse.Namespace, setup: Setup
                  ) -> dict[str, dict[str, loadgen.Tally | None]]:
    results: dict[str, dict[str, loadgen.Tally | None]] = {}
    for phase in phases(args):
        if phase.key not in args.phases:
            continue
        if phase.kind == "hold":
            if setup.slow_target is None or setup.worker_pid is None:
                continue  # a gateway given by URL: its worker is not ours to measure
            print(f"measuring {phase.title} ...", file=sys.stderr, flush=True)
            results[phase.key] = {"direct": None,
                                  "gateway": await run_hold(args, setup, setup.slow_target,
                                                            setup.worker_pid)}
            continue
        print(f"measuring {phase.title} ...", file=sys.stderr, flush=True)
        results[phase.key] = dict(await run_phase(phase, args, setup))
    return results


async def run_phase(
    phase: Phase, args: argparse.Namespace, setup: Setup
) -> dict[str, loadgen.Tally]:
    body = loadgen.chat_body(args.model, stream=phase.stream, max_tokens=MAX_TOKENS)
    request = loadgen.stream_once if phase.stream else loadgen.chat_once
    tallies = {t.name: loadgen.Tally() for t in setup.targets}
    # Open loop: connections as needed, up to a bound (queueing in the pool counts as latency).
    limit = args.concurrency if phase.kind == "closed" else 1024

    async def slice_(target: loadgen.Target, seconds: float, tally: loadgen.Tally) -> None:
        if phase.kind == "closed":
            await loadgen.run_round(
                session[target.name], target, body, request, concurrency=args.concurrency,
                duration_s=seconds, max_requests=max(1, args.max_requests // args.rounds),
                tally=tally)
        else:
            await loadgen.run_open_loop(session[target.name], target, body, request,
                                        rate=args.rate, duration_s=seconds, tally=tally)

    async with contextlib.AsyncExitStack() as sessions:
        session = {t.name: await sessions.enter_async_context(loadgen.new_session(limit))
                   for t in setup.targets}
        for target in setup.targets:  # opens the pooled connections; results discarded
            await slice_(target, args.warmup, loadgen.Tally())
        for i in range(args.rounds):
            for target in setup.targets if i % 2 == 0 else reversed(setup.targets):
                before = snapshot(setup)
                await slice_(target, args.duration / args.rounds, tallies[target.name])
                account(setup, tallies[target.name], before)
    return tallies


async def run_hold(args: argparse.Namespace, setup: Setup, target: loadgen.Target,
                   worker_pid: int) -> loadgen.Tally:
    """Idle RSS, then `--streams` slow streams held open while the worker's RSS is sampled."""
    tally = loadgen.Tally()
    await asyncio.sleep(0.5)  # let the last phase's requests settle
    idle = [procs.rss_bytes(worker_pid) or 0 for _ in range(3)]
    tally.figures["rss_idle_mb"] = max(idle) / 1e6
    peak = 0

    async def while_open() -> None:
        nonlocal peak
        deadline = time.perf_counter() + args.hold
        while True:
            peak = max(peak, procs.rss_bytes(worker_pid) or 0)
            if time.perf_counter() >= deadline:
                return
            await asyncio.sleep(0.1)

    body = loadgen.chat_body(SLOW_MODEL, stream=True, max_tokens=SLOW_TOKENS)
    before = snapshot(setup)
    async with loadgen.new_session(args.streams + 16, loadgen.HOLD_TIMEOUT) as session:
        opened = await loadgen.hold_streams(
            session, target, body, count=args.streams, open_timeout_s=60.0, connecting=64,
            tally=tally, while_open=while_open)
    account(setup, tally, before)
    tally.figures["streams"] = args.streams
    tally.figures["streams_open"] = opened
    tally.figures["rss_open_mb"] = peak / 1e6 if opened == args.streams else float("nan")
    return tally


def unjudged(args: argparse.Namespace) -> list[str]:
    """Phases run with other settings than their target's: shown, not judged."""
    out = []
    if args.rate != TARGET_RATE:
        out.append("open_loop")
    if args.streams < TARGET_STREAMS:
        out.append("rss")
    return out


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
    # Each held stream is a socket here, two in the gateway worker and one in the simulator;
    # children inherit the raised limit.
    nofile = procs.raise_nofile(4 * args.streams + 4096)
    if nofile[0] < 2 * args.streams + 256:
        print(f"bench: RLIMIT_NOFILE is {nofile[0]} (hard {nofile[1]}): too low for "
              f"{args.streams} streams; raise it (ulimit -n) or give --streams", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    try:
        with contextlib.ExitStack() as stack:
            setup = start_servers(args, stack)
            rss_start = procs.rss_bytes(setup.worker_pid) if setup.worker_pid else None
            results = run_async(measure(args, setup))
            held = results.get("rss", {}).get("gateway")
            if held is not None and rss_start is not None:
                held.figures["rss_start_mb"] = rss_start / 1e6
            worker_now = None
            if setup.worker_pid is not None and setup.servers:
                gateway_server = next(s for s in setup.servers if s.name == "gateway")
                worker_now = gateway_worker_pid(gateway_server.pid)
    except KeyboardInterrupt:
        print("bench: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    except ServerFailed as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if worker_now is not None and worker_now != setup.worker_pid:
        setup.notes.append(f"WARNING the gateway worker was replaced during the run (pid "
                           f"{setup.worker_pid} -> {worker_now}): figures are suspect")
    setup.notes.append(
        f"closed loop: {args.duration:g} s per target in {args.rounds} ABBA rounds after a "
        f"{args.warmup:g} s warm-up, concurrency {args.concurrency}; open loop: "
        f"{args.rate:,.0f} req/s for {args.duration:g} s per target, latency from the scheduled "
        f"start; memory: {args.streams} streams held {args.hold:g} s, peak RSS (1 MB = 10^6 B)")
    for key in unjudged(args):
        setup.notes.append(f"{key}: run with other settings than its target's (--rate "
                           f"{TARGET_RATE:g}, --streams {TARGET_STREAMS}): shown, not judged")
    meta = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "host": platform.node(), "python": platform.python_version(),
        "usable_cores": usable_cores,
        # Other work on a shared machine skews absolute figures; the ratios hold up better.
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "pinning": setup.pinning.__dict__ if setup.pinning else None,
        "notes": setup.notes,
        "upstream": setup.upstream,
        "started_servers": [s.name for s in setup.servers],
        "targets": {t.name: t.chat_url for t in setup.targets},
        "worker_pid": setup.worker_pid,
        "worker_rss_at_start_mb": rss_start / 1e6 if rss_start else None,
        "nofile_limit": nofile[0],
        "judged": not args.quick,
        "duration_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
        "concurrency": args.concurrency, "rate": args.rate, "streams": args.streams,
        "hold_s": args.hold, "keys": len(setup.targets[1].keys), "model": args.model,
        "kind": args.kind, "stream_events": mock.STREAM_EVENTS,
    }
    summaries = {k: {n: (t.summary() if t is not None else None) for n, t in v.items()}
                 for k, v in results.items()}
    figures = report.build(meta, summaries, titles={p.key: p.title for p in phases(args)},
                           judged=not args.quick,
                           skipped=[k for k in PHASE_KEYS if k not in results],
                           unjudged=unjudged(args))
    print(report.render(figures))
    if args.json:
        # NaN (a figure with nothing to measure) is written as null.
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    return 1 if args.strict and not figures["passed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
