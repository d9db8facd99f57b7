"""Routing benchmark (issue 17, part 5; issue 31): the three chat picks on an uneven pool of
engines, beside two Rust serving routers (vllm-router, sglang-router) when they are installed.

    python -m loadtests.routing [--duration 45] [--json PATH] [--strict] [--quick]
        [--workload starts|sessions] [--runs N] [--routers] [--engine-queue N]

For each pick (p2c, engine, prefix), one run starts three fresh vLLM simulators that behave
like engines (a running batch of 8, a prefill cost per uncached prompt token, paced tokens, a KV
cache that holds a few system prompts; the third replica three times slower), so every pick
starts with cold caches, and a gateway with two workers routing by that pick. It then streams
chat requests at about 80 % of the pool's capacity, open loop (Poisson arrivals, the same seeded
schedule and bodies for every pick), drawn from 20 shared system prompts with varied user turns,
and reads the simulators' own /metrics before and after.

Per pick: time to first token (first content event, from the scheduled start) p50/p99,
completed requests/s, errors, prefix-cache hit rate (tokens, over all three replicas), and the
load per replica (completed requests, and requests in flight sampled every 0.25 s). Judged
against the issue's targets: `engine` p99 TTFT <= 0.6 x `p2c`'s, `prefix` hit rate >= 3 x
`p2c`'s, and (issue 31) `prefix` ahead of both routers: TTFT p50 and p99 no higher, prefix-cache
hit rate no lower, and its runs' p99s within 1.3 x of each other (loadtests/README.md).

The configs `vllm-router` and `sglang-router` (loadtests/routers.py) put that router, with its
cache-aware policy, in place of the gateway, on fresh simulators and the same schedule; they
run when installed (`pip install -e '.[routers]'`) and are skipped with a line saying so
otherwise (`--routers` makes a missing one an error). `--workload sessions` sends multi-turn
sessions instead of the 20 shared starts; `--runs N` repeats every config N times and reports
the mean and the min-max of each headline figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import random
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests import loadgen, procs, routers
from loadtests.bench import run_async
from loadtests.clock import Clock
from loadtests.servers import (
    Backend,
    Server,
    ServerFailed,
    create_keys,
    free_port,
    gateway_args,
    gateway_worker_pids,
    wait_ready,
    write_gateway_config,
)
from proxy.config import RoutingSection
from proxy.simulators.textgen import VOCAB, prompt_tokens
from proxy.upstream.routing import Weights

PICKS = ("p2c", "engine", "prefix")  # the gateway's
# "prefix" told what the engines evict by their KV-cache events (kv_events in backends.toml;
# the simulators publish them as vLLM does): run when named in --picks.
EVENTS = "prefix-events"
# "prefix" at its configured prefill price (`learn_prefill = false`), not the engines' fitted one.
FIXED = "prefix-fixed"
DEFAULT_CONFIGS = (*PICKS, *routers.ROUTERS)  # and the Rust routers (issue 31)
CONFIGS = (*DEFAULT_CONFIGS, EVENTS, FIXED)
WORKLOADS = ("starts", "sessions")
# The figures --runs N reports as mean and min-max.
SPREAD = ("ttft_p50_ms", "ttft_p99_ms", "latency_p99_ms", "completed_per_s",
          "prefix_cache_hit_rate", "capacity_load_max_over_mean", "completed_max_over_mean",
          "in_flight_max_over_mean", "lag_p99_ms")
MODEL = "acme/small-chat"
CHAT_PATH = "/v2/compat/v1/chat/completions"
WORKERS = 2
KEYS = 40
CREDITS_PER_ACCOUNT = 1000
MAX_TOKENS = 64  # the simulators stop at --completion-tokens, well before it
SAMPLE_S = 0.25  # the in-flight sampling interval (the gateway's own scrape interval)
# The targets.
TTFT_RATIO_MAX = 0.6
P99_SPREAD_MAX = 1.3  # no run's p99 above this x another run's
DEFAULT_ROUTING = RoutingSection()  # the score's weights, as shipped


@dataclass(frozen=True)
class Engines:
    """The simulators' settings (`python -m proxy simulate vllm ...`)."""

    max_num_seqs: int = 8
    prefill_ms_per_1k_tokens: float = 60.0
    tokens_per_s: float = 100.0
    ttft_ms: float = 20.0
    completion_tokens: int = 32
    kv_cache_blocks: int = 512
    block_size: int = 16
    speeds: tuple[float, ...] = (1.0, 1.0, 0.33)

    def args(self, port: int, speed: float, events_port: int | None = None) -> list[str]:
        events = ["--kv-events-config", orjson.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}"}).decode()] if events_port else []
        return [
            sys.executable, "-m", "proxy", "simulate", "vllm", "--host", "127.0.0.1",
            "--port", str(port), "--model", MODEL, "--max-num-seqs", str(self.max_num_seqs),
            "--prefill-ms-per-1k-tokens", f"{self.prefill_ms_per_1k_tokens:g}",
            "--tokens-per-s", f"{self.tokens_per_s:g}", "--ttft-ms", f"{self.ttft_ms:g}",
            "--completion-tokens", str(self.completion_tokens),
            "--kv-cache-blocks", str(self.kv_cache_blocks),
            "--block-size", str(self.block_size), "--speed", f"{speed:g}",
            "--enable-prompt-tokens-details",  # what it found cached, in each answer's usage
            *events,
        ]

    def capacity(self, speed: float, uncached_tokens: float) -> float:
        """Requests/s one replica completes when each needs `uncached_tokens` prefilled: the
        batch's slots over the time a request holds one, or the prefill lane (prefills run one
        at a time), whichever binds first."""
        prefill = uncached_tokens * self.prefill_ms_per_1k_tokens / 1e6 / speed
        decode = (self.completion_tokens - 1) / self.tokens_per_s / speed if (
            self.tokens_per_s > 0) else 0.0
        held = prefill + self.ttft_ms / 1000 / speed + decode
        slots = self.max_num_seqs / held if held > 0 else math.inf
        return min(slots, 1 / prefill) if prefill > 0 else slots


@dataclass(frozen=True)
class Workload:
    """20 conversation starts, each a system prompt, a first user turn and the assistant's
    reply, shared by every request drawn from it; each request adds its own last user turn.

    The gateway's prefix key is the system prompt plus the *first* user turn, so the shared
    part includes one (a task statement, as many applications send): with `single_turn` the
    varied question is the first user turn, every request has a key of its own, and `prefix`
    cannot keep a system prompt on one replica (a variant; the default is what is reported)."""

    prompts: int = 20
    system_tokens: int = 1200
    context_tokens: int = 100
    question_tokens: tuple[int, int] = (20, 100)
    single_turn: bool = False
    seed: int = 17

    def starts(self) -> list[list[dict[str, str]]]:
        rng = random.Random(self.seed)
        out = []
        for i in range(self.prompts):
            # A distinct first block: no two system prompts share a cached block.
            system = f"You are assistant number {i} of the help desk. " + _text(
                rng, self.system_tokens - 11)
            messages = [{"role": "system", "content": system}]
            if not self.single_turn:
                messages += [
                    {"role": "user", "content": f"Task {i}: " + _text(rng,
                                                                        self.context_tokens - 3)},
                    {"role": "assistant", "content": "Understood. Send me the question."},
                ]
            out.append(messages)
        return out

    def shared_tokens(self) -> int:
        """Prompt tokens a request shares with others of its start (as the simulator counts)."""
        return sum(prompt_tokens(s) for s in self.starts()) // self.prompts


@dataclass(frozen=True)
class Sessions:
    """Multi-turn sessions (`--workload sessions`): each session draws its system prompt from
    `prompts` of them by a Zipf law (the i-th most popular with weight 1 / i**zipf) and sends
    `turns` requests; each turn repeats the conversation so far (the system prompt, the earlier
    user turns and a fixed reply to each) and adds a new user turn. Sessions arrive Poisson and
    each turn follows the previous one after an exponential think time, open loop: a turn is sent
    when due, whether or not the previous one was answered (so the reply in the history is the
    client's own text, not what the engine generated, as a client that edits its history)."""

    prompts: int = 20
    zipf: float = 1.0
    system_tokens: int = 1200
    turns: tuple[int, int] = (2, 6)
    question_tokens: tuple[int, int] = (20, 100)
    reply_tokens: int = 32
    think_s: float = 2.0
    seed: int = 17

    def systems(self) -> list[dict[str, str]]:
        rng = random.Random(self.seed)
        return [{"role": "system", "content": f"You are assistant number {i} of the help desk. "
                 + _text(rng, self.system_tokens - 11)} for i in range(self.prompts)]

    def popularity(self) -> list[float]:
        return [1 / (i + 1) ** self.zipf for i in range(self.prompts)]

    def shared_tokens(self) -> int:
        """Prompt tokens every request of a system prompt shares (the system prompt alone)."""
        return sum(prompt_tokens([s]) for s in self.systems()) // self.prompts

    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2


def plan_sessions(workload: Sessions, rate: float, duration_s: float, seed: int
                  ) -> list[Planned]:
    """Sessions arriving Poisson at `rate` / mean turns, so that turns come at about `rate`;
    every turn due before `duration_s`, in time order."""
    rng = random.Random(seed)
    systems, weights = workload.systems(), workload.popularity()
    out: list[Planned] = []
    at = rng.expovariate(rate / workload.mean_turns())
    while at < duration_s:
        messages = [rng.choices(systems, weights)[0]]
        due = at
        for turn in range(rng.randint(*workload.turns)):
            if turn:
                messages.append({"role": "assistant",
                                 "content": _text(rng, workload.reply_tokens)})
                due += rng.expovariate(1 / workload.think_s)
            low, high = workload.question_tokens
            messages.append({"role": "user", "content": _text(rng, rng.randint(low, high))})
            if due < duration_s:
                out.append(_planned(due, messages))
        at += rng.expovariate(rate / workload.mean_turns())
    out.sort(key=lambda p: p.offset_s)
    return out


def _planned(offset_s: float, messages: list[dict[str, str]]) -> Planned:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    return Planned(offset_s, orjson.dumps(body), prompt_tokens(messages))


def plan_any(workload: Workload | Sessions, rate: float, duration_s: float, seed: int
             ) -> list[Planned]:
    if isinstance(workload, Sessions):
        return plan_sessions(workload, rate, duration_s, seed)
    return plan(workload, rate, duration_s, seed)


@dataclass(frozen=True)
class Planned:
    offset_s: float  # from the schedule's start
    body: bytes
    prompt_tokens: int


def _text(rng: random.Random, tokens: int) -> str:
    """`tokens` tokens as the simulator counts them: words and full stops."""
    words: list[str] = []
    count = 0
    while count < tokens:
        sentence = [rng.choice(VOCAB) for _ in range(min(11, max(1, tokens - count - 1)))]
        words.append(" ".join(sentence) + ".")
        count += len(sentence) + 1
    return " ".join(words)


def plan(workload: Workload, rate: float, duration_s: float, seed: int) -> list[Planned]:
    """Poisson arrivals at `rate` for `duration_s`, each drawing a start and a new question."""
    rng = random.Random(seed)
    starts = workload.starts()
    out: list[Planned] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        start = starts[rng.randrange(len(starts))]
        low, high = workload.question_tokens
        question = {"role": "user", "content": _text(rng, rng.randint(low, high))}
        messages = [*start, question]
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}}
        out.append(Planned(at, orjson.dumps(body), prompt_tokens(messages)))
        at += rng.expovariate(rate)
    return out


# --- the engines' own figures -------------------------------------------------------------


COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:request_success_total")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {family: sum of its samples over all labels} for the names used."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS or name in GAUGES:
            with contextlib.suppress(ValueError, IndexError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


HOLDER_WAITS = "igw_prefix_holder_waits_total"  # the gateway's, by `outcome`


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Prometheus text -> {value of `label`: sum of the samples of `name` with it}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, float]]:
    async def one(url: str) -> dict[str, float]:
        try:
            async with session.get(url + "/metrics") as resp:
                return parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError) as exc:  # every figure would be wrong
            raise ServerFailed(f"could not read {url}/metrics: {exc!r}") from exc

    return list(await asyncio.gather(*(one(u) for u in urls)))


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def engine_score(figures: dict[str, float], routing: RoutingSection = DEFAULT_ROUTING) -> float:
    """The gateway's `engine` load score (proxy.upstream.pool.Backend.engine_load) from one
    read of /metrics, without the requests a worker sent since its last read."""
    return Weights.of(routing).score(figures.get("vllm:num_requests_waiting", 0.0),
                                     figures.get("vllm:num_requests_running", 0.0),
                                     figures.get("vllm:kv_cache_usage_perc"), 0.0)


# --- one pick -----------------------------------------------------------------------------


@dataclass
class PickRun:
    pick: str
    tally: loadgen.Tally = field(default_factory=loadgen.Tally)
    window_s: float = 0.0
    before: list[dict[str, float]] = field(default_factory=list)
    after: list[dict[str, float]] = field(default_factory=list)
    in_flight: list[list[float]] = field(default_factory=list)  # per sample, per replica
    scores: list[list[float]] = field(default_factory=list)  # the gateway's engine load score
    window_wall: tuple[float, float] = (math.nan, math.nan)  # time.time() at open and close
    first_token_ms: dict[str, list[float]] = field(default_factory=dict)  # backend -> TTFTs
    busy_pct: dict[str, float] = field(default_factory=dict)  # core -> % busy, whoever used it
    load_average: tuple[float, float] = (math.nan, math.nan)
    # Requests that waited for a busy replica holding their prompt, by how that ended
    # (the gateway's igw_prefix_holder_waits_total, warm-up included); none for a router.
    holder_waits: dict[str, float] = field(default_factory=dict)
    # The prefill price per replica the gateway fitted from its engine's figures by the end
    # (igw_engine_prefill_ms_per_1k_tokens, the worker that answered); none for a router.
    prefill_ms: dict[str, float] = field(default_factory=dict)

    def read_gateway_metrics(self, metrics_text: str) -> None:
        self.holder_waits = by_label(metrics_text, HOLDER_WAITS, "outcome")
        self.prefill_ms = by_label(metrics_text, "igw_engine_prefill_ms_per_1k_tokens", "backend")

    def read_access_log(self, path: Path) -> None:
        """The gateway's own view, per backend: each counted request's time to first content
        (its access log's `first_byte_ms`), for requests that ended in the counted window."""
        opened, closed = self.window_wall
        with contextlib.suppress(OSError), path.open("rb") as lines:
            for line in lines:
                if not line.startswith(b"{") or b'"first_byte_ms"' not in line:
                    continue
                with contextlib.suppress(orjson.JSONDecodeError):
                    doc = orjson.loads(line)
                    if opened <= doc.get("ts", 0) <= closed and "backend" in doc:
                        self.first_token_ms.setdefault(doc["backend"], []).append(
                            float(doc["first_byte_ms"]))

    def summary(self, offered: float, speeds: Sequence[float]) -> dict[str, Any]:
        t = self.tally
        ttft = [sorted(self.first_token_ms.get(replica_name(i), [])) for i in range(len(speeds))]
        completed = [delta(a, b, "vllm:request_success_total")
                     for a, b in zip(self.after, self.before, strict=True)]
        hits = [delta(a, b, "vllm:prefix_cache_hits_total")
                for a, b in zip(self.after, self.before, strict=True)]
        queries = [delta(a, b, "vllm:prefix_cache_queries_total")
                   for a, b in zip(self.after, self.before, strict=True)]
        flight = [sum(s[i] for s in self.in_flight) / len(self.in_flight)
                  if self.in_flight else math.nan for i in range(len(speeds))]
        window = self.window_s or math.nan
        return {
            "offered_per_s": offered,
            "requests": len(t.ttfts_s),
            "errors": sum(t.errors.values()),
            "error_kinds": dict(t.errors),
            "completed_per_s": sum(completed) / window,
            "ttft_p50_ms": loadgen.percentile(t.ttfts_s, 50) * 1000,
            "ttft_p99_ms": loadgen.percentile(t.ttfts_s, 99) * 1000,
            "latency_p50_ms": loadgen.percentile(t.latencies_s, 50) * 1000,
            "latency_p99_ms": loadgen.percentile(t.latencies_s, 99) * 1000,
            "prefix_cache_hit_rate": sum(hits) / sum(queries) if sum(queries) else math.nan,
            "replicas": [{"speed": s, "completed": c, "in_flight_mean": f,
                          "hit_rate": h / q if q else math.nan,
                          "gateway_ttft_p50_ms": loadgen.percentile(g, 50),
                          "gateway_ttft_p99_ms": loadgen.percentile(g, 99),
                          "gateway_requests": len(g)}
                         for s, c, f, h, q, g in zip(speeds, completed, flight, hits, queries,
                                                     ttft, strict=True)],
            "completed_max_over_mean": _max_over_mean(completed),
            # Per unit of capacity (a replica's capacity is proportional to its speed): the
            # busiest replica's load per unit of capacity over the pool's (all completed over
            # all capacity), the mean the gateway's bound compares with. (An unweighted mean of
            # the three ratios would count the slow replica's as much as a fast one's.)
            "capacity_load_max_over_mean": (
                max(c / s for c, s in zip(completed, speeds, strict=True))
                / (sum(completed) / sum(speeds)) if sum(completed) > 0 else math.nan),
            "in_flight_max_over_mean": _max_over_mean(flight),
            "lag_p99_ms": loadgen.percentile(t.lags_s, 99) * 1000,
            "window_s": self.window_s,
            "core_busy_pct": self.busy_pct,
            "load_average_1m": {"before": self.load_average[0], "after": self.load_average[1]},
            "holder_waits": self.holder_waits,
            "learned_prefill_ms_per_1k_tokens": self.prefill_ms,
        }


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else math.nan
    return max(values) / mean if values and mean > 0 else math.nan


def replica_name(index: int) -> str:
    return f"sim-{index}"


def run_pick(pick: str, args: argparse.Namespace, schedule: list[Planned]) -> PickRun:
    """Fresh simulators and a gateway routing by `pick` (or the router `pick` names); the
    schedule sent through it."""
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix=f"gateway-routing-{pick}-")))

        def start(name: str, cmd: list[str]) -> Server:
            server = Server(name, cmd, workdir / f"{name}.log", None)
            stack.callback(server.stop)
            return server

        sims: list[tuple[Server, str]] = []
        events = [free_port() if pick == EVENTS else None for _ in args.engines.speeds]
        for i, speed in enumerate(args.engines.speeds):
            port = free_port()
            sims.append((start(replica_name(i), args.engines.args(port, speed, events[i])),
                         f"http://127.0.0.1:{port}"))
        for server, url in sims:
            wait_ready(f"{url}/health", server=server)
        if pick in routers.ROUTERS:
            router, base = routers.start(pick, [url for _, url in sims], workdir / f"{pick}.log")
            stack.callback(router.stop)
            run = PickRun(pick)
            run_async(drive(run, loadgen.Target(pick, base + routers.CHAT_PATH),
                            [url for _, url in sims], schedule, args.warmup, args.routing))
            if router.popen.poll() is not None:
                raise router.failed(f"exited during the run (code {router.popen.returncode})")
            return run
        port = free_port()
        config = write_gateway_config(
            workdir / "config", port=port,
            backends=[Backend(replica_name(i), "vllm", url, MODEL, args.weights[i],
                              args.engines.max_num_seqs,
                              f"tcp://127.0.0.1:{events[i]}" if events[i] else None)
                      for i, (_, url) in enumerate(sims)],
            # Routing, not the ledger's fsync, is measured: keep the disk off the path.
            ledger_fsync="everysec",
            routing={"pick": "prefix" if pick in (EVENTS, FIXED) else pick,
                     **({"learn_prefill": False} if pick == FIXED else {}), **args.score,
                     **({} if args.engine_queue is None else {"engine_queue": args.engine_queue})})
        gateway = start("gateway", gateway_args(config, port, workers=WORKERS))
        wait_ready(f"http://127.0.0.1:{port}/readyz", server=gateway)
        gateway_worker_pids(gateway.pid, WORKERS)
        keys = tuple(create_keys(config, args.keys, credits_each=CREDITS_PER_ACCOUNT))
        target = loadgen.Target("gateway", f"http://127.0.0.1:{port}{CHAT_PATH}", keys)
        run = PickRun(pick)
        run_async(drive(run, target, [url for _, url in sims], schedule, args.warmup,
                        args.routing))
        if gateway.popen.poll() is not None:
            raise gateway.failed(f"exited during the run (code {gateway.popen.returncode})")
        time.sleep(0.2)  # the access log is written in batches every 0.05 s
        run.read_access_log(gateway.log_path)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            run.read_gateway_metrics(page.read().decode())
        return run


async def drive(run: PickRun, target: loadgen.Target, sims: Sequence[str],
                schedule: list[Planned], warmup_s: float,
                routing: RoutingSection = DEFAULT_ROUTING) -> None:
    """The open loop: requests due in the warm-up are sent but not counted; the engines'
    counters are read as the counted window opens and as its schedule ends."""
    warm = loadgen.Tally()
    tasks: set[asyncio.Task[None]] = set()
    end = schedule[-1].offset_s if schedule else warmup_s
    async with loadgen.new_session(1024) as session, \
            loadgen.new_session(8, aiohttp.ClientTimeout(total=5)) as probe:
        start = time.perf_counter() + 0.05

        async def watch() -> None:
            await asyncio.sleep(max(0.0, start + warmup_s - time.perf_counter()))
            cores = procs.core_times()
            run.load_average = (os.getloadavg()[0], math.nan)
            opened = time.perf_counter()
            run.window_wall = (time.time(), math.nan)
            run.before = await scrape(probe, sims)
            while time.perf_counter() < start + end:
                await asyncio.sleep(SAMPLE_S)
                figures = await scrape(probe, sims)
                run.in_flight.append([f.get("vllm:num_requests_running", 0.0)
                                      + f.get("vllm:num_requests_waiting", 0.0)
                                      for f in figures])
                run.scores.append([engine_score(f, routing) for f in figures])
            run.after = await scrape(probe, sims)
            run.window_s = time.perf_counter() - opened
            run.window_wall = (run.window_wall[0], time.time())
            now = procs.core_times()
            run.busy_pct = {str(c): procs.busy_pct(cores, now, c) for c in sorted(now)}
            run.load_average = (run.load_average[0], os.getloadavg()[0])

        watcher = asyncio.create_task(watch())
        with contextlib.closing(Clock()) as clock:
            for item in schedule:
                due = start + item.offset_s
                await clock.until(due)
                tally = warm if item.offset_s < warmup_s else run.tally
                task = asyncio.create_task(loadgen.stream_once(session, target, item.body,
                                                               tally, due))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        await watcher
        if tasks:
            await asyncio.wait(tasks)
    for reason, count in warm.errors.items():  # not timed, but a failure all the same
        run.tally.errors[f"{reason} (warm-up)"] += count


# --- verdicts and the table ---------------------------------------------------------------


def judge(picks: dict[str, dict[str, Any]], judged: bool) -> list[dict[str, Any]]:
    """The issues' targets, on whichever configs ran; `judged` False: only errors count."""
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float, target: str, met: bool | None) -> None:
        checks.append({"name": name, "value": value, "target": target,
                       "passed": met if judged else None})

    if "engine" in picks and "p2c" in picks:
        ratio = picks["engine"]["ttft_p99_ms"] / picks["p2c"]["ttft_p99_ms"]
        add("engine p99 TTFT / p2c p99 TTFT", ratio, f"<= {TTFT_RATIO_MAX:g}",
            ratio <= TTFT_RATIO_MAX)
    ours = picks.get("prefix")
    for router in (n for n in routers.ROUTERS if n in picks and ours is not None):
        theirs = picks[router]
        assert ours is not None
        for figure, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
            ratio = ours[figure] / theirs[figure]
            add(f"prefix {label} / {router}'s", ratio, "<= 1", ratio <= 1)
        hit = ours["prefix_cache_hit_rate"] - theirs["prefix_cache_hit_rate"]
        add(f"prefix hit rate - {router}'s (points)", 100 * hit, ">= 0", hit >= 0)
    if ours is not None and "spread" in ours:
        p99s = ours["spread"]["ttft_p99_ms"]["values"]
        ratio = max(p99s) / min(p99s) if min(p99s) > 0 else math.inf
        add("prefix: highest run p99 / lowest", ratio, f"<= {P99_SPREAD_MAX:g}",
            ratio <= P99_SPREAD_MAX)
    errors = sum(p["errors"] for p in picks.values())
    checks.append({"name": "failed requests, all picks", "value": errors, "target": "0",
                   "passed": errors == 0})
    return checks


def render(doc: dict[str, Any]) -> str:
    meta, picks = doc["meta"], doc["picks"]
    names = list(picks)
    lines = [f"Routing benchmark: {' vs '.join(names)} on an uneven pool (issues 17, 31)",
             *(f"  {note}" for note in meta["notes"]), ""]
    runs = meta.get("runs", 1)

    def spread(name: str, key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
        s = picks[name].get("spread", {}).get(key)
        if not s:
            return "-"
        return f"{scale * s['min']:{fmt}}-{scale * s['max']:{fmt}}"

    def per_replica(p: dict[str, Any], key: str, fmt: str) -> str:
        return "/".join(format(r[key], fmt) for r in p["replicas"])

    def learned(p: dict[str, Any]) -> str:  # "-": not fitted (yet)
        prices = p.get("learned_prefill_ms_per_1k_tokens", {})
        return "/".join(f"{prices[name]:.0f}" if name in prices else "-"
                        for name in map(replica_name, range(len(p["replicas"]))))

    rows: list[tuple[str, ...]] = [
        ("routed by", *(picks[n]["routed_by"] for n in names)),
        ("requests counted", *(str(picks[n]["requests"]) for n in names)),
        ("errors", *(str(picks[n]["errors"]) for n in names)),
        ("offered req/s", *(f"{picks[n]['offered_per_s']:.1f}" for n in names)),
        ("completed req/s", *(f"{picks[n]['completed_per_s']:.1f}" for n in names)),
        ("TTFT p50 ms", *(f"{picks[n]['ttft_p50_ms']:.0f}" for n in names)),
        ("TTFT p99 ms", *(f"{picks[n]['ttft_p99_ms']:.0f}" for n in names)),
        *([("  p50 min-max", *(spread(n, "ttft_p50_ms") for n in names)),
           ("  p99 min-max", *(spread(n, "ttft_p99_ms") for n in names))] if runs > 1 else []),
        ("whole stream p99 ms", *(f"{picks[n]['latency_p99_ms']:.0f}" for n in names)),
        ("prefix-cache hit rate", *(f"{100 * picks[n]['prefix_cache_hit_rate']:.1f} %"
                                    for n in names)),
        *([("  min-max %", *(spread(n, "prefix_cache_hit_rate", 100, ".1f") for n in names))]
          if runs > 1 else []),
        ("completed per replica", *(per_replica(picks[n], "completed", ".0f") for n in names)),
        ("  max / mean", *(f"{picks[n]['completed_max_over_mean']:.2f}" for n in names)),
        ("  per capacity, max / mean",
         *(f"{picks[n]['capacity_load_max_over_mean']:.2f}" for n in names)),
        *([("    min-max", *(spread(n, "capacity_load_max_over_mean", 1, ".2f")
                             for n in names))] if runs > 1 else []),
        ("in flight per replica, mean", *(per_replica(picks[n], "in_flight_mean", ".1f")
                                          for n in names)),
        ("  max / mean", *(f"{picks[n]['in_flight_max_over_mean']:.2f}" for n in names)),
        ("TTFT p99 per replica ms *", *(per_replica(picks[n], "gateway_ttft_p99_ms", ".0f")
                                        for n in names)),
        ("hit rate per replica %", *("/".join(f"{100 * r['hit_rate']:.0f}"
                                             for r in picks[n]["replicas"]) for n in names)),
        ("waited for a holder: got it / not", *(
            "{:.0f}/{:.0f}".format(*(picks[n]["holder_waits"].get(k, 0.0)
                                     for k in ("holder", "elsewhere")))
            if picks[n]["routed_by"] == "gateway" else "-" for n in names)),
        ("learned prefill ms/1k per replica", *(
            learned(picks[n]) if picks[n]["routed_by"] == "gateway" else "-" for n in names)),
        ("client lag p99 ms", *(f"{picks[n]['lag_p99_ms']:.1f}" for n in names)),
        ("cores busy %", *("/".join(f"{v:.0f}" for v in picks[n]["core_busy_pct"].values())
                           for n in names)),
    ]
    header = ("figure", *names)
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        lines.append("  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    lines.append("  * as the gateway's access log has it (time to first content, per backend; "
                 "from the gateway's receipt, not the client's schedule); none for a router")
    if runs > 1:
        lines.append(f"  figures are means over {runs} runs, min-max below them; requests and "
                     "errors: the sum; per replica, in flight and holder waits: the first run's")
    for note in meta.get("skipped", []):
        lines.append(f"  skipped: {note}")
    lines.append("")
    for check in doc["checks"]:
        verdict = ("-" if check["passed"] is None else "PASS" if check["passed"] else "FAIL")
        value = check["value"]
        shown = str(value) if isinstance(value, int) else f"{value:.2f}"
        lines.append(f"  {verdict:<4}  {check['name']}: {shown} (target {check['target']})")
    for name in names:
        if picks[name]["errors"]:
            kinds = "; ".join(f"{k} x{v}" for k, v in picks[name]["error_kinds"].items())
            lines.append(f"  {name} errors: {kinds}")
    lines.append(f"verdict: {'PASS' if doc['passed'] else 'FAIL'}"
                 + ("" if meta["judged"] else " (quick smoke run: only errors are judged)")
                 + " (exit status is non-zero on FAIL only with --strict)")
    return "\n".join(lines)


# --- the command --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.routing",
        description="p2c vs engine vs prefix routing on an uneven pool of three simulators, "
        "beside vllm-router and sglang-router when installed.")
    p.add_argument("--duration", type=float, help="seconds counted per pick (default 45, or 3 "
                   "with --quick), after --warmup")
    p.add_argument("--warmup", type=float, help="seconds of load sent first and not counted "
                   "(default 8, or 0.5 with --quick)")
    p.add_argument("--load", type=float, default=0.8,
                   help="offered load as a share of the pool's capacity (default 0.8)")
    p.add_argument("--rate", type=float, help="requests/s, instead of --load x capacity")
    p.add_argument("--picks", default=",".join(DEFAULT_CONFIGS), metavar="LIST",
                   help=f"comma-separated configs to run (default {','.join(DEFAULT_CONFIGS)}; "
                   f"a router that is not installed is skipped, unless --routers; {EVENTS}: "
                   f"prefix, told what the engines evict by their KV-cache events; {FIXED}: "
                   "prefix at the configured prefill price, not the engines' fitted one)")
    p.add_argument("--routers", action="store_true",
                   help="require the routers among --picks to be installed (exit 2 if not)")
    p.add_argument("--workload", choices=WORKLOADS, default="starts", dest="workload_name",
                   help="starts: 20 shared conversation starts + a varied question (default); "
                   "sessions: multi-turn sessions over Zipf-drawn system prompts")
    p.add_argument("--zipf", type=float, default=1.0,
                   help="sessions: the system prompts' Zipf exponent (default 1.0)")
    p.add_argument("--runs", type=int, default=1, help="run every config N times (default 1; "
                   "the issue's figures use 3) and report the mean and min-max")
    p.add_argument("--score", default="", metavar="NAME=W,...",
                   help="the engine score's weights given to the gateway, e.g. "
                        "running_weight=0.25,kv_cache_weight=2 (default: as shipped)")
    p.add_argument("--engine-queue", type=int, help="the gateway's [routing] engine_queue "
                   "(default: as shipped, 1)")
    p.add_argument("--kv-cache-blocks", type=int, help="each simulator's KV cache, in blocks "
                   "of 16 tokens (default 512: about five system prompts and a batch)")
    p.add_argument("--single-turn", action="store_true",
                   help="the varied question is the first user turn (no shared task turn): "
                   "shows what `prefix` does when every request has its own key")
    p.add_argument("--weights", default="1,1,1", metavar="W,W,W",
                   help="the backends' `weight` in the gateway's config (default 1,1,1: the "
                   "gateway is not told which replica is slow; 3,3,1 tells it)")
    p.add_argument("--seed", type=int, default=17, help="arrivals and questions (default 17)")
    p.add_argument("--keys", type=int, default=KEYS, help=f"API keys (default {KEYS})")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--quick", action="store_true", help="a smoke test: a few seconds per pick, "
                   "small prompts, fast engines; only errors are judged")
    p.add_argument("--strict", action="store_true", help="exit 1 when any check fails")
    args = p.parse_args(argv)
    args.picks = [k.strip() for k in args.picks.split(",") if k.strip()]
    try:
        args.weights = [int(w) for w in args.weights.split(",")]
    except ValueError:
        p.error("--weights: three whole numbers, e.g. 3,3,1")
    if len(args.weights) != 3 or min(args.weights) < 1:
        p.error("--weights: three whole numbers >= 1, e.g. 3,3,1")
    if not args.picks or set(args.picks) - set(CONFIGS):
        p.error(f"--picks: choose from {', '.join(CONFIGS)}")
    if args.runs < 1 or args.zipf < 0:
        p.error("--runs must be >= 1 and --zipf >= 0")
    names = ("waiting_weight", "running_weight", "kv_cache_weight", "sent_weight")
    try:
        pairs = [item.split("=", 1) for item in args.score.split(",") if item.strip()]
        args.score = {name.strip(): float(value) for name, value in pairs}
    except ValueError:
        p.error("--score: NAME=NUMBER pairs, e.g. running_weight=0.25,kv_cache_weight=2")
    if set(args.score) - set(names) or min(args.score.values(), default=0) < 0:
        p.error(f"--score: weights >= 0 among {', '.join(names)}")
    args.routing = RoutingSection(**args.score)  # the score's weights, as the gateway gets them
    args.duration = args.duration or (3.0 if args.quick else 45.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 8.0)
    if args.quick:
        args.engines = Engines(prefill_ms_per_1k_tokens=20, tokens_per_s=400, ttft_ms=5,
                               completion_tokens=8, kv_cache_blocks=args.kv_cache_blocks or 512)
        args.workload = Workload(system_tokens=120, context_tokens=20, question_tokens=(5, 20),
                                 single_turn=args.single_turn, seed=args.seed)
        sessions = Sessions(zipf=args.zipf, system_tokens=120, turns=(2, 4),
                            question_tokens=(5, 20), reply_tokens=8, think_s=0.3, seed=args.seed)
    else:
        args.engines = Engines(kv_cache_blocks=args.kv_cache_blocks or Engines.kv_cache_blocks)
        args.workload = Workload(single_turn=args.single_turn, seed=args.seed)
        sessions = Sessions(zipf=args.zipf, seed=args.seed)
    if args.workload_name == "sessions":
        if args.single_turn:
            p.error("--single-turn is for --workload starts")
        args.workload = sessions
    if args.duration <= 0 or args.warmup < 0 or not 0 < args.load <= 2 or args.keys < 1:
        p.error("--duration, --load (0-2] and --keys must be positive, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwinds, stopping the servers
    engines, workload = args.engines, args.workload
    sessions = isinstance(workload, Sessions)
    versions = routers.installed()
    configs, skipped = [], []
    for name in args.picks:
        if name in routers.ROUTERS and versions[name] is None:
            line = (f"{name}: not installed (pip install -e '.[routers]', or "
                    f"pip install {name})")
            if args.routers:
                print(f"routing: --routers: {line}", file=sys.stderr)
                return 2
            print(f"routing: skipping {line}", file=sys.stderr, flush=True)
            skipped.append(line)
        else:
            configs.append(name)
    if not configs:
        print("routing: nothing to run", file=sys.stderr)
        return 2
    sample = plan_any(workload, 50.0, 20.0, args.seed)
    prompt = sum(s.prompt_tokens for s in sample) / len(sample)
    shared = workload.shared_tokens()
    cached = (shared // engines.block_size) * engines.block_size  # whole blocks only
    cold = sum(engines.capacity(s, prompt) for s in engines.speeds)
    warm = sum(engines.capacity(s, prompt - cached) for s in engines.speeds)
    # --quick stays light: its engines are fast, and 80 % of them would be CPU-bound here.
    rate = args.rate or (40.0 if args.quick else args.load * cold)
    schedules = [plan_any(workload, rate, args.warmup + args.duration, args.seed + r)
                 for r in range(args.runs)]
    if sessions:
        described = (
            f"workload: multi-turn sessions, system prompts of {shared} prompt tokens drawn "
            f"from {workload.prompts} by Zipf (exponent {workload.zipf:g}); "
            f"{workload.turns[0]}-{workload.turns[1]} turns a session, each repeating the "
            f"conversation so far (replies of {workload.reply_tokens} tokens) plus a user turn "
            f"of {workload.question_tokens[0]}-{workload.question_tokens[1]} tokens, "
            f"{workload.think_s:g} s mean think time; {prompt:.0f} prompt tokens on average")
    else:
        described = (
            f"workload: {workload.prompts} shared conversation starts of {shared} prompt tokens "
            + ("(a system prompt only: the varied question is the first user turn) "
               if workload.single_turn else
               "(system prompt + a task as first user turn + the assistant's reply) ")
            + f"+ a varied user turn of {workload.question_tokens[0]}-"
            f"{workload.question_tokens[1]} tokens; {prompt:.0f} prompt tokens on average; "
            "uniform draw")
    described += f"; seed {args.seed}" + (
        f" (+ the run's index for arrivals and draws: run i uses seed {args.seed} + i)"
        if args.runs > 1 else "")
    notes = [
        f"engines: 3 vLLM simulators, speeds {'/'.join(f'{s:g}' for s in engines.speeds)}; "
        f"--max-num-seqs {engines.max_num_seqs}, --prefill-ms-per-1k-tokens "
        f"{engines.prefill_ms_per_1k_tokens:g}, --ttft-ms {engines.ttft_ms:g}, --tokens-per-s "
        f"{engines.tokens_per_s:g}, --completion-tokens {engines.completion_tokens}, "
        f"--kv-cache-blocks {engines.kv_cache_blocks} (x{engines.block_size} tokens: "
        f"{engines.kv_cache_blocks * engines.block_size // max(1, shared):.0f} shared prefixes' "
        "worth); fresh ones for each config and run (cold caches)",
        described,
        f"capacity from those settings: {cold:.1f} req/s with every prompt a cache miss (per "
        "replica: " + "/".join(f"{engines.capacity(s, prompt):.1f}" for s in engines.speeds)
        + f"), {warm:.1f} with every shared part cached; offered: "
        + (f"{rate:.1f} req/s (--rate)" if args.rate else
           f"{rate:.1f} req/s (--quick)" if args.quick else
           f"{rate:.1f} req/s = {args.load:g} x the all-miss capacity")
        + ", open loop, Poisson arrivals, the same schedule and bodies for every config",
        f"gateway: `serve --workers {WORKERS}`, [routing] pick per column, backend weights "
        f"{'/'.join(map(str, args.weights))}, max_concurrency {engines.max_num_seqs} (the "
        "engines' batch, and one more queued in each: [routing] engine_queue; the "
        "dispatcher holds the rest)"
        + "".join(f", {k} {v:g}" for k, v in args.score.items()) + "; "
        f"{args.keys} API keys of one tier whose limit never binds, no queue_budget; nothing "
        "pinned (the load is light: see cores busy)",
        f"counted: {args.duration:g} s per config after a {args.warmup:g} s warm-up; TTFT = "
        "first content event, from the scheduled start; engine counters (hits, queries, "
        "completed) are deltas over the counted window; in flight = running + waiting, sampled "
        f"every {SAMPLE_S:g} s" + (f"; {args.runs} runs, each config once per run in this "
                                   "order" if args.runs > 1 else ""),
        "`prefix` matches each prompt's leading 256-byte blocks against what the gateway "
        "sent each replica (shared by its workers), and orders replicas by expected time to "
        "first token: the wait for a slot plus prefilling the unmatched part at the replica's "
        "measured speed"
        + ("; sessions carry no X-Session-Id" if sessions else ""),
    ]
    routed = [n for n in configs if n in routers.ROUTERS]
    if routed:
        notes.append(
            "routers: " + ", ".join(f"{n} {versions[n]}" for n in routed) + ", each `python -m "
            "<its launcher> --worker-urls <the 3 simulators> --policy cache_aware` with the "
            "policy's defaults (cache_threshold 0.3, balance thresholds 64 abs / 1.5 rel), "
            "straight to the simulators: no API key, rate limit or credits as the gateway does")
    print(notes[2], file=sys.stderr, flush=True)
    started = time.time()
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in configs}
    try:
        for r, schedule in enumerate(schedules):
            for pick in configs:
                print(f"measuring {pick}" + (f", run {r + 1}/{args.runs}" if args.runs > 1
                                             else "")
                      + f" ({len(schedule)} requests at {rate:.1f}/s) ...",
                      file=sys.stderr, flush=True)
                summary = run_pick(pick, args, schedule).summary(rate, engines.speeds)
                summary["routed_by"] = (f"{pick} {versions[pick]}" if pick in routers.ROUTERS
                                        else "gateway")
                results[pick].append(summary)
    except KeyboardInterrupt:
        print("routing: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    except ServerFailed as exc:
        print(f"routing: {exc}", file=sys.stderr)
        return 2
    runs = {n: combine(results[n]) for n in configs}
    checks = judge(runs, judged=not args.quick)
    doc = {
        "meta": {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "took_s": round(time.time() - started, 1),
            "host": platform.node(), "usable_cores": len(os.sched_getaffinity(0)),
            "command": "python -m loadtests.routing " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "judged": not args.quick, "notes": notes, "engines": asdict(engines),
            "workload_kind": args.workload_name,
            "workload": asdict(workload), "prompt_tokens_mean": prompt,
            "shared_prompt_tokens": shared, "capacity_all_miss_per_s": cold,
            "capacity_all_hit_per_s": warm, "rate_per_s": rate, "load": args.load,
            "weights": args.weights, "score": args.score,
            "duration_s": args.duration,
            "warmup_s": args.warmup, "workers": WORKERS, "keys": args.keys,
            "runs": args.runs, "routers": versions, "skipped": skipped,
        },
        "picks": runs,
        "runs": [{n: results[n][r] for n in configs} for r in range(args.runs)],
        "checks": checks,
        "passed": all(c["passed"] is not False for c in checks),
    }
    print(render(doc))
    if args.json:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 1 if args.strict and not doc["passed"] else 0


def combine(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One config's runs as one summary: the first run's, with the SPREAD figures replaced by
    their mean over the runs (and `spread` giving mean, min, max and the values), the errors
    summed. One run is returned as it is."""
    out = dict(summaries[0])
    if len(summaries) == 1:
        return out
    out["spread"] = {}
    for key in SPREAD:
        values = [s[key] for s in summaries]
        finite = [v for v in values if not math.isnan(v)]
        mean = sum(finite) / len(finite) if finite else math.nan
        out[key] = mean
        out["spread"][key] = {"mean": mean, "min": min(finite, default=math.nan),
                              "max": max(finite, default=math.nan), "values": values}
    out["errors"] = sum(s["errors"] for s in summaries)
    kinds: dict[str, int] = {}
    for s in summaries:
        for kind, count in s["error_kinds"].items():
            kinds[kind] = kinds.get(kind, 0) + count
    out["error_kinds"] = kinds
    out["requests"] = sum(s["requests"] for s in summaries)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
