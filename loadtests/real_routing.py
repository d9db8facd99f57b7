"""Routing on real vLLM (issue 31): the gateway's `prefix` pick, with and without the engines'
KV-cache events and its learned prefill price, beside vllm-router and sglang-router when they
are installed.

    python -m loadtests.real_routing [--seeds 1,2,3] [--configs prefix,prefix-events,...]
        [--requests 1000] [--concurrency 6 | --rate R] [--warmup 12]
        [--prefill-ms-per-1k-tokens N] [--engine-queue N] [--trace] [--json PATH]
    (configs: prefix, prefix-events, vllm-router, sglang-router by default; prefix-fixed)

For each seed and config, two fresh real vLLM replicas (the real-engine tier's tiny model and
scripts, tests/support/real_engines.py: CPU, one core each, `--max-num-seqs 4`, a KV cache of
128 blocks of 32 tokens, 4,096 tokens, so they evict), publishing their KV-cache events; in
front of them a one-worker gateway (`max_concurrency` 4, the batch, and one request more queued
in each engine: `[routing] engine_queue`) routing by `prefix` (`prefix-events`: with `kv_events` on
each backend; `prefix-fixed`: at its configured prefill price, `learn_prefill = false`) or a
router with its cache-aware policy (loadtests/routers.py). The same seeded
requests for every config: system prompts of ~410 tokens (random hex words, so that the
tokenizer finds no shortcut) drawn by a Zipf law from 24, each followed by a short question,
streamed, `--concurrency` at a time (closed loop), or with `--rate` at seeded Poisson arrivals
of that many a second, answered or not (open loop: every config offered the same load). Reported
per config, mean and min-max over the seeds: the engines' own prefix-cache hit rate
(`vllm:prefix_cache_hits_total / queries_total`), time to first token p50 and p99 of the
requests after the first `--warmup` (the engines' start: reported apart, as the slowest of
them), completed requests a second, errors, the engines' prefill time per 1,000 tokens they
computed (the sums' ratio), and the price the gateway learned from them at the end of the run
(its pool's: the fastest engine's; `--prefill-ms-per-1k-tokens` gives the gateway a configured
figure other than its default). The configs run in a different order for
each seed (rotated), so that none always runs on the coolest machine.

vLLM is installed and the model built on first use (~2 min; cached in $REAL_ENGINES_DIR, as
for the real-engine tier: docs/real-engine.md). Each run starts two replicas (~30-60 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from loadtests import loadgen, routers
from loadtests.routing import HOLDER_WAITS, by_label
from loadtests.servers import (
    Backend,
    Server,
    create_keys,
    free_port,
    gateway_args,
    wait_ready,
    write_gateway_config,
)
from tests.support.real_engines import SERVED, Engines, Replica

# Small caches that must evict: 128 blocks of 32 tokens, about ten of the system prompts.
ARGS = ("--max-num-seqs", "4", "--enable-prompt-tokens-details", "--block-size", "32",
        "--num-gpu-blocks-override", "128", "--enforce-eager")
SLOTS = 4
GATEWAY_CONFIGS = ("prefix", "prefix-events", "prefix-fixed")
CONFIGS = (*GATEWAY_CONFIGS, *routers.ROUTERS)
DEFAULT_CONFIGS = ("prefix", "prefix-events", *routers.ROUTERS)
PROMPTS = 24
CHAT_PATH = "/v2/compat/v1/chat/completions"
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:request_prefill_time_seconds_sum", "vllm:prompt_tokens_total")
LEARNED = "igw_engine_prefill_ms_per_1k_tokens"  # the gateway's fit, per engine


def workload(seed: int, requests: int) -> list[list[dict[str, str]]]:
    """`requests` conversations: a Zipf-drawn system prompt of 60 hex words, a short question."""
    rng = random.Random(seed)
    systems = [" ".join(f"{rng.getrandbits(32):08x}" for _ in range(60)) for _ in range(PROMPTS)]
    weights = [1 / (k + 1) for k in range(PROMPTS)]
    out = []
    for j in range(requests):
        system = rng.choices(systems, weights)[0]
        question = f"q{j} " + " ".join(f"{rng.getrandbits(16):04x}"
                                       for _ in range(rng.randint(2, 8)))
        out.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
    return out


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as page:
        return str(page.read().decode())


def counters(url: str, names: Sequence[str] = COUNTERS) -> dict[str, list[float]]:
    """Each of `names` in the /metrics at `url`: its samples' values (every label set)."""
    out: dict[str, list[float]] = {name: [] for name in names}
    for line in metrics_text(url).splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name].append(float(line.rsplit(" ", 1)[1]))
    return out


Traced = dict[int, tuple[str, int, int, float]]  # request -> id, prompt, cached tokens, TTFT s


async def drive(url: str, keys: Sequence[str], conversations: Sequence[list[dict[str, str]]],
                concurrency: int, traced: Traced | None = None, rate: float | None = None,
                seed: int = 0) -> tuple[dict[int, float], int]:
    """Each conversation streamed, `concurrency` at a time (closed loop), or with `rate`
    sent at seeded Poisson arrivals of that many a second, answered or not (open loop:
    every config is offered the same load); their times to first token by conversation, and
    how many failed. With `traced`, each answer's id, usage (prompt and cached tokens) and
    time to first token by conversation."""
    gate = asyncio.Semaphore(concurrency if rate is None else len(conversations))
    arrivals = random.Random(seed)
    due = list(itertools.accumulate(
        arrivals.expovariate(rate) for _ in conversations)) if rate else None
    ttfts: dict[int, float] = {}
    errors = 0

    async def one(i: int, messages: list[dict[str, str]]) -> None:
        nonlocal errors
        headers = {"X-Request-Id": f"real-routing-{i}"}  # in the gateway's access log
        if keys:
            headers["X-API-Key"] = keys[i % len(keys)]
        body: dict[str, Any] = {"model": SERVED, "messages": messages, "max_tokens": 4,
                                "stream": True}
        if traced is not None:
            body["stream_options"] = {"include_usage": True}
        if due is not None:
            await asyncio.sleep(max(0.0, begun + due[i] - time.perf_counter()))
        async with gate:
            started = time.perf_counter()
            first = None
            try:
                async with session.post(url, json=body, headers=headers) as resp:
                    async for line in resp.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.perf_counter() - started
                        if traced is not None and b'"usage":{' in line.replace(b" ", b""):
                            chunk = json.loads(line.removeprefix(b"data: "))
                            usage = chunk.get("usage") or {}
                            cached = (usage.get("prompt_tokens_details") or {}).get(
                                "cached_tokens") or 0
                            traced[i] = (chunk.get("id", ""), usage.get("prompt_tokens", 0),
                                         cached, first or 0.0)
                    ok = resp.status == 200 and first is not None
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok and first is not None:
                ttfts[i] = first
            else:
                errors += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        begun = time.perf_counter()
        await asyncio.gather(*(one(i, m) for i, m in enumerate(conversations)))
    return ttfts, errors


def run(config: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Two fresh replicas, `config` in front of them, the seed's requests."""
    events = config == "prefix-events"
    extra = ("--enable-log-requests",) if args.trace else ()  # each request's id, per replica
    replicas = [Replica(f"r{i}", free_port(), i, work / f"{config}-{seed}-r{i}.log",
                        args=(*ARGS, *extra),
                        events_port=free_port() if events else None) for i in range(2)]
    engines = Engines(replicas, work / "prepare.log")
    keys: tuple[str, ...] = ()
    with contextlib.ExitStack() as stack:
        engines.start()
        stack.callback(engines.stop)
        if config in routers.ROUTERS:
            router, base = routers.start(config, [r.url for r in replicas],
                                         work / f"{config}-{seed}.log")
            stack.callback(router.stop)
            url = base + routers.CHAT_PATH
        else:
            port = free_port()
            folder = work / f"{config}-{seed}-config"
            routing: dict[str, str | float | bool] = {"pick": "prefix",
                                                      "learn_prefill": config != "prefix-fixed"}
            if args.prefill_ms_per_1k_tokens is not None:
                routing["prefill_ms_per_1k_tokens"] = args.prefill_ms_per_1k_tokens
            if args.engine_queue is not None:
                routing["engine_queue"] = args.engine_queue
            gateway_config = write_gateway_config(
                folder, port=port, ledger_fsync="everysec", routing=routing,
                backends=[Backend(r.name, "vllm", r.url, SERVED, 1, SLOTS, r.events_url)
                          for r in replicas])
            gateway = Server("gateway", gateway_args(gateway_config, port, workers=1),
                             work / f"{config}-{seed}-gateway.log", None)
            stack.callback(gateway.stop)
            wait_ready(f"http://127.0.0.1:{port}/readyz", server=gateway)
            url = f"http://127.0.0.1:{port}{CHAT_PATH}"
            keys = tuple(create_keys(gateway_config, 8, credits_each=100_000))
        before = [counters(r.url) for r in replicas]
        conversations = workload(seed, args.requests)
        traced: Traced | None = {} if args.trace else None
        started = time.perf_counter()
        by_request, errors = asyncio.run(drive(url, keys, conversations, args.concurrency, traced,
                                          args.rate, seed))
        seconds = time.perf_counter() - started
        after = [counters(r.url) for r in replicas]
        # The gateway's figures: its price at the end (its pool's, the least of its engines'
        # fitted ones) and, for `--trace`, its waits for a busy holder by how they ended.
        figures = metrics_text(url.removesuffix(CHAT_PATH)) if config in GATEWAY_CONFIGS else ""
        fits = by_label(figures, LEARNED, "backend")  # each engine's
        learned = min(fits.values(), default=float("nan"))
        waits = by_label(figures, HOLDER_WAITS, "outcome") if args.trace and figures else None
    hits, queries, prefill_s, prompt = (
        sum(sum(a[name]) - sum(b[name]) for a, b in zip(after, before, strict=True))
        for name in COUNTERS)
    computed = prompt - hits  # the sums' ratio (fixed costs in), what an operator reads by hand
    misses: dict[str, Any] = {}
    if traced is not None:
        answered_by = replica_of({r.name: r.log for r in replicas})
        kinds = kind_of(conversations, traced, answered_by)
        misses["requests_by_kind"] = count_kinds(kinds)
        misses["requests_by_replica"] = dict(sorted(Counter(
            answered_by.get(traced[i][0], "unmatched") for i in traced).items()))
        misses["ttft_ms_by_kind"] = {kind: sorted(round(traced[i][3] * 1000, 1)
                                                  for i in kinds if kinds[i] == kind)
                                     for kind in KINDS}
    if waits is not None:
        misses["holder_waits"] = waits
    # The first requests meet engines that have just started (their first steps are slow) and
    # are sent all at once: 6 first sights of their prompts, two or three to a replica
    # prefilling together. Counted, that start made each run's p99 (its 3rd slowest request)
    # on most seeds; the figures are of the requests after it (`--warmup`, default 12), the
    # start's own in `ttft_max_start_ms`.
    ttfts = [t for i, t in by_request.items() if i >= args.warmup]
    start = [t for i, t in by_request.items() if i < args.warmup]
    return {"config": config, "seed": seed, "errors": errors, "requests": len(by_request),
            **misses,
            "hit_rate": hits / queries if queries else float("nan"),
            "prefill_ms_per_1k_tokens": prefill_s / computed * 1e6 if computed else float("nan"),
            "learned_ms_per_1k_tokens": learned, "learned_by_replica": fits,
            "req_per_s": len(by_request) / seconds,
            "ttft_max_start_ms": max(start, default=float("nan")) * 1000,
            "ttft_p50_ms": loadgen.percentile(ttfts, 50) * 1000,
            "ttft_p99_ms": loadgen.percentile(ttfts, 99) * 1000}


KINDS = ("first", "elsewhere", "evicted", "hit", "unmatched")


def kind(holders: set[str], replica: str, cached: float, prompt_tokens: float) -> str:
    """What a request found, given the replicas sent its system prompt before (`holders`)."""
    return ("first" if not holders else "elsewhere" if replica not in holders
            else "hit" if cached >= prompt_tokens / 2 else "evicted")


def count_kinds(kinds: dict[int, str]) -> dict[str, int]:
    counts = Counter(kinds.values())
    return {kind: counts[kind] for kind in KINDS}


def replica_of(logs: dict[str, Path]) -> dict[str, str]:
    """Each answer's id -> the replica that logged it (`--trace`: vLLM logs every request)."""
    out = {}
    for name, log in logs.items():
        for line in log.read_text(errors="replace").splitlines():
            if "Received request " in line:
                out[line.split("Received request ", 1)[1].split(":", 1)[0]] = name
    return out


def kind_of(conversations: Sequence[list[dict[str, str]]], traced: Traced,
            answered_by: dict[str, str]) -> dict[int, str]:
    """`--trace`: each request (in sending order) by what its replica held of its system
    prompt: `first` (no replica had been sent it), `elsewhere` (this replica had not, another
    had), `evicted` (this one had, but found less than half the prompt cached), `hit`, and
    `unmatched` (no replica logged its id: `answered_by`, from `replica_of`)."""
    sent: dict[str, set[str]] = {}  # system prompt -> replicas sent it
    kinds = {}
    for i in sorted(traced):
        answer_id, prompt_tokens, cached, _ = traced[i]
        replica = answered_by.get(answer_id)
        if replica is None:
            kinds[i] = "unmatched"
            continue
        holders = sent.setdefault(conversations[i][0]["content"], set())
        kinds[i] = kind(holders, replica, cached, prompt_tokens)
        holders.add(replica)
    return kinds


def summarise(runs: Sequence[dict[str, Any]], configs: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        row: dict[str, Any] = {"config": config, "runs": len(mine),
                               "errors": sum(r["errors"] for r in mine)}
        for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "prefill_ms_per_1k_tokens",
                    "learned_ms_per_1k_tokens", "req_per_s", "ttft_max_start_ms"):
            values = [r[key] for r in mine]
            row[key] = sum(values) / len(values)
            row[key + "_range"] = (min(values), max(values))
        out.append(row)
    return out


def render(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'config':<15} {'hit rate (min-max)':>22} {'TTFT p50 ms':>12} "
             f"{'TTFT p99 ms (min-max)':>24} {'errors':>7} {'prefill ms/1k':>14} "
             f"{'learned ms/1k':>14} {'req/s':>6} {'start max ms':>13}"]
    for r in rows:
        low, high = r["hit_rate_range"]
        p99_low, p99_high = r["ttft_p99_ms_range"]
        lines.append(f"{r['config']:<15} {100 * r['hit_rate']:>6.1f} % "
                     f"({100 * low:.1f}-{100 * high:.1f}) {r['ttft_p50_ms']:>12.0f} "
                     f"{r['ttft_p99_ms']:>10.0f} ({p99_low:.0f}-{p99_high:.0f}) "
                     f"{r['errors']:>7} {r['prefill_ms_per_1k_tokens']:>14.0f} "
                     f"{r['learned_ms_per_1k_tokens']:>14.0f} {r['req_per_s']:>6.1f} "
                     f"{r['ttft_max_start_ms']:>13.0f}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.real_routing",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2,3", help="comma-separated (default 1,2,3)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated among {', '.join(CONFIGS)} (routers when installed)")
    p.add_argument("--requests", type=int, default=1000,
                   help="a run's requests (default 1,000: the learned price settles)")
    p.add_argument("--concurrency", type=int, default=6,
                   help="requests at a time, each sent when one is answered (default 6)")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop instead: requests a second at seeded Poisson arrivals, "
                        "answered or not, the same for every config")
    p.add_argument("--prefill-ms-per-1k-tokens", type=float, default=None,
                   help="the gateway's [routing] prefill_ms_per_1k_tokens (default: its own)")
    p.add_argument("--engine-queue", type=int, default=None,
                   help="the gateway's [routing] engine_queue (default: its own, 1)")
    p.add_argument("--warmup", type=int, default=12,
                   help="the first N requests are sent but left out of the TTFT figures "
                        "(default 12: the engines' start)")
    p.add_argument("--trace", action="store_true",
                   help="classify each request by what its replica held of its prompt (first "
                        "sight, sent elsewhere, evicted, hit): the engines log every request")
    p.add_argument("--json", type=Path, help="write the runs and the summary here")
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error("--seeds: integers, e.g. 1,2,3")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.seeds or not args.configs or set(args.configs) - set(CONFIGS):
        p.error(f"--seeds and --configs must be non-empty; configs among {', '.join(CONFIGS)}")
    if args.requests < 1 or args.concurrency < 1 or (args.rate is not None and args.rate <= 0):
        p.error("--requests, --concurrency and --rate must be positive")
    if not 0 <= args.warmup < args.requests:
        p.error("--warmup must be at least 0 and below --requests")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    versions = routers.installed()
    configs = [c for c in args.configs if c not in routers.ROUTERS or versions[c]]
    for name in sorted(set(args.configs) - set(configs)):
        print(f"real_routing: skipping {name}: not installed (pip install -e '.[routers]')",
              file=sys.stderr)
    if not configs:
        return 2
    runs = []
    with tempfile.TemporaryDirectory(prefix="real-routing-") as folder:
        for n, seed in enumerate(args.seeds):
            turn = n % len(configs)
            for config in configs[turn:] + configs[:turn]:
                print(f"seed {seed}: {config} ...", file=sys.stderr, flush=True)
                runs.append(run(config, seed, args, Path(folder)))
                print("  " + json.dumps(runs[-1]), file=sys.stderr, flush=True)
    rows = summarise(runs, configs)
    print(f"Routing on two real vLLM replicas ({os.cpu_count()} cores): {args.requests} "
          f"requests a run, "
          + (f"{args.rate:g} a second (open loop)" if args.rate else
             f"{args.concurrency} at a time") + f", seeds {args.seeds}; "
          + ", ".join(f"{name} {v}" for name, v in versions.items() if v and name in configs))
    print(render(rows))
    for config in configs if args.trace else ():
        kinds: Counter[str] = Counter()
        ttfts: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for r in runs:
            if r["config"] == config:
                kinds.update(r["requests_by_kind"])
                for kind, values in r["ttft_ms_by_kind"].items():
                    ttfts[kind] += values
        print(f"{config:<15} requests by what their replica held: "
              + ", ".join(f"{kind} {n}" for kind, n in kinds.items()))
        print(f"{config:<15} their TTFT p50 / p99 ms: " + ", ".join(
            f"{kind} {loadgen.percentile(v, 50):.0f} / {loadgen.percentile(v, 99):.0f}"
            for kind, v in ttfts.items() if v))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
