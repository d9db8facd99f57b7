"""Placement replay (issue 31): prefix-placement rules on one request sequence, against a
model of vLLM's prefix cache, without engines. Pure and fast, so rules can be compared on the
same sequence without the noise of two real engines.

    python -m loadtests.placement [--seeds 1,2,3] [--requests 240] [--concurrency 6]
        [--rules gateway,sglang] [--blocks 128] [--replicas 2]

The sequence is `loadtests.real_routing`'s (Zipf-drawn system prompts of ~410 tokens, a short
question each). Each rule places it, in order, over `--replicas` replicas whose caches are
the simulators' model of vLLM's (proxy.simulators.kvcache: blocks of 32 tokens, `--blocks` of
them, LRU, a request's last blocks evicted first, running requests' blocks never evicted).
`--concurrency` requests run at once: each ends when the one that many places after it is
sent (a closed loop that ends in order). Reported per rule, as `real_routing --trace` sorts
real requests: `first` (no replica was sent its system prompt before), `elsewhere` (this one
was not, another was), `evicted` (this one was, and found less than half of it cached),
`hit`, and the token hit rate (the engines' `prefix_cache_hits / queries`).

Rules:
    gateway   the gateway's own: proxy.upstream.prefixes' index (told each request's usage, as
              the engines tell it) and proxy.upstream.routing.by_first_token, over replicas
              of 4 slots with the replay's requests in flight, no measured speed, no backlog
    sglang    sglang-router's cache_aware (its tree never evicts in runs this short): the
              replica that was sent the longest prefix, when it covers 30 % of the text; else
              the replica whose tree holds the fewest characters (every text it was sent,
              shared beginnings once)

What it leaves out: time. Engines here never queue, prefill or slow down, so a rule that
trades cache for load (the gateway's) is judged on the cache alone; the real-engine benchmark
judges the rest (loadtests/README.md, "Routing on real vLLM").
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtests.real_routing import kind, workload
from proxy.simulators.kvcache import BlockPool, block_hashes, hittable_blocks
from proxy.upstream.prefixes import PrefixIndex, Prompt, prompt_of
from proxy.upstream.routing import by_first_token

BLOCK_TOKENS = 32
TOKENS_PER_CHAR = 0.76  # the tiny model's tokenizer on hex words: ~410 tokens for 540 chars
TEMPLATE_TOKENS = 12  # the chat template's own tokens around the two messages
OUTPUT_TOKENS = 4  # real_routing's max_tokens
PREFILL_S_PER_TOKEN = 0.001


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the sequence, as the replay needs it."""

    system: str
    question: str
    prompt: Prompt  # as the gateway's index names it

    @property
    def tokens(self) -> list[str]:
        """Its prompt in stand-in tokens: the system prompt's are the same wherever it recurs,
        the question's its own."""
        system = round(len(self.system) * TOKENS_PER_CHAR)
        question = round(len(self.question) * TOKENS_PER_CHAR) + TEMPLATE_TOKENS
        key = self.system[:16]
        return ([f"s{key}.{i}" for i in range(system)]
                + [f"q{self.question}.{i}" for i in range(question)])


def request(system: str, question: str) -> Request:
    prompt = prompt_of({"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": question}]})
    assert prompt is not None
    return Request(system, question, prompt)


def requests(seed: int, count: int) -> list[Request]:
    return [request(c[0]["content"], c[1]["content"]) for c in workload(seed, count)]


class Engine:
    """One replica's prefix cache, as vLLM keeps it (the simulators' BlockPool)."""

    def __init__(self, blocks: int) -> None:
        self.pool = BlockPool(blocks)
        self.running: dict[int, tuple[list[bytes], int]] = {}  # request -> its blocks

    def start(self, number: int, tokens: Sequence[str]) -> int:
        """Run a request: the prompt tokens it found cached."""
        hashes = block_hashes(tokens, BLOCK_TOKENS, hittable_blocks(len(tokens), BLOCK_TOKENS))
        private = -(-(len(tokens) + OUTPUT_TOKENS) // BLOCK_TOKENS) - len(hashes)
        # As the simulators' scheduler: its cached beginning first, then room for the rest.
        hit = self.pool.acquire(hashes)
        self.running[number] = (hashes, private)
        self.pool.forget(sum(p for _, p in self.running.values()))
        return hit * BLOCK_TOKENS

    def end(self, number: int) -> None:
        hashes, _ = self.running.pop(number)
        self.pool.release(hashes)


@dataclass
class Replica:
    """A replica as the gateway's pick sees it (proxy.upstream.routing.Replica)."""

    name: str
    batch: int
    outstanding: int = 0
    weight: int = 1
    service_s: float | None = None

    def local_score(self) -> float:
        return float(self.outstanding)

    def engine_load(self, weights: object, now: float) -> float | None:
        return None

    def in_flight(self, now: float) -> float:
        return float(self.outstanding)

    def load(self, now: float) -> None:
        return None


@dataclass
class Placer:
    """A rule's state over one sequence: `place` picks a replica for a request."""

    replicas: list[Replica]
    rule: str
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    index: PrefixIndex = field(default_factory=lambda: PrefixIndex(128 * BLOCK_TOKENS))
    chars: Counter[str] = field(default_factory=Counter)  # sglang: each tree's characters
    texts: dict[str, set[str]] = field(default_factory=dict)  # sglang: systems per replica

    def place(self, request: Request, clock: float) -> Replica:
        prompt = request.prompt
        chosen = self._sglang(request) if self.rule == "sglang" else self._gateway(prompt, clock)
        self.index.expect(chosen.name, prompt, self.index.matched(chosen.name, prompt))
        self.index.add(chosen.name, prompt.blocks, clock)
        return chosen

    def learn(self, replica: Replica, prompt: Prompt, tokens: int, cached: int) -> None:
        """The engine's usage for a request placed on `replica` (proxy.families.chat)."""
        self.index.learn(prompt.chars, tokens)
        self.index.confirm(replica.name, prompt, cached)

    def _gateway(self, prompt: Prompt, clock: float) -> Replica:
        names = [r.name for r in self.replicas]
        for name in names:
            self.index.resize(name, None)
        view = self.index.prompt_view(prompt, names, [0.0] * len(names), clock)
        return by_first_token(self.replicas, view, PREFILL_S_PER_TOKEN, clock, self.rng).order[0]

    def _sglang(self, request: Request) -> Replica:
        text = request.system + request.question
        holders = [r for r in self.replicas if request.system in self.texts.get(r.name, ())]
        if holders and len(request.system) >= 0.3 * len(text):
            chosen = holders[0]
        else:
            chosen = min(self.replicas, key=lambda r: (self.chars[r.name], self.rng.random()))
        sent = self.texts.setdefault(chosen.name, set())
        self.chars[chosen.name] += len(request.question) + (
            0 if request.system in sent else len(request.system))
        sent.add(request.system)
        return chosen


def replay(sequence: Sequence[Request], rule: str, *, replicas: int = 2, blocks: int = 128,
           batch: int = 4, concurrency: int = 6) -> Counter[str]:
    """Place `sequence` by `rule`; what each request found (as `real_routing --trace` sorts
    them) and the prompt tokens queried and found cached."""
    placer = Placer([Replica(f"r{i}", batch) for i in range(replicas)], rule)
    engines = {r.name: Engine(blocks) for r in placer.replicas}
    where: dict[int, Replica] = {}
    sent: dict[str, set[str]] = {}
    out: Counter[str] = Counter()
    for number, request in enumerate(sequence):
        if number >= concurrency:
            done = number - concurrency
            where[done].outstanding -= 1
            engines[where[done].name].end(done)
        clock = float(number)
        chosen = placer.place(request, clock)
        where[number] = chosen
        chosen.outstanding += 1
        tokens = request.tokens
        hit = engines[chosen.name].start(number, tokens)
        placer.learn(chosen, request.prompt, len(tokens), hit)
        holders = sent.setdefault(request.system, set())
        out[kind(holders, chosen.name, hit, len(tokens))] += 1
        holders.add(chosen.name)
        out["queried"] += len(tokens)
        out["found"] += hit
    return out


RULES = ("gateway", "sglang")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.placement",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--rules", default=",".join(RULES))
    args = parser.parse_args(argv)
    unknown = set(args.rules.split(",")) - set(RULES)
    if unknown:
        parser.error(f"unknown rules {sorted(unknown)}: choose from {', '.join(RULES)}")
    print(f"{'rule':<10} {'first':>6} {'elsewhere':>9} {'evicted':>8} {'hit':>5} {'hit rate':>9}")
    for rule in args.rules.split(","):
        total: Counter[str] = Counter()
        for seed in (int(s) for s in args.seeds.split(",")):
            total += replay(requests(seed, args.requests), rule, replicas=args.replicas,
                            blocks=args.blocks, concurrency=args.concurrency)
        print(f"{rule:<10} {total['first']:>6} {total['elsewhere']:>9} {total['evicted']:>8} "
              f"{total['hit']:>5} {total['found'] / total['queried']:>9.1%}")


if __name__ == "__main__":
    main()
