"""Picks on the engines' own signals (proxy.upstream.routing), through real `Pool`s."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import pytest
from msgspec.structs import replace

from proxy.config import BackendSpec, RoutingSection, TierPolicy
from proxy.errors import ErrorKind, GatewayError
from proxy.policy.tiers import check_queue_budget
from proxy.upstream.pool import Backend, Pool, Router
from proxy.upstream.routing import prefix_key, rendezvous_order
from proxy.upstream.signals import EngineSignals

MODEL = "acme/small-chat"


def spec(name: str, weight: int = 1) -> BackendSpec:
    return BackendSpec(name=name, kind="vllm", url=f"http://{name}:8000", models=[MODEL],
                       weight=weight)


def chat_pool(*names: str, pick: str = "prefix", **routing: Any) -> Pool:
    router = Router([spec(n) for n in names], routing=RoutingSection(
        pick=pick, **routing))  # type: ignore[arg-type]
    return router.pool("chat", MODEL)


def load(backend: Backend, waiting: float, running: float = 0, kv: float = 0.0,
         age_s: float = 0.0) -> None:
    backend.take_signals(EngineSignals(waiting=waiting, running=running, kv=kv,
                                       at=time.time() - age_s))


def turns(system: str, *users: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(users):
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": f"answer {i}"})
    return {"model": MODEL, "messages": messages}


def test_the_prefix_is_the_system_prompt_and_first_user_turn() -> None:
    one = prefix_key(turns("You are terse.", "Hi", "and more"), None)
    assert one is not None and len(one) == 16
    assert prefix_key(turns("You are terse.", "Hi", "something else"), None) == one
    assert prefix_key(turns("You are terse.", "Hello"), None) != one
    assert prefix_key(turns("You are verbose.", "Hi"), None) != one
    session = prefix_key(turns("You are terse.", "Hi"), "user-42")
    assert session not in (None, one)
    assert prefix_key(turns("Other", "x"), "user-42") == session  # the session decides
    assert prefix_key({"messages": "not a list"}, None) is None
    assert prefix_key({"messages": [{"role": "assistant", "content": "x"}]}, None) is None
    assert b"terse" not in (one or b"")


def test_one_prefix_one_replica_and_the_same_in_every_worker() -> None:
    # Two routers stand for two workers (or two hosts): each picks alone.
    pools = [chat_pool("a", "b", "c"), chat_pool("a", "b", "c")]
    chosen = Counter()
    for i in range(20):
        key = prefix_key(turns(f"system prompt {i}", "hi"), None)
        names = {pool.pick(key=key, rng=random.Random(n)).name
                 for pool in pools for n in range(5)}
        assert len(names) == 1, names
        chosen[names.pop()] += 1
    assert len(chosen) == 3 and min(chosen.values()) >= 3  # 20 prefixes spread over all three


def test_losing_a_replica_moves_only_its_own_prefixes() -> None:
    three = chat_pool("a", "b", "c").backends
    keys = [bytes([i, i + 1]) * 8 for i in range(200)]
    before = {k: rendezvous_order(k, three)[0].name for k in keys}
    after = {k: rendezvous_order(k, [b for b in three if b.name != "b"])[0].name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "b" for k in moved)


def test_an_overloaded_prefix_target_spills_to_the_next_in_order() -> None:
    pool = chat_pool("a", "b", "c", load_bound=0.25)
    key = prefix_key(turns("shared system prompt", "hi"), None)
    assert key is not None
    first, second, _ = rendezvous_order(key, pool.backends)
    for backend in pool.backends:
        load(backend, waiting=2, running=2)
    assert pool.pick(key=key) is first
    load(first, waiting=30, running=8)  # far above the mean: the next replica takes it
    assert pool.pick(key=key) is second
    load(first, waiting=2, running=2)  # drained: back to its own replica
    assert pool.pick(key=key) is first


def test_engine_pick_avoids_a_full_queue_and_counts_what_it_sent() -> None:
    pool = chat_pool("a", "b", "c", pick="engine")
    a, b, c = pool.backends
    load(a, waiting=12, running=8, kv=0.9)
    load(b, waiting=0, running=2, kv=0.2)
    load(c, waiting=0, running=3, kv=0.2)
    picks = []
    # Each pick weighs two replicas drawn at random; unseeded, draws that never offered c
    # failed this test about once in 400 runs.
    rng = random.Random(5)
    for _ in range(6):  # each stays open, as a running exchange does
        chosen = pool.pick(rng=rng)
        chosen.outstanding += 1
        picks.append(chosen.name)
    assert "a" not in picks
    # What this worker sent after the read and still has open counts: b does not take all six.
    assert Counter(picks)["b"] < 6 and "c" in picks
    # A read taken after those sends already shows them: they no longer count on top.
    sent = b.sent_after(time.time() - 60)
    assert sent >= 1 and b.sent_after(time.time() + 1) == 0
    weights = pool.weights
    before = b.engine_load(weights, time.time())
    load(b, waiting=0, running=2, kv=0.2)  # a fresh read, after the sends
    assert b.engine_load(weights, time.time()) == pytest.approx(before - weights.sent * sent)


def test_kv_cache_use_counts_only_as_the_cache_nears_full() -> None:
    """Below 80 % in use an engine admits at once (its batch is already in `running`); from
    there to full, KV use adds up to `kv_cache_weight` requests to its load."""
    pool = chat_pool("a", "b", pick="engine")
    backend, weights = pool.backends[0], pool.weights

    def score(kv: float) -> float:
        load(backend, waiting=1, running=4, kv=kv)
        value = backend.engine_load(weights, time.time())
        assert value is not None
        return value

    assert score(0.1) == score(0.8) == pytest.approx(weights.waiting + 4 * weights.running)
    assert score(0.9) == pytest.approx(score(0.1) + weights.kv_cache / 2)
    assert score(1.0) == pytest.approx(score(0.1) + weights.kv_cache)


def test_stale_or_missing_figures_fall_back_to_this_workers_counts() -> None:
    pool = chat_pool("a", "b", pick="engine")
    a, b = pool.backends
    load(a, waiting=50, age_s=5.0)  # stale: never trusted
    load(b, waiting=0)
    a.outstanding, b.outstanding = 0, 5
    rng = random.Random(1)
    assert Counter(pool.pick(rng=rng).name for _ in range(50))["a"] > 25


def test_other_families_and_p2c_pools_ignore_prefixes() -> None:
    pool = chat_pool("a", "b", pick="p2c")
    key = prefix_key(turns("shared", "hi"), None)
    rng = random.Random(3)
    assert {pool.pick(key=key, rng=rng).name for _ in range(40)} == {"a", "b"}
    tts = Router([BackendSpec(name="t", kind="tts", url="http://t", models=["acme/csm-1b"])],
                 routing=RoutingSection(pick="prefix")).pool("tts", "acme/csm-1b")
    assert tts.pick_kind == "p2c"
    per_model = Router([spec("a"), spec("b")], routing=RoutingSection(
        pick="prefix", models={MODEL: "engine"})).pool("chat", MODEL)
    assert per_model.pick_kind == "engine"


def test_saturation_and_the_tier_queue_budget() -> None:
    pool = chat_pool("a", "b", pick="engine")
    a, b = pool.backends
    now = time.time()
    assert pool.saturation(now) is None  # no figures: no pushback
    for backend, waiting in ((a, 4), (b, 2)):
        backend.take_signals(EngineSignals(waiting=waiting, running=8, kv=0.5, at=now - 1,
                                           done=100))
        backend.take_signals(EngineSignals(waiting=waiting, running=8, kv=0.5, at=now,
                                           done=110))  # 10 completions in the last second
    saturation = pool.saturation(now)
    assert saturation is not None and saturation.waiting_per_replica == 3
    # The 6 waiting drain at the pool's completion rate (each engine's, smoothed: 3/s + 3/s).
    assert saturation.retry_after_s == 1
    basic = TierPolicy(requests_per_minute=10, families=["chat"], models={"*": ["direct"]},
                       queue_budget=3)
    check_queue_budget(replace(basic, queue_budget=4), "basic", MODEL, 3, 1)  # under budget
    check_queue_budget(replace(basic, queue_budget=None), "max", MODEL, 300, 1)  # never refused
    with pytest.raises(GatewayError) as refused:
        check_queue_budget(basic, "basic", MODEL, 3, 7)
    assert refused.value.kind is ErrorKind.POOL_SATURATED
    assert refused.value.headers == {"Retry-After": "7"}
    a.take_signals(None)
    b.take_signals(EngineSignals(waiting=2, running=8, kv=0.5, at=now - 10))  # stale
    assert pool.saturation(now) is None


def test_a_slow_replica_counts_its_queue_at_its_speed() -> None:
    pool = chat_pool("fast", "slow", pick="engine")
    fast, slow = pool.backends
    now = time.time()
    # Two reads a second apart: fast completes 8/s with 4 running (0.5 s each), slow 2/s with
    # 4 running (2 s each), as Little's law has it.
    for backend, done in ((fast, 8.0), (slow, 2.0)):
        for i in range(12):  # the smoothing settles
            backend.take_signals(EngineSignals(waiting=0, running=4, kv=0.1, at=now - 12 + i,
                                               done=done * i))
    assert fast.service_s is not None and slow.service_s is not None
    assert slow.service_s / fast.service_s == pytest.approx(4, rel=0.05)
    load(fast, waiting=3, running=4, kv=0.1)  # a longer queue, but four times faster
    load(slow, waiting=0, running=4, kv=0.1)
    assert {pool.pick().name for _ in range(5)} == {"fast"}
    # Without a measured speed for both, queues alone decide.
    slow.service_s = None
    assert {pool.pick().name for _ in range(5)} == {"slow"}


def test_a_rarely_picked_replica_measures_its_time_per_request_not_its_idle_gaps() -> None:
    """One 0.5 s request every 2 s, read every 0.25 s: 0.5 s per request, however idle the
    replica is between them (a running count over a smoothed completion rate read it as
    seconds, and its speed class locked it out of its prefixes)."""
    backend = chat_pool("rare", "other").backends[0]
    now = time.time() - 200
    done = 0
    for step in range(8 * 80):  # 80 requests; the engine restarts halfway
        at = now + step * 0.25
        phase = step % 8  # running during [0, 0.5) of each 2 s; done when it ends
        running = 1 if phase in (1, 2) else 0
        done += phase == 3
        if step == 8 * 40 + 2:  # its counter starts again from 0, mid-request
            done = 0
        backend.take_signals(EngineSignals(waiting=0, running=running, kv=0.0, at=at,
                                           done=done))
    assert backend.service_s == pytest.approx(0.5, rel=0.05)


def test_a_replica_measured_three_times_slower_owns_a_third_as_many_prefixes() -> None:
    """Ownership by capacity: weight over speed class (how many times slower than the fastest,
    rounded), the same in every worker once each has measured the speeds; in an idle pool every
    key goes to its owner."""
    pool = chat_pool("a", "b", "slow")
    a, b, slow = pool.backends
    keys = [prefix_key(turns(f"system prompt {i}", "hi"), None) for i in range(700)]
    before = {k: pool.pick(key=k).name for k in keys}
    assert min(Counter(before.values()).values()) > 180  # unmeasured: a third each
    for backend, service in ((a, 0.5), (b, 0.55), (slow, 1.6)):  # classes 1, 1, 3
        backend.service_s = service
    after = {k: pool.pick(key=k).name for k in keys}
    owners = Counter(after.values())
    assert 70 <= owners["slow"] <= 130, owners  # about 1/7 of 700
    # Only the slow replica's keys moved: the fast replicas' caches keep what they had.
    assert all(after[k] == before[k] for k in keys if before[k] != "slow")
    slow.service_s = 1.6 * 1.07  # a change within its class moves nothing
    assert {k: pool.pick(key=k).name for k in keys} == after
