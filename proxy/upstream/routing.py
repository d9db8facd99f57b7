"""How a pool orders its available replicas for a request, on the engines' own signals. No I/O.

    p2c     two weighted random candidates, fewer requests in flight (this worker's) wins
    engine  of two weighted random candidates, the lower load score: the engine's waiting
            queue, running batch and KV-cache use (as the master last read them) plus the
            requests this worker sent it since that read; P2C on this worker's counts where no
            fresh figures exist
    prefix  by expected time to first token: the wait for a slot on the replica plus the
            prefill of the part of the prompt it does not hold (proxy.upstream.prefixes), at its
            measured speed; so a request goes where its longest prefix is cached unless that
            replica's load costs more than prefilling elsewhere. With the dispatcher the
            request takes the first replica in that order with a free slot, when one frees
            (late binding)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from proxy.config import RoutingSection
    from proxy.upstream.signals import EngineSignals

PickKind = Literal["p2c", "engine", "prefix"]


@dataclass(frozen=True, slots=True)
class Weights:
    """The `engine` score's weights (backends.toml [routing])."""

    waiting: float = 1.0
    running: float = 0.5
    kv_cache: float = 4.0
    sent: float = 1.0

    @classmethod
    def of(cls, routing: RoutingSection) -> Weights:
        return cls(routing.waiting_weight, routing.running_weight, routing.kv_cache_weight,
                   routing.sent_weight)

    def score(self, waiting: float, running: float, kv: float | None, sent: float) -> float:
        """An engine's load in requests ahead of a new one: its queue, its batch, KV-cache
        pressure, and requests sent to it that its figures cannot show yet."""
        return (self.waiting * waiting + self.running * running
                + self.kv_cache * kv_pressure(kv) + self.sent * sent)


KV_KNEE = 0.8  # KV-cache use from which it counts against an engine


def kv_pressure(kv: float | None) -> float:
    """0 up to `KV_KNEE` of the KV cache in use, rising to 1 when it is full. Below the knee
    an engine admits a new request at once, and what its batch costs is already in `running`
    (counted linearly, KV use raised an uneven pool's p99 TTFT: loadtests.routing,
    2026-11-26); near full, new requests wait for blocks and running ones get preempted."""
    if kv is None or kv <= KV_KNEE:
        return 0.0
    return min(1.0, (kv - KV_KNEE) / (1.0 - KV_KNEE))


class Replica(Protocol):
    """What a pick needs of a backend (proxy.upstream.pool.Backend)."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> int: ...
    @property
    def outstanding(self) -> int: ...  # this worker's requests in flight on it
    @property
    def service_s(self) -> float | None: ...  # seconds a request spends in it, measured
    @property
    def batch(self) -> int: ...  # requests its engine runs at once (`max_concurrency`)
    def local_score(self) -> float: ...
    def engine_load(self, weights: Weights, now: float) -> float | None: ...
    def in_flight(self, now: float) -> float: ...  # requests on it, every worker's if known
    def load(self, now: float) -> EngineSignals | None: ...  # its engine's figures, if fresh


def pick(kind: PickKind, replicas: Sequence[Replica], *, weights: Weights, now: float,
         rng: random.Random) -> Replica:
    """One of `replicas` (non-empty, all available) for a request (a "prefix" pool's request
    without a prompt to match: by engine load)."""
    if len(replicas) == 1:
        return replicas[0]
    if kind in ("engine", "prefix"):
        return _lowest_engine_load(replicas, weights, now, rng)
    return _p2c(replicas, rng)


# How much a request in flight on a replica with a free slot delays a new one, in service
# times per slot: prefills and decode steps share the engine's batch. Small, so a cached
# prefix wins over a few requests' difference in load, not over a full batch.
CONTENTION = 0.1
# What caching a prompt's tokens on a replica costs the blocks it evicts there, in prefills of
# those tokens: they are prefilled again later, by this prompt's next request or another's.
# Without it a prompt moved whenever its replica was briefly busier, and the copy evicted
# others' prompts (starts: hit rate 58 % at 0, 67 % at 0.5, 70 % at 1, 73 % at 2 and 4,
# 2026-11-27). With the engines' KV-cache events, three runs each (loadtests.routing,
# 2026-11-29): at 2, starts 72.7 % / p50 68 / p99 258 ms and sessions 77.2 % / 45 / 210 ms;
# at 4, 74.7 % / 67 / 328 and 79.1 % / 41 / 255 (sessions at 8: 79.0 % / 39 / 250). Each
# move off a session's replica left its context behind and copied it elsewhere.
CACHE_USE = 4.0
COLD_SHARE = 0.7  # a prompt of which no replica holds 30 % is placed as a new one


def slowness(service: float | None, services: Sequence[float | None]) -> float:
    """How many times slower than the fastest of `services` a replica with `service` seconds
    per request is: 1 until every one is measured."""
    if not service or not all(s is not None and s > 0 for s in services):
        return 1.0
    return service / min(s for s in services if s)


@dataclass(frozen=True, slots=True)
class PromptView:
    """What the pool knows of one prompt on each candidate replica (in candidate order)."""

    uncached_tokens: Sequence[float]  # what each would have to prefill
    tokens: float  # the whole prompt
    backlog_s: Sequence[float]  # prefill work each was sent and has not finished (estimated)
    idle_s: Sequence[float]  # how long unused the block each would evict next has been
    held: Sequence[int]  # blocks each is known to hold
    last_sent: Sequence[bool]  # each was the last sent a prompt beginning as this one does


R = TypeVar("R", bound=Replica)


class Ranking(NamedTuple, Generic[R]):
    """A pool's replicas in the order a request should have them, least expected time to its
    first token first; the first `hold` of them hold the most of its prompt, and waiting up to
    `patience_s` for a slot on one of those still beats prefilling the prompt on the next
    replica now (0: nothing worth waiting for, as for every pick but "prefix")."""

    order: list[R]
    hold: int = 0
    patience_s: float = 0.0


HOLDS_ALIKE = 0.05  # replicas whose uncached parts differ by less (of the prompt) hold it alike


def by_first_token(replicas: Sequence[R], view: PromptView, prefill_s_per_token: float,
                   now: float, rng: random.Random) -> Ranking[R]:
    """`replicas` by the expected time to a prompt's first token on each, least first: the
    wait for one of its slots (with its requests in flight), the prefills it was sent ahead
    of this one, and the prefill of what it does not hold of the prompt, at its measured
    speed.

    A prompt no replica holds `COLD_SHARE` of is new: among the replicas within one fast
    prefill of it of the cheapest, it goes back to the one it was last sent to, if any
    (`PromptView.last_sent`: the index forgot it, but that engine may still hold its
    beginning; sent anew to another, 6 of 240 prompts went elsewhere on real vLLM,
    loadtests.real_routing, 2026-11-29), else where the cache would evict the block unused
    longest (one with room first, the emptiest of those), so new prompts spread over every
    replica's cache; choosing by speed alone put every new prompt on the fast replicas and
    left the slow one's cache idle (and within three prefills, its prefill lane backed up:
    p99 0.6 s against 0.25 s; loadtests.routing, 2026-11-27).

    A held prompt whose holders come first is worth waiting for (`Ranking.patience_s`): the
    next replica's cost less the holders' cost without their wait. Taking the first free
    slot in this order instead moved 2.4 % of placements off a busy holder, and each copy
    evicted another prompt (loadtests.routing, 2026-11-28)."""
    services = [r.service_s for r in replicas]
    measured = all(s is not None and s > 0 for s in services)
    # Until every replica's time per request is measured, the least a request takes on any:
    # the prefill of this whole prompt. A fixed second made a busy holder look a quarter of a
    # second away on engines that answer in 20 ms, and moved its prompts while the pool
    # started (5 of 11 moves on real vLLM, loadtests.real_routing, 2026-11-29); a wait too
    # short costs at most the holder's patience.
    whole = view.tokens * prefill_s_per_token  # the prefill of the whole prompt
    fastest = min(s or 0.0 for s in services) if measured else whole
    costs, waits = {}, {}
    for replica, service, uncached, backlog in zip(replicas, services, view.uncached_tokens,
                                                   view.backlog_s, strict=True):
        held = service if measured and service else whole
        places = max(1, replica.batch)
        load = replica.in_flight(now)
        # Requests ahead of it: beyond the replica's batch (the gateway may send a few to
        # wait in its engine's queue), or in its engine's own queue (an engine running fewer
        # than its batch, KV cache full, or others sending to it too), which drain as its
        # running batch finishes. A place frees at the replica's own pace; sharing its batch
        # slows a first token about alike everywhere (a batch's decode steps are cheap beside
        # a prefill).
        ahead, batch = max(0.0, load + 1 - places), float(places)
        engine = replica.load(now)
        if engine is not None and engine.waiting > ahead:
            ahead, batch = engine.waiting, min(batch, max(1.0, engine.running))
        waits[id(replica)] = held * ahead / batch
        wait = waits[id(replica)] + fastest * CONTENTION * load / places
        prefill = uncached * prefill_s_per_token
        costs[id(replica)] = (wait + backlog + prefill * slowness(service, services)
                              + CACHE_USE * prefill)

    def tie(replica: R) -> float:  # weighted random: twice the weight, first twice as often
        return -float(rng.random() ** (1 / replica.weight))

    if min(view.uncached_tokens) < COLD_SHARE * view.tokens:
        order = sorted(replicas, key=lambda r: (costs[id(r)], tie(r)))
        lacks = dict(zip(map(id, replicas), view.uncached_tokens, strict=True))
        most = lacks[id(order[0])]  # what the first lacks: the others hold as much, or less
        hold = next((i for i, r in enumerate(order)
                     if lacks[id(r)] > most + HOLDS_ALIKE * view.tokens), len(order))
        if hold == len(order) or most >= COLD_SHARE * view.tokens:
            return Ranking(order)  # held alike everywhere, or the first holds too little
        patience = costs[id(order[hold])] - min(costs[id(r)] - waits[id(r)]
                                                for r in order[:hold])
        return Ranking(order, hold, max(0.0, patience))
    margin = min(costs.values()) + whole
    room = {id(r): (not last, -idle, held) for r, last, idle, held
            in zip(replicas, view.last_sent, view.idle_s, view.held, strict=True)}
    return Ranking(sorted(replicas, key=lambda r: (costs[id(r)] > margin,
                                                   room[id(r)] if costs[id(r)] <= margin
                                                   else (costs[id(r)], 0), tie(r))))


def _two_choices(replicas: Sequence[Replica], rng: random.Random,
                 score: Callable[[Replica], float]) -> Replica:
    """Two different candidates drawn by weight; the lower `score` wins."""
    [first] = rng.choices(replicas, weights=[r.weight for r in replicas])
    others = [r for r in replicas if r is not first]
    [second] = rng.choices(others, weights=[r.weight for r in others])
    return first if score(first) <= score(second) else second


def _p2c(replicas: Sequence[Replica], rng: random.Random) -> Replica:
    """Of two candidates, the one with fewer of this worker's requests in flight."""
    return _two_choices(replicas, rng, lambda r: r.local_score())


def _engine_loads(replicas: Sequence[Replica], weights: Weights, now: float
                  ) -> list[float] | None:
    """Each replica's engine load score; None when some replica has no fresh figures."""
    loads = [r.engine_load(weights, now) for r in replicas]
    return None if any(load is None for load in loads) else [load or 0.0 for load in loads]


def _lowest_engine_load(replicas: Sequence[Replica], weights: Weights, now: float,
                        rng: random.Random) -> Replica:
    loads = _engine_loads(replicas, weights, now)
    if loads is None:
        return _p2c(replicas, rng)  # no fresh figures for some: this worker's counts for all
    # Each replica's load with this request on it, times how slow it is against the others
    # (its measured time per request over their mean) once all are measured: a slow replica
    # with a short queue can be worse than a fast one with a longer queue.
    ahead = [load + 1.0 for load in loads]
    services = [r.service_s for r in replicas]
    if all(s is not None and s > 0 for s in services):
        mean = sum(s or 0.0 for s in services) / len(services)
        ahead = [a * (s or 0.0) / mean for a, s in zip(ahead, services, strict=True)]
    score = {id(r): work / r.weight for work, r in zip(ahead, replicas, strict=True)}
    # Of two candidates rather than the lowest of all: the best of all on figures up to a
    # read old herds (every worker sends its requests to the same replica until the next
    # read); two choices keep most of the gain without the herd (Mitzenmacher, "How useful is
    # old information?").
    return _two_choices(replicas, rng, lambda r: score[id(r)])


