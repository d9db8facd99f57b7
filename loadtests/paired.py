"""Paired comparison: this checkout's gateway against a base one, in one run, under one load.

    python -m loadtests.paired BASE [--rounds 10] [--slice 2] [--rate 1000] [--keys 200]
                                    [--mock auto|nginx|simulator] [--limits [tokens|budgets]]
                                    [--tracing RATIO] [--shadow] [--no-dispatch]
                                    [--json PATH]

Whole runs of `loadtests.bench` wander at the median on a shared 2-core machine (~0.05 ms, more
on a busy day), as much as most changes move it. Here both gateways run at once, each as the
benchmark starts it (its own upstream mock and redis-servers; its one worker pinned alone on the
worker core, only one of the two loaded at a time), and open-loop slices alternate between
direct, base and this, round after round, in ABBA order. A change's effect is the median over
rounds of (this - base), each pair measured seconds apart: ±0.05 to 0.1 ms here (repeat a run
before trusting less).

BASE is a git ref, checked out into a temporary worktree that is removed afterwards, or the
folder of another checkout. `--limits` gives this checkout's gateway token limits on its tier
and a budget on each account (never binding, so their whole path runs), not the base's: with
BASE = HEAD, what turning them on costs. The keys are made by this checkout's code, so the
base must share its key and ledger formats. `--tracing RATIO` turns this gateway's traces on
([telemetry], sampling RATIO of requests, exported to the upstream mock's OTLP sink): with
BASE = HEAD, what tracing costs. `--shadow` gives this gateway shadow policies (its tier with
token limits, other prices; never binding) judging every request: with BASE = HEAD, what a
shadow set costs. `--no-dispatch` turns this gateway's dispatcher off: with BASE = HEAD, what
the dispatcher costs (read the difference with its sign turned).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtests import bench, loadgen, procs
from loadtests.servers import ROOT, ServerFailed

TARGETS = ("direct", "base", "this")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.paired",
                                description="This checkout's gateway against a base one, "
                                "alternating open-loop slices in one run.")
    p.add_argument("base", help="a git ref (e.g. HEAD, main~1) or another checkout's folder")
    p.add_argument("--rounds", type=int, default=10, help="slices per target (default 10)")
    p.add_argument("--slice", type=float, default=2.0, help="seconds per slice (default 2)")
    p.add_argument("--rate", type=float, default=bench.TARGET_RATE,
                   help="requests/s of every slice (default 1000)")
    p.add_argument("--keys", type=int, default=200, help="API keys per gateway (default 200)")
    p.add_argument("--mock", choices=("auto", "nginx", "simulator"), default="auto",
                   help="the upstream mock (default: nginx when installed)")
    p.add_argument("--limits", nargs="?", const="both", choices=("tokens", "budgets", "both"),
                   help="this gateway only: token limits and/or budgets on (never binding)")
    p.add_argument("--no-dispatch", action="store_true",
                   help="this gateway only: the dispatcher off ([routing] dispatch = false)")
    p.add_argument("--shadow", action="store_true",
                   help="this gateway only: shadow policies judge every request")
    p.add_argument("--tracing", type=float, metavar="RATIO",
                   help="this gateway only: traces on, sampling RATIO (0-1) of requests")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if min(args.rounds, args.keys) < 1 or args.slice <= 0 or args.rate <= 0:
        p.error("--rounds, --keys, --slice and --rate must be positive")
    return args


@contextlib.contextmanager
def checkout(base: str) -> Iterator[Path]:
    """The base's folder: given, or a temporary git worktree of the ref."""
    if Path(base).is_dir():
        yield Path(base).resolve()
        return
    folder = Path(tempfile.mkdtemp(prefix="gateway-paired-")) / "base"
    try:
        subprocess.run(["git", "worktree", "add", "--detach", str(folder), base], cwd=ROOT,
                       check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(folder.parent, ignore_errors=True)
        raise ServerFailed(f"git worktree add {base}: {exc.stderr.strip()}") from None
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT,
                       check=False, capture_output=True)
        shutil.rmtree(folder.parent, ignore_errors=True)


async def measure(args: argparse.Namespace, targets: dict[str, loadgen.Target], body: bytes,
                  warmup_s: float, workers: dict[str, int]
                  ) -> tuple[dict[str, list[loadgen.Tally]], dict[str, list[float]]]:
    """`args.rounds` open-loop slices per target, the order reversed every other round; and
    per gateway the CPU seconds its worker spent in each slice (its threads included)."""
    slices: dict[str, list[loadgen.Tally]] = {name: [] for name in targets}
    cpu: dict[str, list[float]] = {name: [] for name in workers}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {name: await stack.enter_async_context(loadgen.new_session(1024))
                    for name in targets}

        async def one(name: str, seconds: float, tally: loadgen.Tally) -> None:
            await loadgen.run_open_loop(sessions[name], targets[name], body, loadgen.chat_once,
                                        rate=args.rate, duration_s=seconds, tally=tally)

        for name in targets:  # opens the pooled connections; results discarded
            await one(name, warmup_s, loadgen.Tally())
        for i in range(args.rounds):
            for name in TARGETS if i % 2 == 0 else reversed(TARGETS):
                tally = loadgen.Tally()
                pid = workers.get(name)
                before = procs.cpu_seconds([pid]) if pid else 0.0
                await one(name, args.slice, tally)
                if pid:
                    cpu[name].append(procs.cpu_seconds([pid]) - before)
                slices[name].append(tally)
    return slices, cpu


def figures(slices: dict[str, list[loadgen.Tally]], cpu: dict[str, list[float]] | None = None
            ) -> dict[str, Any]:
    """Per target the median of its slices' p50 and p99; per round this - base; per gateway its
    worker's CPU per request (the inverse of what its core could serve), and this / base."""
    def pct(tally: loadgen.Tally, q: float) -> float:
        return loadgen.percentile(tally.latencies_s, q) * 1000 if tally.latencies_s else math.nan

    out: dict[str, Any] = {"targets": {}, "this_minus_base": {}}
    for name, tallies in slices.items():
        out["targets"][name] = {
            "p50_ms": statistics.median(pct(t, 50) for t in tallies),
            "p99_ms": statistics.median(pct(t, 99) for t in tallies),
            "requests": sum(len(t.latencies_s) for t in tallies),
            "errors": sum(sum(t.errors.values()) for t in tallies),
        }
        if cpu and cpu.get(name):
            out["targets"][name]["cpu_ms_per_request"] = statistics.median(
                seconds * 1000 / max(1, len(t.latencies_s))
                for seconds, t in zip(cpu[name], tallies, strict=True))
    for q in (50, 99):
        diffs = [pct(this, q) - pct(base, q)
                 for this, base in zip(slices["this"], slices["base"], strict=True)]
        out["this_minus_base"][f"p{q}_ms"] = {
            "median": statistics.median(diffs), "min": min(diffs), "max": max(diffs)}
    this, base = (out["targets"][n].get("cpu_ms_per_request") for n in ("this", "base"))
    if this and base:
        out["this_over_base_cpu"] = this / base  # 1.03: 3 % less throughput per core
    return out


def render(args: argparse.Namespace, found: dict[str, Any]) -> str:
    lines = [f"Paired: this checkout vs base {args.base}, {args.rounds} rounds of {args.slice:g} s "
             f"open-loop slices at {args.rate:,.0f} req/s (direct, base, this; ABBA)", "",
             f"{'target':8}  {'p50 ms':>8}  {'p99 ms':>8}  {'requests':>9}  {'errors':>6}"]
    for name in TARGETS:
        row = found["targets"][name]
        cpu_text = (f"  {row['cpu_ms_per_request']:.3f} ms CPU/request"
                    if "cpu_ms_per_request" in row else "")
        lines.append(f"{name:8}  {row['p50_ms']:8.3f}  {row['p99_ms']:8.3f}  "
                     f"{row['requests']:9,}  {row['errors']:6}{cpu_text}")
    lines.append("")
    for q in ("p50", "p99"):
        d = found["this_minus_base"][f"{q}_ms"]
        lines.append(f"this - base, {q}: {d['median']:+.3f} ms (median of the rounds; "
                     f"{d['min']:+.3f} to {d['max']:+.3f})")
    if "this_over_base_cpu" in found:
        ratio = found["this_over_base_cpu"]
        lines.append(f"this / base, worker CPU per request: {ratio:.3f} (throughput per core "
                     f"{(1 / ratio - 1) * 100:+.1f} %)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the servers stop and the base's worktree is removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    bench_args = bench.parse_args(["--phases", "open_loop", "--rate", str(args.rate),
                                   "--keys", str(args.keys), "--mock", args.mock])
    body = loadgen.chat_body(bench_args.model, stream=False, max_tokens=bench.MAX_TOKENS)
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        with checkout(args.base) as base_root, contextlib.ExitStack() as stack:
            targets: dict[str, loadgen.Target] = {}
            workers: dict[str, int] = {}
            for name, root in (("base", base_root), ("this", ROOT)):
                if cores is not None:  # each start pins this driver to the load core
                    os.sched_setaffinity(0, cores)
                setup = bench.start_servers(bench_args, stack, root=root,
                                            limits=args.limits if name == "this" else None,
                                            tracing=args.tracing if name == "this" else None,
                                            shadow=args.shadow and name == "this",
                                            routing={"dispatch": False} if args.no_dispatch
                                            and name == "this" else None)
                targets.setdefault("direct", setup.targets[0])
                targets[name] = setup.targets[1]
                if setup.worker_pid:
                    workers[name] = setup.worker_pid
            found = figures(*bench.run_async(measure(args, targets, body, bench_args.warmup,
                                                     workers)))
    except KeyboardInterrupt:
        print("paired: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    except ServerFailed as exc:
        print(f"paired: {exc}", file=sys.stderr)
        return 2
    print(render(args, found))
    if args.json:
        args.json.write_bytes(orjson.dumps(found, option=orjson.OPT_INDENT_2))
    return 1 if any(row["errors"] for row in found["targets"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
