"""What any scheduler could do at the overload benchmark's twice the capacity (issue 31): a
discrete-event model of its pool and mixes, no servers, in seconds. Pure, so a target can be
checked against what is possible before the gateway is blamed for missing it.

    python -m loadtests.tier_bound [--mix lower|paid] [--seconds 4000] [--runs 5]
        [--schedulers strict,preempt]

The pool is loadtests.overload's: 5 slots (batches of 1 and 4), each request held for the
simulators' time (0.2 s to its first token, 32 tokens at 40 a second: 1 s), Poisson arrivals
at the mix's rates (its shares of the 2x load, a quarter of them at half load), the shipped
tiers' priorities and longest waits. Two schedulers, both ideal (no round trip, no engine):

    strict    the best order that never stops a running request: a free slot goes to the
              highest tier waiting (first come within a tier); a request whose wait reaches
              its tier's longest is refused. The dispatcher's rule.
    preempt   strict, and an arrival that finds every slot taken stops the most recently
              started request of the lowest tier below its own, which waits again at the
              head of its tier and later resumes where it stopped (no work lost: more than
              any engine or gateway can do today; vLLM's priority policy preempts only when
              KV blocks run out, vllm-project/vllm#40004)

Reported per scheduler: Max's and Pro's p99 time to first token at half and twice the load
and their ratio (the targets: Max <= 1.5 x, Pro <= 3 x), as the median and range over `--runs`
seeds, and the slots' use at 2x. Phases as long as the benchmark's (`--seconds 40`) show how
much a p99 of a few dozen requests scatters.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loadtests.overload import BATCHES, CAPACITY, MIXES, TIERS, TOKENS, TOKENS_PER_S, TTFT_MS, p99

SLOTS = sum(BATCHES)
FIRST_S = TTFT_MS / 1000
SERVICE_S = FIRST_S + TOKENS / TOKENS_PER_S
SCHEDULERS = ("strict", "preempt")
PRIORITY = {name: priority for name, priority, _ in TIERS}
LONGEST_S = {name: float(wait) for name, _, wait in TIERS}


@dataclass
class _Job:
    tier: str
    arrived: float
    left_s: float = SERVICE_S  # service still to run
    started: float | None = None  # when it first ran (its first token FIRST_S later)
    running_since: float = 0.0
    version: int = 0  # bumped when stopped: its scheduled end no longer stands


@dataclass
class Outcome:
    ttfts: dict[str, list[float]] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    busy_s: float = 0.0
    seconds: float = 0.0  # from the start until the last request ended

    @property
    def use(self) -> float:
        return self.busy_s / (SLOTS * self.seconds)


def tier_rates(mix: Mapping[str, tuple[str, float]], load: float) -> dict[str, float]:
    """Requests/s per tier at `load` times the capacity (the mix's shares are of 2x)."""
    rates: dict[str, float] = {}
    for tier, share in mix.values():
        rates[tier] = rates.get(tier, 0.0) + share * CAPACITY * load / 2.0
    return rates


def simulate(rates: Mapping[str, float], seconds: float, seed: int, scheduler: str) -> Outcome:
    """One phase of Poisson arrivals at `rates` (tier -> requests/s) for `seconds`."""
    rng = random.Random(seed)
    # (time, 0 an end / 1 an arrival, order, the job's version then, job)
    events: list[tuple[float, int, int, int, _Job]] = []
    order = 0
    for tier, rate in sorted(rates.items()):
        at = rng.expovariate(rate)
        while at < seconds:
            events.append((at, 1, order, 0, _Job(tier, at)))
            order += 1
            at += rng.expovariate(rate)
    heapq.heapify(events)
    queues: dict[str, deque[_Job]] = {tier: deque() for tier in rates}
    tiers = sorted(rates, key=lambda t: -PRIORITY[t])
    running: list[_Job] = []
    out = Outcome({t: [] for t in rates}, {t: 0 for t in rates}, seconds=seconds)

    def run(job: _Job, now: float) -> None:
        nonlocal order
        if job.started is None:
            job.started = now
            out.ttfts[job.tier].append(now - job.arrived + FIRST_S)
        job.running_since = now
        running.append(job)
        heapq.heappush(events, (now + job.left_s, 0, order, job.version, job))
        order += 1

    def fill(now: float) -> None:
        while len(running) < SLOTS:
            job = None
            for tier in tiers:
                queue = queues[tier]
                while queue and queue[0].started is None and now - queue[0].arrived > \
                        LONGEST_S[tier]:
                    queue.popleft()
                    out.refused[tier] += 1
                if queue:
                    job = queue.popleft()
                    break
            if job is None:
                return
            run(job, now)

    while events:
        now, kind, _, version, job = heapq.heappop(events)
        if kind == 0:
            if version != job.version:
                continue  # an end scheduled before the job was stopped
            running.remove(job)
            out.busy_s += job.left_s
            out.seconds = max(out.seconds, now)  # a backlog drained after the arrivals stop
        else:
            queues[job.tier].append(job)
            if scheduler == "preempt" and len(running) == SLOTS:
                below = [r for r in running if PRIORITY[r.tier] < PRIORITY[job.tier]]
                if below:
                    victim = min(below, key=lambda r: (PRIORITY[r.tier], -r.running_since))
                    running.remove(victim)
                    victim.version += 1
                    ran = now - victim.running_since
                    out.busy_s += ran
                    victim.left_s -= ran
                    queues[victim.tier].appendleft(victim)
        fill(now)
    return out


@dataclass(frozen=True)
class Ratios:
    max_half: float
    max_over: float
    pro_half: float
    pro_over: float
    use: float

    @property
    def max_ratio(self) -> float:
        return self.max_over / self.max_half

    @property
    def pro_ratio(self) -> float:
        return self.pro_over / self.pro_half


def ratios(mix: Mapping[str, tuple[str, float]], seconds: float, seed: int,
           scheduler: str) -> Ratios:
    """Max's and Pro's p99 first token at half and twice the load, one seed."""
    half = simulate(tier_rates(mix, 0.5), seconds, seed, scheduler)
    over = simulate(tier_rates(mix, 2.0), seconds, seed + 10_000, scheduler)
    return Ratios(p99(half.ttfts["max"]), p99(over.ttfts["max"]), p99(half.ttfts["pro"]),
                  p99(over.ttfts["pro"]), over.use)


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.tier_bound",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--mix", choices=sorted(MIXES), default="lower")
    parser.add_argument("--seconds", type=float, default=4000.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    args = parser.parse_args(argv)
    schedulers = args.schedulers.split(",")
    if args.runs < 1 or args.seconds <= 0 or not set(schedulers) <= set(SCHEDULERS):
        parser.error(f"--runs >= 1, --seconds > 0, --schedulers of {','.join(SCHEDULERS)}")
    print(f"mix {args.mix}, {args.runs} runs of {args.seconds:g} s per phase; "
          "median (min-max) over the runs")
    print(f"{'scheduler':<10}{'Max p99 half / 2x s':>22}{'Max ratio':>20}"
          f"{'Pro p99 half / 2x s':>22}{'Pro ratio':>20}{'slots used':>12}")
    for scheduler in schedulers:
        runs = [ratios(MIXES[args.mix], args.seconds, args.seed + i, scheduler)
                for i in range(args.runs)]
        max_p99 = (f"{statistics.median(r.max_half for r in runs):.2f} / "
                   f"{statistics.median(r.max_over for r in runs):.2f}")
        pro_p99 = (f"{statistics.median(r.pro_half for r in runs):.2f} / "
                   f"{statistics.median(r.pro_over for r in runs):.2f}")
        print(f"{scheduler:<10}{max_p99:>22}{_spread([r.max_ratio for r in runs]):>20}"
              f"{pro_p99:>22}{_spread([r.pro_ratio for r in runs]):>20}"
              f"{statistics.median(r.use for r in runs):>12.3f}")


if __name__ == "__main__":
    main()
