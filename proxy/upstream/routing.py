"""How a pool chooses among its available replicas, on the engines' own signals. No I/O.

    p2c     two weighted random candidates, fewer requests in flight (this worker's) wins
    engine  of two weighted random candidates, the lower load score: the engine's waiting
            queue, running batch and KV-cache use (as the master last read them) plus the
            requests this worker sent it since that read; P2C on this worker's counts where no
            fresh figures exist
    prefix  requests sharing a prefix (system prompt and first user turn, or `X-Session-Id`)
            go to one replica by rendezvous hashing weighted by capacity (weight over measured
            speed class), the same in every worker and on every host, so its prefix cache stays
            warm; a replica above (1 + load_bound) x its share of the pool's load is passed
            over for the next in rendezvous order (bounded-load hashing)

The prefix is hashed (BLAKE2b, 16 bytes) as soon as it is read; nothing keeps the raw text.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson

if TYPE_CHECKING:
    from proxy.config import RoutingSection

PickKind = Literal["p2c", "engine", "prefix"]
SESSION_HEADER = "X-Session-Id"


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
    def local_score(self) -> float: ...
    def engine_load(self, weights: Weights, now: float) -> float | None: ...


def prefix_key(body: Mapping[str, Any], session: str | None) -> bytes | None:
    """The affinity key of a chat request: its session header, else its system prompt(s) and
    first user turn (OpenAI-shaped `messages`), hashed; None when there is nothing to share."""
    digest = hashlib.blake2b(digest_size=16)
    if session:
        digest.update(b"session\0" + session.encode("utf-8", "replace"))
        return digest.digest()
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    shared: list[Any] = []
    for message in messages:
        if not isinstance(message, dict):
            break
        role = message.get("role")
        if role in ("system", "developer"):
            shared.append(message.get("content"))
        elif role == "user":
            shared.append(message.get("content"))
            break
        else:
            break
    if not shared:
        return None
    digest.update(orjson.dumps(shared, option=orjson.OPT_SORT_KEYS))
    return digest.digest()


def rendezvous_order(key: bytes, replicas: Sequence[Replica],
                     weights: Mapping[str, float] | None = None) -> list[Replica]:
    """Replicas by weighted rendezvous (highest random weight) for `key`: the same order
    wherever it is computed, and removing a replica moves only the keys it had. `weights` by
    name (default: each replica's configured weight)."""
    def rank(replica: Replica) -> float:
        h = hashlib.blake2b(key + replica.name.encode(), digest_size=8).digest()
        u = (int.from_bytes(h, "big") + 1) / (2**64 + 1)  # in (0, 1)
        weight = weights[replica.name] if weights is not None else replica.weight
        return -weight / math.log(u)

    return sorted(replicas, key=rank, reverse=True)


def pick(kind: PickKind, replicas: Sequence[Replica], *, key: bytes | None, weights: Weights,
         load_bound: float, now: float, rng: random.Random) -> Replica:
    """One of `replicas` (non-empty, all available) for a request."""
    if len(replicas) == 1:
        return replicas[0]
    if kind == "prefix" and key is not None:
        return _bounded_rendezvous(replicas, key, weights, load_bound, now, rng)
    if kind in ("engine", "prefix"):
        return _lowest_engine_load(replicas, weights, now, rng)
    return _p2c(replicas, rng)


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


def speed_classes(replicas: Sequence[Replica]) -> list[int]:
    """How many times slower than the fastest each replica is, by measured time per request,
    rounded to a whole number (1 for all until every one is measured). Coarse on purpose: a
    prefix's owner changes only when a replica's speed changes class, not with every reading,
    so caches are not churned."""
    services = [r.service_s for r in replicas]
    if not all(s is not None and s > 0 for s in services):
        return [1] * len(replicas)
    fastest = min(s or 0.0 for s in services)
    return [max(1, round((s or 0.0) / fastest)) for s in services]


def _bounded_rendezvous(replicas: Sequence[Replica], key: bytes, weights: Weights,
                        load_bound: float, now: float, rng: random.Random) -> Replica:
    # Unscaled loads: the bound keeps a replica's prefixes on it while its queue is within
    # its share (scaled by speed as well, a slow replica's keys spilled most of the time and
    # thrashed the fast replicas' caches: loadtests.routing, 2026-11-25).
    loads = _engine_loads(replicas, weights, now) or [float(r.outstanding) for r in replicas]
    # A replica owns prefixes, and may hold load, in proportion to its capacity: its weight
    # over how many times slower it measures than the fastest.
    capacity = {r.name: r.weight / c
                for r, c in zip(replicas, speed_classes(replicas), strict=True)}
    load = {r.name: x for r, x in zip(replicas, loads, strict=True)}
    # Bounded-load hashing: a replica takes the request while its load with it stays within
    # (1 + load_bound) x its share of the pool's load with it, rounded up (so an idle pool
    # sends every key home).
    total = sum(loads) + 1.0
    share = sum(capacity.values())
    for replica in rendezvous_order(key, replicas, capacity):
        room = math.ceil((1 + load_bound) * total * capacity[replica.name] / share - 1e-9)
        if load[replica.name] + 1.0 <= room:
            return replica
    return _lowest_engine_load(replicas, weights, now, rng)  # all over their room (rounding)
