"""Balancing (pure): P2C least-outstanding spreads load by weight, and skips backends that are
ejected, failing their probes or not yet ready under supervision."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from proxy.config import BackendSpec, HealthSection, RoutingSection
from proxy.errors import GatewayError
from proxy.upstream.fleet_state import FleetRecord
from proxy.upstream.health import Probe
from proxy.upstream.pool import Backend
from proxy.upstream.router import Router

MODEL = "acme/small-chat"


def spec(name: str, weight: int = 1, **extra: object) -> BackendSpec:
    return BackendSpec(name=name, kind="vllm", url=f"http://{name}:8000", models=[MODEL],
                       weight=weight, **extra)  # type: ignore[arg-type]


def run_load(router: Router, picks: int, in_flight: int, seed: int = 7) -> Counter[str]:
    """Keep `in_flight` requests running; each finished one is replaced by a new pick."""
    rng = random.Random(seed)
    pool = router.chat_pool(MODEL)
    running: deque[Backend] = deque()
    counts: Counter[str] = Counter()
    for _ in range(picks):
        backend = pool.pick(rng=rng)
        backend.outstanding += 1
        running.append(backend)
        counts[backend.name] += 1
        if len(running) >= in_flight:  # a random request finishes
            done = running[rng.randrange(len(running))]
            running.remove(done)
            done.outstanding -= 1
    return counts


def test_load_spreads_by_weight() -> None:
    router = Router([spec("light", 1), spec("heavy", 3)])
    counts = run_load(router, picks=20_000, in_flight=40)
    ratio = counts["heavy"] / counts["light"]
    assert 2.5 < ratio < 3.5, counts


def test_equal_weights_share_evenly() -> None:
    router = Router([spec("a"), spec("b"), spec("c")])
    counts = run_load(router, picks=9_000, in_flight=30)
    assert all(2_700 < n < 3_300 for n in counts.values()), counts


def test_ejected_backend_gets_nothing_until_it_comes_back() -> None:
    router = Router([spec("a"), spec("b"), spec("c")], HealthSection(consecutive_failures=2))
    a, b, _ = router.backends
    assert not b.record_failure()
    assert b.record_failure() and b.health.ejected and not b.healthy
    counts = run_load(router, picks=3_000, in_flight=10)
    assert counts["b"] == 0 and counts["a"] > 1000
    # The cap: with b out (a third of the pool), a may not follow at ratio 0.5.
    assert not a.record_failure()
    assert not a.record_failure() and a.healthy


def test_probe_failure_and_supervisor_state_take_a_backend_out() -> None:
    router = Router([spec("probed"), spec("supervised", command=["true"]), spec("ok")])
    probed, supervised, _ = router.backends
    probed.health.record_probe(0.0, Probe.CHEAP, ok=False)
    assert not supervised.healthy  # no word from the supervisor yet: starting
    counts = run_load(router, picks=500, in_flight=5)
    assert set(counts) == {"ok"}
    supervised.record = FleetRecord(state="ready", since=0.0, pid=1)
    assert not supervised.healthy  # a process the gateway started is proven by a probe first
    assert supervised.health.probe_kind(0.0) is Probe.DEEP
    supervised.health.record_probe(0.0, Probe.DEEP, ok=True)
    assert supervised.healthy
    supervised.record = FleetRecord(state="unhealthy", since=0.0, pid=1)
    assert not supervised.healthy


def test_all_down_is_an_immediate_503_with_retry_after() -> None:
    router = Router([spec("a"), spec("b")])
    for backend in router.backends:
        backend.health.record_probe(0.0, Probe.CHEAP, ok=False)
    with pytest.raises(GatewayError) as caught:
        router.chat_pool(MODEL).pick()
    assert caught.value.status == 503 and caught.value.headers["Retry-After"] == "1"
    assert "no healthy backend" in caught.value.message


def test_a_vllm_engine_with_a_batch_of_four_or_more_is_sent_one_request_to_queue() -> None:
    """[routing] engine_queue: the next request waits in the engine's own queue, where it
    queues (vLLM; TGI answers 429 beyond its limit) and a higher tier loses little (batch 4+)."""
    specs = [spec("big", max_concurrency=8), spec("small", max_concurrency=3),
             BackendSpec(name="tgi", kind="tgi", url="http://tgi:80", models=[MODEL],
                         max_concurrency=8)]

    def slots(routing: RoutingSection) -> dict[str, tuple[int, int]]:
        return {b.name: (b.batch, b.slots) for b in Router(specs, routing=routing).backends}

    assert slots(RoutingSection()) == {"big": (8, 9), "small": (3, 3), "tgi": (8, 8)}
    assert slots(RoutingSection(engine_queue=2))["big"] == (8, 10)
    assert slots(RoutingSection(engine_queue=0))["big"] == (8, 8)
    # Without the dispatcher each worker caps its own: nothing to hide a hand-off for.
    assert slots(RoutingSection(dispatch=False))["big"] == (8, 8)
    big = Router(specs).backends[0]
    big.outstanding = 8
    assert big.available  # its ninth, to wait in the engine
    big.outstanding = 9
    assert not big.available
