"""Picks on the engines' own signals (proxy.upstream.routing), through real `Pool`s."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from typing import Any

import pytest
from msgspec.structs import replace
from redis.asyncio import Redis

from proxy.config import BackendSpec, RoutingSection, TierPolicy
from proxy.errors import ErrorKind, GatewayError
from proxy.policy.tiers import check_queue_budget
from proxy.store.background import stop_task
from proxy.store.redis_process import RedisProcess
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.prefix_share import PrefixShare
from proxy.upstream.prefixes import BLOCK_CHARS, LAST_SENT_KEPT, Prompt, pack, prompt_of, unpack
from proxy.upstream.router import Router
from proxy.upstream.routing import CACHE_USE, CONTENTION
from proxy.upstream.signals import EngineSignals, parse_signals

MODEL = "acme/small-chat"
# As vLLM 0.32 writes it (shared/real-engines/vllm-metrics.txt; most labels left out).
CACHE_CONFIG = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",\
kv_cache_size_tokens="1048576",num_cpu_blocks="None",num_gpu_blocks="8192"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
"""


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


def test_a_prompts_blocks_are_shared_exactly_as_far_as_prompts_begin_alike() -> None:
    system = "You are a careful assistant. " * 30  # several blocks on its own
    first = prompt_of(turns(system, "What is a mole? " * 20))
    assert first is not None and len(first.blocks) >= 4
    assert all(0 <= block < 2**64 for block in first.blocks)
    assert unpack(pack(first.blocks)) == first.blocks  # as the other workers hear of them
    other = prompt_of(turns(system, "Name a prime. " * 20))
    assert other is not None
    shared = next(i for i, (x, y) in enumerate(zip(first.blocks, other.blocks, strict=False))
                  if x != y)
    assert shared >= len(system) // BLOCK_CHARS - 1  # the system prompt's blocks, and no more
    # The next turn of the conversation begins with every block of the one before it.
    later = prompt_of(turns(system, "What is a mole? " * 20, "And a kilomole? " * 30))
    assert later is not None and later.blocks[:len(first.blocks)] == first.blocks
    assert len(later.blocks) > len(first.blocks)
    # A session seeds the chain: its turns match each other, not other conversations.
    session = prompt_of(turns(system, "What is a mole?"), "user-42")
    assert session is not None and session.blocks[0] != first.blocks[0]
    assert prompt_of({"messages": "not a list"}) is None
    assert prompt_of({"messages": []}) is None
    assert b"careful" not in pack(first.blocks)
    # Nothing a client sends makes it fail: an integer JSON cannot hold is no prompt to match.
    assert prompt_of({"messages": [{"role": "user", "content": "x", "n": 2**70}]}) is None


def test_a_prompt_goes_to_the_replica_holding_its_longest_prefix() -> None:
    pool = chat_pool("a", "b", "c")
    system = "Answer in French. " * 40
    placed = pool.pick(prompt=prompt_of(turns(system, "hello")))

    def after_its_prefill(prompt: Prompt | None) -> Backend:
        placed.prefill_until = 0.0  # each request comes once the one before was prefilled
        return pool.pick(prompt=prompt)

    # Any later request that shares the system prompt, and the conversation's next turns.
    for user in ("bonjour", "a longer question " * 20):
        assert after_its_prefill(prompt_of(turns(system, user))) is placed
    assert after_its_prefill(prompt_of(turns(system, "hello", "more"))) is placed
    # A different system prompt is free to go elsewhere: the least loaded.
    placed.outstanding = 3
    other = pool.pick(prompt=prompt_of(turns("Answer in German. " * 40, "hallo")))
    assert other is not placed


def test_a_busy_holder_loses_to_prefilling_elsewhere_and_then_both_hold_it() -> None:
    pool = chat_pool("a", "b", "c", prefill_ms_per_1k_tokens=60)
    prompt = prompt_of(turns("Shared instructions. " * 60, "q"))
    assert prompt is not None
    holder = pool.pick(prompt=prompt)
    for backend in pool.backends:
        backend.service_s = 0.5
        load(backend, waiting=0, running=2)
    assert pool.preferred(prompt=prompt)[0] is holder  # cached: worth more than 2 in flight
    # Its batch full and a queue behind it: waiting costs more than prefilling elsewhere.
    load(holder, waiting=4, running=pool.backends[0].batch)
    spill = pool.pick(prompt=prompt)
    assert spill is not holder
    load(holder, waiting=0, running=2)
    load(spill, waiting=0, running=2)
    # Now both hold it: it goes to whichever of them is less loaded, never to the third.
    load(holder, waiting=0, running=5)
    assert pool.preferred(prompt=prompt)[0] is spill
    third = next(b for b in pool.backends if b not in (holder, spill))
    assert pool.preferred(prompt=prompt)[-1] is third


def test_a_busy_holder_is_worth_waiting_for_as_long_as_prefilling_elsewhere_costs() -> None:
    """The ranking's patience: how long a slot on the prompt's holder is worth waiting for
    (the dispatcher waits that long rather than taking a free slot elsewhere)."""
    pool = chat_pool("a", "b", "c", prefill_ms_per_1k_tokens=60)
    assert pool.index is not None
    prompt = prompt_of(turns("Shared instructions. " * 200, "q"))
    assert prompt is not None
    cold = pool.ranked(prompt=prompt)
    assert cold[1:] == (0, 0.0)  # nobody holds it: nothing to wait for
    holder = pool.pick(prompt=prompt)
    holder.prefill_until = 0.0
    for backend in pool.backends:
        backend.service_s = 0.5
        load(backend, waiting=0, running=2)
    other = next(b for b in pool.backends if b is not holder)
    lacks = pool.index.uncached_tokens(other.name, prompt) - pool.index.uncached_tokens(
        holder.name, prompt)
    saved = lacks * pool.prefill_s_per_token * (1 + CACHE_USE)  # its prefill, and what it evicts
    order, hold, patience = pool.ranked(prompt=prompt)
    assert (order[0], hold) == (holder, 1)
    assert patience == pytest.approx(saved)
    assert 0.25 < patience < 0.4  # ~1,000 tokens at 60 ms per 1,000, five times
    # Its batch full, nobody queued: still first, worth the same wait less what its fuller
    # batch slows a first token (the wait for its slot is what the dispatcher finds out).
    load(holder, waiting=0, running=holder.batch)
    order, hold, patience = pool.ranked(prompt=prompt)
    slower = CONTENTION * 0.5 * (holder.batch - 2) / holder.batch
    assert (order[0], hold, patience) == (holder, 1, pytest.approx(saved - slower))
    # A queue behind it (60 at 0.5 s over 64 slots: longer than the prefill saved): no
    # longer first, and nothing to wait for.
    load(holder, waiting=60, running=holder.batch)
    assert pool.ranked(prompt=prompt)[0][0] is not holder
    assert pool.ranked(prompt=prompt)[1:] == (0, 0.0)
    # Two holders alike: either will do, the third is the one not worth taking at once.
    spill = pool.pick(prompt=prompt)
    spill.prefill_until = 0.0
    load(holder, waiting=0, running=2)
    load(spill, waiting=0, running=3)
    order, hold, patience = pool.ranked(prompt=prompt)
    assert set(order[:2]) == {holder, spill} and hold == 2 and patience > 0.25


def test_before_any_time_per_request_is_measured_a_full_holder_keeps_its_prompt() -> None:
    """Until the engines' figures give a time per request, the wait for a slot is priced at
    the least a request takes (prefilling this prompt), not at a made-up second: a holder
    whose batch is just full stays first, worth a bounded wait, instead of its prompt being
    copied elsewhere at the pool's start (as on real vLLM, loadtests.real_routing)."""
    pool = chat_pool("a", "b", prefill_ms_per_1k_tokens=60)
    prompt = prompt_of(turns("Shared instructions. " * 80, "q"))  # ~400 tokens
    assert prompt is not None and pool.index is not None
    holder = pool.pick(prompt=prompt)
    holder.prefill_until = 0.0
    assert all(b.service_s is None for b in pool.backends)
    holder.outstanding = holder.batch  # every slot taken, by this worker
    order, hold, patience = pool.ranked(prompt=prompt)
    assert (order[0], hold) == (holder, 1)
    # Worth waiting for up to what prefilling it elsewhere would cost, less its wait.
    other = next(b for b in pool.backends if b is not holder)
    lacks = pool.index.uncached_tokens(other.name, prompt)
    assert 0 < patience < lacks * pool.prefill_s_per_token * (1 + CACHE_USE)
    # Measured, a slow engine's full batch is a long wait: then prefilling elsewhere wins.
    for backend in pool.backends:
        backend.service_s = 60.0
    assert pool.ranked(prompt=prompt)[0][0] is other


def test_a_prompt_the_index_forgot_goes_back_to_the_replica_it_was_last_sent_to() -> None:
    """The index forgets a prompt beyond what a replica's cache holds, but vLLM evicts a
    prompt from its end, and sending it anew elsewhere copies it and evicts another prompt
    there: a forgotten prompt goes back where it went last, even where another replica has
    room to spare (the rule for prompts never seen)."""
    pool = chat_pool("a", "b", prefill_ms_per_1k_tokens=60)
    index = pool.index
    assert index is not None
    prompt = prompt_of(turns("Old instructions. " * 60, "q"))
    assert prompt is not None
    first = pool.pick(prompt=prompt)
    other = next(b for b in pool.backends if b is not first)
    # Other prompts fill the first replica's room: it forgets this one.
    index.resize(first.name, len(prompt.blocks) * 2 * BLOCK_CHARS // 4)
    for i in range(3):
        newer = prompt_of(turns(f"Newer {i}. " * 120, "q"))
        assert newer is not None
        index.add(first.name, newer.blocks, time.monotonic())
    first.prefill_until = 0.0
    assert index.matched(first.name, prompt) == index.matched(other.name, prompt) == 0
    assert index.idle_s(other.name, time.monotonic()) == float("inf")  # room to spare there
    assert index.last_sent(prompt) == first.name
    assert pool.pick(prompt=prompt) is first
    # A prompt never sent anywhere has no last replica: it goes where there is room.
    never = prompt_of(turns("Never seen. " * 60, "q"))
    assert never is not None and index.last_sent(never) is None
    assert pool.preferred(prompt=never)[0] is other
    # What it remembers is bounded: the oldest prompts' replicas go first.
    for block in range(LAST_SENT_KEPT):
        index.add(other.name, [block], time.monotonic())
    assert index.last_sent(prompt) is None
    assert index.last_sent(Prompt((LAST_SENT_KEPT - 1,), BLOCK_CHARS)) == other.name


def test_a_slow_replica_prefills_slower_and_a_busy_prefill_lane_counts() -> None:
    pool = chat_pool("fast", "slow", prefill_ms_per_1k_tokens=60)
    fast, slow = pool.backends
    fast.service_s, slow.service_s = 0.4, 1.2
    long = prompt_of(turns("Be brief. " * 400, "q"))  # ~1,000 tokens
    assert long is not None and pool.index is not None
    pool.index.add("slow", long.blocks, 0.0)
    for backend in pool.backends:
        load(backend, waiting=0, running=1)
    # Held there: its prefill of what is left, three times slower, still beats 1,000 tokens.
    assert pool.preferred(prompt=long)[0] is slow
    # Five cold prompts just sent to the slow replica: it is busy prefilling them for a while.
    for i in range(5):
        other = prompt_of(turns(f"Other {i}. " * 400, "q"))
        assert other is not None
        pool.hold("slow", other)
    assert slow.prefill_until - time.monotonic() > 5 * 0.06 * 3 * 0.9
    assert pool.preferred(prompt=long)[0] is fast


def test_the_index_forgets_what_the_engines_cache_cannot_hold() -> None:
    pool = chat_pool("a", "b", cache_tokens=1_000_000)
    a, _ = pool.backends
    index = pool.index
    assert index is not None
    a.take_signals(parse_signals("vllm", CACHE_CONFIG.replace("\\\n", ""), time.time()))
    assert a.cache_tokens == 8192 * 128
    prompts = [prompt_of(turns(f"{i} " * 1000, "q")) for i in range(3)]
    n = len(prompts[0].blocks) if prompts[0] else 0
    # Room for two prompts but one block, at 4 bytes a token (until the engines' usage tells).
    index.resize("a", (2 * n - 1) * BLOCK_CHARS // 4)
    for prompt in prompts:
        assert prompt is not None and len(prompt.blocks) == n
        index.add("a", prompt.blocks, 0.0)
    assert index.size("a") == 2 * n - 1
    # The oldest went, and the next one from its end: its beginning still matches.
    assert [index.matched("a", p) for p in prompts if p] == [0, n - 1, n]
    recent = prompt_of(turns("r " * 40, "q"))
    assert recent is not None
    index.add("a", recent.blocks, 0.0)
    assert index.matched("a", recent) == len(recent.blocks)


def test_what_the_engine_reports_it_found_resizes_the_index() -> None:
    """vLLM with --enable-prompt-tokens-details says how much of each prompt it found cached:
    less than the index expected shrinks that replica's room (the engine holds less than the
    index thinks: running requests' blocks take part of its cache), more grows it, within
    bounds; placements it never confirms change nothing."""
    pool = chat_pool("a", "b", cache_tokens=100_000)
    index = pool.index
    assert index is not None
    a, _ = pool.backends

    def seen(name: str) -> dict[str, Any]:  # as /admin/backends shows it
        replicas: dict[str, dict[str, Any]] = index.view()["replicas"]  # type: ignore[assignment]
        return replicas[name]

    prompt = prompt_of(turns("A long shared instruction. " * 200, "q"))
    assert prompt is not None and len(prompt.blocks) > 10
    pool.placed(a, prompt)  # the index expected nothing: it is new ...
    index.confirm("a", prompt, cached_tokens=0)  # ... and the engine found nothing
    assert seen("a")["fit"] == 1.0
    pool.placed(a, prompt)  # now the index expects every block
    index.confirm("a", prompt, cached_tokens=0)  # but the engine had evicted them
    assert seen("a")["fit"] < 1.0
    index.resize("a", None)
    assert seen("a")["room"] < 100_000 * 4 // BLOCK_CHARS
    for _ in range(200):  # it keeps finding more than the index expected: bounded growth
        index.expect("a", prompt, len(prompt.blocks))
        index.confirm("a", prompt, cached_tokens=10**6)
    assert seen("a")["fit"] == 1.5
    index.confirm("b", prompt, cached_tokens=0)  # never placed there: nothing to compare
    assert "b" not in index.view()["replicas"]  # type: ignore[operator]


async def test_workers_learn_each_others_placements(clean_redis: RedisProcess) -> None:
    redis = Redis.from_url(clean_redis.url)
    pools = [chat_pool("a", "b", "c"), chat_pool("a", "b", "c")]  # two workers
    shares = [PrefixShare(redis, Router([spec(n) for n in "abc"]).by_key) for _ in pools]
    for pool, share in zip(pools, shares, strict=True):
        pool.on_placed = share.placed
        share._pool_of = {pool.key: pool}.get  # each its own worker's pools
    following = [asyncio.create_task(share.run()) for share in shares]
    try:
        await asyncio.sleep(0.1)  # both follow the stream from here
        prompt = prompt_of(turns("Shared across the fleet. " * 30, "q"))
        assert prompt is not None
        placed = pools[0].pick(prompt=prompt)
        other = pools[1]
        for _ in range(100):
            if other.index and other.index.matched(placed.name, prompt):
                break
            await asyncio.sleep(0.02)
        assert other.index is not None
        assert other.index.matched(placed.name, prompt) == len(prompt.blocks)
        # The second worker now sends that prompt's kind where the first put it.
        twin = next(b for b in other.backends if b.name == placed.name)
        assert other.preferred(prompt=prompt_of(turns("Shared across the fleet. " * 30,
                                                      "another")))[0] is twin
        # A worker skips its own entries: nothing of the first worker's came back doubled.
        assert pools[0].index is not None and pools[0].index.size(placed.name) == len(
            prompt.blocks)
    finally:
        for task in following:
            await stop_task(task)  # redis-py can swallow a cancellation: stop_task cancels again
        for share in shares:
            await share.close()
        await redis.aclose()


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
    prompt = prompt_of(turns("shared", "hi"))
    rng = random.Random(3)
    assert {pool.pick(prompt=prompt, rng=rng).name for _ in range(40)} == {"a", "b"}
    assert pool.index is None
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


@pytest.mark.parametrize("reserving", [False, True])
def test_prompts_ranked_while_others_wait_for_their_slots_see_those_prefills(
        reserving: bool) -> None:
    """Requests arriving at once are each ranked before any of them is bound (each waits for
    its slot's script call). One new prompt was placed; five more arrive: counted as they
    wait (`Pool.reserved`), each one's prefill on the replica it ranked first spreads them
    three and three; uncounted, all five saw only the first's backlog and went to the other
    replica (as on real vLLM: loadtests.real_routing, 2026-11-29)."""
    pool = chat_pool("a", "b", prefill_ms_per_1k_tokens=60)
    prompts = [prompt_of(turns(f"System prompt number {i}. " * 60, "q")) for i in range(6)]
    first = pool.ranked(prompt=prompts[0]).order[0]
    pool.placed(first, prompts[0])

    def backlog() -> dict[str, float]:  # prefill work each was sent, not yet done (seconds)
        now = time.monotonic()
        return {b.name: max(0.0, b.prefill_until - now) for b in pool.backends}

    before = backlog()
    assert sorted(before.values())[0] == 0 and sorted(before.values())[1] > 0
    firsts = [first.name]
    with contextlib.ExitStack() as waiting:
        for prompt in prompts[1:]:
            ranked_first = pool.ranked(prompt=prompt).order[0]
            if reserving:
                waiting.enter_context(pool.reserved(ranked_first, prompt))
            firsts.append(ranked_first.name)
    assert sorted(Counter(firsts).values()) == ([3, 3] if reserving else [1, 5])
    # Bound or gone, a wait's prefill leaves the backlog as it found it.
    assert backlog() == pytest.approx(before, abs=0.01)
