"""Backends grouped into pools, and the pick of one backend for a request. No I/O.

Pick, among backends that are healthy and below their concurrency cap: by the pool's
`[routing]` pick (proxy.upstream.routing: the shared prefix's replica, the engines' own load, or
two random choices on this worker's outstanding requests). When none is available, the answer
is an immediate 503 with Retry-After rather than a queue that grows without bound.

Healthy means: the supervisor says `ready` (supervised backends only), and this worker's
`BackendHealth` admits it (not ejected, last probe fine; one request at a time when half-open).
Outcomes come back through `record_success` / `record_failure` (see `Upstreams.exchange`), and a
failure asks the prober for a probe at once (`probe_soon`).

Network mode (DESIGN §6) runs a request on several backends at once: `Pool.pick_distinct` gives
n different ones, the least busy first, or 503 when fewer than n are free. A model's pools are per
mode: a backend serves the modes its `modes` lists (one pool each), so a model may be offered in
direct mode, network mode or both.

A backend's context length (`max_model_len` per model) is what its engine reports (vLLM's
/v1/models, TEI's /info, read by the prober in the background); a pool's limit is the least of
its backends'.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from proxy.config import BackendSpec, HealthSection, Mode, RoutingSection
from proxy.errors import ErrorKind, GatewayError
from proxy.headers import HeaderRule
from proxy.upstream.fleet_state import READY, FleetRecord
from proxy.upstream.health import BackendHealth, EjectionPolicy, ejection_allowed
from proxy.upstream.http1 import Target
from proxy.upstream.kv_blocks import EngineBlocks
from proxy.upstream.prefill_price import PrefillFit
from proxy.upstream.prefixes import PrefixIndex, Prompt
from proxy.upstream.routing import (
    PickKind,
    Ranking,
    Weights,
    by_first_token,
    slowness,
)
from proxy.upstream.routing import pick as choose
from proxy.upstream.signals import EngineSignals

RETRY_AFTER_S = "1"
_SENT_KEPT = 1024  # send times kept per backend: more than can be open between two reads
# Completions a time-per-request measurement spans: enough that one long request does not
# decide a replica's speed class.
_SERVICE_SAMPLE = 8
SATURATED_RETRY_S = 5  # Retry-After of a saturated pool whose completion rate is not known
_RNG = random.Random()
# Where the gateway may send requests beyond an engine's batch ([routing] engine_queue): vLLM
# queues what its batch cannot run, without bound (TGI and the speech, image and video servers
# refuse beyond their limit); and the batch must be at least QUEUE_MIN_BATCH, so a request of a
# higher tier waits at most about a quarter of a service time more for each one queued.
QUEUEING_KINDS = frozenset({"vllm"})
QUEUE_MIN_BATCH = 4
MODES: tuple[Mode, ...] = ("direct", "network")

# Kinds whose health endpoint is `/`; others default to `/health`. OpenAI-style hosted APIs have
# no free health endpoint, so they are not probed unless `health_path` says where.
_ROOT_HEALTH = frozenset({"ollama"})
_NO_HEALTH = frozenset({"openai"})
# Kinds that get the deep probe (a one-token chat completion, or one word's vector) while
# their health is in doubt.
DEEP_PROBE_KINDS = frozenset({"tgi", "vllm", "ollama", "tei"})


def health_path(spec: BackendSpec) -> str:
    """The cheap probe's path; "" when probes are off for this backend."""
    if spec.health_path is not None:
        return spec.health_path
    if spec.kind in _NO_HEALTH:
        return ""
    return "/" if spec.kind in _ROOT_HEALTH else "/health"


class Backend:
    """One upstream server as this worker sees it: its spec, live counters and health."""

    __slots__ = ("_busy_s", "_finished", "_targets", "auth", "base_url", "batch_inputs",
                 "cache_tokens", "completion_rate", "forward", "health", "kv", "max_ejected_ratio",
                 "max_model_len", "name", "outstanding", "peers", "prefill", "prefill_until",
                 "probed", "queued", "record", "sent", "service_s", "signals", "spec", "supervised",
                 "wake")

    def __init__(self, spec: BackendSpec, settings: HealthSection | None = None,
                 engine_queue: int = 0) -> None:
        settings = settings or HealthSection()
        self.spec = spec
        # Requests sent beyond its batch to wait in its engine's own queue ([routing]
        # engine_queue), so the next is there when a running one ends.
        self.queued = (engine_queue if spec.kind in QUEUEING_KINDS
                       and spec.max_concurrency >= QUEUE_MIN_BATCH else 0)
        self.name = spec.name
        self.base_url = spec.url.rstrip("/")
        self._targets: dict[str, Target] = {}
        self.forward = HeaderRule(spec.forward_headers)
        key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
        self.auth = {"authorization": f"Bearer {key}"} if key else {}
        self.outstanding = 0
        self.supervised = spec.command is not None
        self.probed = bool(health_path(spec))
        self.health = BackendHealth(
            EjectionPolicy(settings.consecutive_failures, settings.ejection_base_s,
                           settings.ejection_max_s),
            deep_available=self.probed and spec.kind in DEEP_PROBE_KINDS,
            verified=self.fresh_verified,
        )
        self.max_ejected_ratio = settings.max_ejected_ratio
        self.record: FleetRecord | None = None  # the supervisor's last word (supervised only)
        # The engine's own load as the master last read it (vLLM and TGI; see `load`), and
        # when this worker sent its latest requests (a read taken before them cannot show them).
        self.signals: EngineSignals | None = None
        self.sent: deque[float] = deque(maxlen=_SENT_KEPT)
        self.completion_rate = 0.0  # requests/s the engine completes (smoothed, from its figures)
        # Seconds a request spends in it (Little's law over a span of reads: request-seconds
        # running over requests completed, smoothed): what tells a slow replica from a fast
        # one with the same queue.
        self.service_s: float | None = None
        self._busy_s = 0.0  # request-seconds running since the last measurement ...
        self._finished = 0.0  # ... and requests completed
        self.peers: tuple[tuple[Backend, ...], ...] = ()  # the pools this backend is in
        # model -> context length (prompt + completion tokens), as the engine reports it
        self.max_model_len: dict[str, int] = {}
        self.batch_inputs: int | None = None  # TEI: the most inputs one request may carry
        self.wake: Callable[[], None] | None = None  # set by the prober: probe this one now
        self.cache_tokens: int | None = None  # its KV cache, as its engine reports it
        self.prefill_until = 0.0  # monotonic time its prefills sent so far end (estimated)
        self.prefill = PrefillFit()  # what a prompt token costs it, from its engine's figures
        # Its engine's own word on its KV cache, where it publishes one (`kv_events`).
        self.kv = EngineBlocks(self.name) if spec.kv_events else None

    def probe_soon(self) -> None:
        """After a failure: have the prober look at once (nothing happens where none runs)."""
        if self.wake is not None:
            self.wake()

    def target(self, path: str) -> Target:
        """Where a request for `path` goes, parsed once (URL parsing is not free per request)."""
        target = self._targets.get(path)
        if target is None:
            target = self._targets[path] = Target.of(self.base_url + path)
        return target

    @property
    def fresh_verified(self) -> bool:
        """Whether a new process of this backend may take traffic before its first probe: a
        process the gateway started is proven by a probe first (if it has one); a server it
        merely fronts is assumed up, as it usually is, until something says otherwise."""
        return not (self.supervised and self.probed)

    @property
    def ready(self) -> bool:
        """Not supervised, or its supervisor reports it ready."""
        return not self.supervised or (self.record is not None and self.record.state == READY)

    @property
    def healthy(self) -> bool:
        return self.ready and self.health.admits(time.monotonic(), self.outstanding)

    def record_success(self) -> None:
        self.health.record_success(time.monotonic())

    def record_failure(self) -> bool:
        """Count an upstream failure; True when it ejected this backend."""
        return self.health.record_failure(time.monotonic(), may_eject=self._may_eject())

    def _may_eject(self) -> bool:
        pools = self.peers or ((self,),)
        return all(
            ejection_allowed(sum(1 for b in pool if b is not self and b.health.ejected),
                             len(pool), self.max_ejected_ratio)
            for pool in pools
        )

    @property
    def available(self) -> bool:
        return self.healthy and self.outstanding < self.slots

    def load(self, now: float) -> EngineSignals | None:
        """The engine's own figures while they are fresh; None when stale or never read."""
        signals = self.signals
        return signals if signals is not None and signals.fresh(now) else None

    def take_signals(self, signals: EngineSignals | None) -> None:
        """The master's latest read; two in a row give the engine's completion rate, and
        reads spanning `_SERVICE_SAMPLE` completions its time per request."""
        old = self.signals
        self.signals = signals
        self.prefill.take(signals.prefill if signals is not None else None)
        if signals is not None and signals.cache_tokens:
            self.cache_tokens = int(signals.cache_tokens)
        if (signals is None or old is None or signals.at <= old.at
                or old.done is None or signals.done is None):
            return
        if signals.done < old.done:  # the engine restarted: its counter began again
            self._busy_s = self._finished = 0.0
            return
        span = signals.at - old.at
        finished = signals.done - old.done
        self.completion_rate = 0.7 * self.completion_rate + 0.3 * finished / span
        # Running over the span (the mean of its ends) over the requests completed in it: idle
        # spans add to neither, so a replica that gets few requests still measures its time
        # per request, not the gaps between them (a running count over a smoothed rate did,
        # and a rarely picked replica looked slower and slower).
        self._busy_s += (old.running + signals.running) / 2 * span
        self._finished += finished
        if self._finished >= _SERVICE_SAMPLE:
            service = self._busy_s / self._finished
            self.service_s = service if self.service_s is None else (
                0.7 * self.service_s + 0.3 * service)
            self._busy_s = self._finished = 0.0

    def sent_after(self, at: float) -> int:
        """This worker's requests to it sent after wall-clock time `at` (of the last
        `_SENT_KEPT`)."""
        return len(self.sent) - bisect_right(self.sent, at)

    @property
    def weight(self) -> int:
        return self.spec.weight

    def engine_load(self, weights: Weights, now: float) -> float | None:
        """The `engine` pick's load score (None without fresh figures)."""
        load = self.load(now)
        if load is None:
            return None
        # Sent after the engine was read and still open: load its figures cannot show yet (a
        # request already answered is no load at all).
        unseen = min(self.sent_after(load.at), self.outstanding)
        return weights.score(load.waiting, load.running, load.kv, unseen)

    def local_score(self) -> float:
        return (self.outstanding + 1) / self.spec.weight

    @property
    def batch(self) -> int:
        """Requests its engine runs at once (`max_concurrency`)."""
        return self.spec.max_concurrency

    @property
    def slots(self) -> int:
        """Requests the gateway keeps in flight on it: its batch, and those it lets wait in
        the engine's own queue (`queued`)."""
        return self.spec.max_concurrency + self.queued

    def in_flight(self, now: float) -> float:
        """Requests on it: the engine's queue and batch as last read (every worker's), plus
        this worker's sent since; without fresh figures, this worker's own."""
        load = self.load(now)
        if load is None:
            return float(self.outstanding)
        return load.waiting + load.running + min(self.sent_after(load.at), self.outstanding)


@dataclass(frozen=True, slots=True)
class Saturation:
    waiting_per_replica: float
    retry_after_s: int


class Pool:
    """The backends that can serve one model for one task family."""

    __slots__ = ("_named", "_prefill_s_per_token", "backends", "index", "key", "learn_prefill",
                 "model", "on_placed", "pick_kind", "weights")

    def __init__(self, model: str, backends: Sequence[Backend], pick_kind: PickKind = "p2c",
                 routing: RoutingSection | None = None, key: str | None = None) -> None:
        self.model = model
        self.backends = tuple(backends)
        self._named = {b.name: b for b in self.backends}
        # Its name in the dispatcher's shared state (proxy.upstream.slots): the same in every
        # worker and on every host with the same backends.toml.
        self.key = key or f"{model}@{','.join(b.name for b in self.backends)}"
        self.pick_kind: PickKind = pick_kind
        r = routing or RoutingSection()
        self.weights = Weights.of(r)
        self._prefill_s_per_token = r.prefill_ms_per_1k_tokens / 1e6
        self.learn_prefill = r.learn_prefill
        # What its replicas hold, for "prefix" (proxy.upstream.prefixes), and who hears of
        # each placement (the other workers: proxy.upstream.prefix_share).
        self.index = PrefixIndex(r.cache_tokens) if pick_kind == "prefix" else None
        self.on_placed: Callable[[Pool, Backend, Prompt], None] | None = None

    @property
    def prefill_s_per_token(self) -> float:
        """What prefilling a prompt token costs on its fastest replica: the least of what its
        engines' own figures show (`learn_prefill`; proxy.upstream.prefill_price), else
        `prefill_ms_per_1k_tokens`."""
        if self.learn_prefill:
            learned = [b.prefill.per_token_s for b in self.backends if b.prefill.per_token_s]
            if learned:
                return min(learned)
        return self._prefill_s_per_token

    @property
    def healthy(self) -> bool:
        """Whether any backend is healthy now (at its cap or not): `auto` mode's test."""
        return any(b.healthy for b in self.backends)

    def slots(self) -> int:
        """Requests its healthy backends run at once (1 when none is healthy)."""
        return sum(b.slots for b in self.backends if b.healthy) or 1

    def named(self, names: Sequence[str]) -> list[Backend] | None:
        """Its backends called `names` (what the slot ledger granted), in that order."""
        return [self._named[name] for name in names if name in self._named] or None

    def context_limit(self) -> int | None:
        """The least context length the pool's engines report for its model (None: unknown)."""
        known = [n for b in self.backends if (n := b.max_model_len.get(self.model)) is not None]
        return min(known) if known else None

    def pick(self, exclude: Backend | None = None, rng: random.Random | None = None,
             prompt: Prompt | None = None) -> Backend:
        """A backend for one request (`prompt`: what the "prefix" pick matches), placed."""
        chosen = self.preferred(exclude, rng, prompt)[0]
        self.placed(chosen, prompt)
        return chosen

    def preferred(self, exclude: Backend | None = None, rng: random.Random | None = None,
                  prompt: Prompt | None = None, capped: bool = True) -> list[Backend]:
        """The available backends (`capped`: below this worker's cap too; else healthy) in the
        order the request should have them: where it goes if its first choice has no free
        slot. "prefix" orders them all by expected time to first token; the other picks put
        their choice first, then the others by this worker's requests in flight per unit of
        weight. 503 when none."""
        return self.ranked(exclude, rng, prompt, capped).order

    def ranked(self, exclude: Backend | None = None, rng: random.Random | None = None,
               prompt: Prompt | None = None, capped: bool = True) -> Ranking[Backend]:
        """`preferred`, with how many of its first backends hold the most of `prompt` and how
        long a slot on one of them is worth waiting for (`routing.Ranking`)."""
        candidates = [b for b in self.backends
                      if (b.available if capped else b.healthy) and b is not exclude]
        if not candidates:
            raise self._none_available(exclude)
        now = time.time()
        if self.index is not None and prompt is not None:
            index = self.index
            for b in candidates:
                index.resize(b.name, b.cache_tokens)
            clock = time.monotonic()
            view = index.prompt_view(prompt, [b.name for b in candidates],
                                     [max(0.0, b.prefill_until - clock) for b in candidates],
                                     clock)
            return by_first_token(candidates, view, self.prefill_s_per_token, now, rng or _RNG)
        chosen = choose(self.pick_kind, candidates, weights=self.weights, now=now,
                        rng=rng or _RNG)
        assert isinstance(chosen, Backend)
        return Ranking([chosen, *sorted((b for b in candidates if b is not chosen),
                                        key=Backend.local_score)])

    def placed(self, backend: Backend, prompt: Prompt | None) -> None:
        """A request was bound to `backend`: it counts as sent, and its prompt's blocks as
        held there."""
        backend.sent.append(time.time())
        if self.index is not None and prompt is not None:
            matched = self.index.matched(backend.name, prompt)
            self.index.expect(backend.name, prompt, matched)
            self.hold(backend.name, prompt, matched)
            if self.on_placed is not None:
                self.on_placed(self, backend, prompt)

    def hold(self, name: str, prompt: Prompt, matched: int | None = None) -> None:
        """The replica `name` was sent `prompt` (by this worker or another; `matched`: the
        blocks of it the index already had there, if known): it prefills what it lacked, after
        what it was sent before, and holds the prompt's blocks from now."""
        assert self.index is not None
        if matched is None:
            matched = self.index.matched(name, prompt)
        now = time.monotonic()
        backend = self._named.get(name)
        if backend is not None:
            backend.prefill_until = (max(backend.prefill_until, now)
                                     + self._prefill_s(backend, prompt, matched))
            if backend.kv is not None:
                backend.kv.sent(self.index, prompt)
        self.index.add(name, prompt.blocks, now)

    @contextlib.contextmanager
    def reserved(self, backend: Backend, prompt: Prompt | None) -> Iterator[None]:
        """While a request ranked with `backend` first waits for its slot, its prefill counts
        there for requests ranked meanwhile (six at once went 5/1, unseen); `placed` keeps it."""
        if self.index is None or prompt is None:  # no backlog kept: nothing to count
            yield
            return
        work = self._prefill_s(backend, prompt, self.index.matched(backend.name, prompt))
        backend.prefill_until = max(backend.prefill_until, time.monotonic()) + work
        try:
            yield
        finally:
            backend.prefill_until -= work

    def _prefill_s(self, backend: Backend, prompt: Prompt, matched: int) -> float:
        """Seconds `backend` takes to prefill `prompt` past its first `matched` blocks."""
        assert self.index is not None
        return (self.index.tokens_past(prompt, matched) * self.prefill_s_per_token
                * slowness(backend.service_s, [b.service_s for b in self.backends]))

    def saturation(self, now: float) -> Saturation | None:
        """How deep the engines' queues are, from their fresh figures (None: none known)."""
        loads = [(b, load) for b in self.backends if b.healthy and (load := b.load(now))]
        if not loads:
            return None
        waiting = sum(load.waiting for _, load in loads)
        rate = sum(b.completion_rate for b, _ in loads)
        # The queue ahead drains at the pool's completion rate; unknown rate: a short wait.
        retry = math.ceil(waiting / rate) if rate > 0 else SATURATED_RETRY_S
        return Saturation(waiting / len(loads), max(1, min(60, retry)))

    def pick_distinct(self, n: int, rng: random.Random | None = None) -> list[Backend]:
        """`n` different available backends (healthy, under their cap) for one redundant
        request, those with the fewest requests in flight per unit of weight first (equal ones
        in random order); 503 with Retry-After when fewer than `n` are free."""
        if n < 1:
            raise ValueError(f"pick_distinct needs n >= 1, got {n}")
        candidates = [b for b in self.backends if b.available]
        if len(candidates) < n:
            raise GatewayError(
                ErrorKind.UNAVAILABLE,
                f"model {self.model!r} has fewer than {n} backends free for network mode",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        (rng or random).shuffle(candidates)  # ties broken at random, not by config order
        candidates.sort(key=Backend.local_score)  # stable: the shuffle decides among equals
        return candidates[:n]

    def _none_available(self, exclude: Backend | None) -> GatewayError:
        others = [b for b in self.backends if b is not exclude]
        if others and all(b.healthy for b in others):
            reason = "all backends are at their concurrency limit"
        else:
            reason = "no healthy backend"
        return GatewayError(
            ErrorKind.UNAVAILABLE,
            f"model {self.model!r} is temporarily unavailable: {reason}",
            headers={"Retry-After": RETRY_AFTER_S},
        )
