"""Network mode's building blocks: pools by mode, n distinct backends, fingerprints, the quorum
verdict, the task address, and redundant runs (real asyncio tasks, real vLLM simulators)."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import random
from typing import Any

import aiohttp
import pytest

from proxy.config import BackendSpec, HealthSection
from proxy.errors import ErrorKind, GatewayError
from proxy.upstream.fleet_state import FleetRecord
from proxy.upstream.health import Probe
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.quorum import FAILED, Verdict, decide, fingerprint, task_address
from proxy.upstream.redundant import run_redundant
from proxy.upstream.router import Router
from tests.support.upstreams import SimulatorFactory

BIG = "acme/gpt-oss-120b"
SMALL = "acme/small-chat"


def spec(name: str, models: tuple[str, ...] = (BIG,), modes: tuple[str, ...] = ("direct",),
         kind: str = "vllm", url: str | None = None, **extra: object) -> BackendSpec:
    return BackendSpec(name=name, kind=kind, url=url or f"http://{name}:8000",  # type: ignore[arg-type]
                       models=list(models), modes=list(modes), **extra)  # type: ignore[arg-type]


def fleet() -> Router:
    return Router([
        spec("both", modes=("direct", "network")),
        spec("net-1", modes=("network",)),
        spec("net-2", modes=("network",)),
        spec("small", models=(SMALL,)),
        spec("tts", models=("acme/csm-1b",), kind="tts"),
        spec("img", models=("acme/image-gen",), kind="image", provider="acme"),
        spec("img-net", models=("acme/image-gen",), kind="image", provider="other",
             modes=("network",)),
    ])


# --- Router by mode ---------------------------------------------------------------------------

def test_pools_by_mode() -> None:
    router = fleet()
    assert [b.name for b in router.pool("chat", BIG).backends] == ["both"]
    assert [b.name for b in router.pool("chat", BIG, "network").backends] == [
        "both", "net-1", "net-2"]
    assert router.chat_pool(BIG) is router.pool("chat", BIG, "direct")
    assert router.has_pool("chat", BIG, "direct") and router.has_pool("chat", BIG, "network")
    assert not router.has_pool("chat", SMALL, "network")
    assert not router.has_pool("tts", BIG, "direct")
    assert not router.has_pool("chat", "nope", "direct")
    assert router.modes(BIG) == ["direct", "network"]
    assert router.modes(SMALL) == ["direct"]
    assert router.modes("acme/image-gen") == ["direct", "network"]
    assert router.modes("nope") == []
    assert router.chat_models == [BIG, SMALL]  # each model once, whatever its modes


def test_pool_404s_name_what_is_missing() -> None:
    router = fleet()
    cases = [
        (("chat", "nope"), "model 'nope' does not exist"),
        (("chat", "nope", "network"), "model 'nope' does not exist"),
        (("tts", BIG), f"model '{BIG}' is not a"),
        (("tts", BIG, "network"), f"model '{BIG}' is not a"),
        (("chat", SMALL, "network"), f"model '{SMALL}' is not offered in network mode"),
    ]
    for args, message in cases:
        with pytest.raises(GatewayError) as caught:
            router.pool(*args)
        assert caught.value.kind is ErrorKind.NOT_FOUND
        assert message in caught.value.message, (args, caught.value.message)


def test_network_only_model_has_no_direct_pool() -> None:
    router = Router([spec("a", modes=("network",)), spec("b", modes=("network",))])
    assert router.modes(BIG) == ["network"]
    assert router.chat_models == [BIG]
    with pytest.raises(GatewayError, match="not offered in direct mode"):
        router.chat_pool(BIG)


def test_provider_pools_are_direct() -> None:
    router = fleet()
    assert router.providers("image") == ["acme"]  # img-net serves network mode only
    assert [b.name for b in router.provider_pool("image", "acme", None).backends] == ["img"]


def test_ejection_cap_counts_every_pool_a_backend_is_in() -> None:
    router = fleet()
    both = router.backends[0]
    assert len(both.peers) == 2
    assert {len(p) for p in both.peers} == {1, 3}


# --- pick_distinct ----------------------------------------------------------------------------

def network_pool(n: int = 3, max_concurrency: int = 64) -> Pool:
    router = Router([spec(f"n{i}", modes=("network",), max_concurrency=max_concurrency)
                     for i in range(n)],
                    HealthSection(consecutive_failures=1, max_ejected_ratio=1.0))
    return router.pool("chat", BIG, "network")


def test_pick_distinct_gives_distinct_backends_least_busy_first() -> None:
    pool = network_pool(4)
    a, b, c, d = pool.backends
    a.outstanding, b.outstanding, c.outstanding, d.outstanding = 5, 0, 3, 1
    assert pool.pick_distinct(2) == [b, d]
    assert pool.pick_distinct(4) == [b, d, c, a]
    rng = random.Random(3)
    for _ in range(50):
        picked = pool.pick_distinct(3, rng)
        assert len(set(picked)) == 3


def test_pick_distinct_spreads_equals_at_random() -> None:
    pool = network_pool(4)
    rng = random.Random(11)
    seen = {tuple(b.name for b in pool.pick_distinct(2, rng)) for _ in range(200)}
    assert len(seen) > 6  # not always the first two in config order


def test_pick_distinct_skips_unhealthy_and_full_backends() -> None:
    pool = network_pool(4, max_concurrency=2)
    ejected, full, fine_1, fine_2 = pool.backends
    assert ejected.record_failure() and not ejected.healthy
    full.outstanding = 2
    picked = pool.pick_distinct(2)
    assert set(picked) == {fine_1, fine_2}
    with pytest.raises(GatewayError) as caught:
        pool.pick_distinct(3)
    error = caught.value
    assert error.kind is ErrorKind.UNAVAILABLE and error.status == 503
    assert error.headers["Retry-After"] == "1"
    assert error.message == f"model '{BIG}' has fewer than 3 backends free for network mode"


def test_pick_distinct_waits_for_supervised_backends() -> None:
    router = Router([spec("a", modes=("network",), command=["true"]),
                     spec("b", modes=("network",))])
    pool = router.pool("chat", BIG, "network")
    with pytest.raises(GatewayError, match="fewer than 2 backends"):
        pool.pick_distinct(2)  # `a` has no word from its supervisor yet
    assert pool.healthy  # but `b` is
    a = pool.backends[0]
    a.record = FleetRecord(state="ready", since=0.0, pid=1)
    a.health.record_probe(0.0, Probe.DEEP, ok=True)  # proven by its first probe
    assert len(pool.pick_distinct(2)) == 2


def test_pick_distinct_needs_a_positive_count() -> None:
    with pytest.raises(ValueError):
        network_pool().pick_distinct(0)


# --- fingerprint ------------------------------------------------------------------------------

def completion(content: str | None = "hello world", finish: str = "stop",
               tool: tuple[str, str] | None = None, **envelope: object) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool is not None:
        message["tool_calls"] = [{"id": "call_1", "type": "function",
                                  "function": {"name": tool[0], "arguments": tool[1]}}]
    body: dict[str, Any] = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": BIG,
        "system_fingerprint": "fp-a",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    body.update(envelope)
    return body


def test_chat_fingerprint_ignores_ids_timestamps_and_usage() -> None:
    base = fingerprint(completion())
    other = completion(id="chatcmpl-2", created=99, system_fingerprint="fp-b",
                       usage={"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16})
    other["choices"][0]["logprobs"] = {"content": []}
    assert fingerprint(other) == base
    assert len(base) == 64 and int(base, 16) >= 0
    assert fingerprint(copy.deepcopy(completion())) == base  # stable


def test_chat_fingerprint_sees_content_finish_and_tool_calls() -> None:
    base = fingerprint(completion())
    assert fingerprint(completion("hello there")) != base
    assert fingerprint(completion(finish="length")) != base
    call = fingerprint(completion(None, "tool_calls", ("get_weather", '{"city":"Paris"}')))
    assert call != base
    # Tool call ids are random per server; arguments compare as JSON.
    again = completion(None, "tool_calls", ("get_weather", '{ "city": "Paris" }'))
    again["choices"][0]["message"]["tool_calls"][0]["id"] = "call_other"
    assert fingerprint(again) == call
    assert fingerprint(completion(None, "tool_calls", ("get_weather", '{"city":"Rome"}'))) != call
    assert fingerprint(completion(None, "tool_calls", ("get_time", '{"city":"Paris"}'))) != call


def test_chat_fingerprint_covers_every_choice_in_index_order() -> None:
    two = completion()
    second = copy.deepcopy(two["choices"][0])
    second.update(index=1, message={"role": "assistant", "content": "bye"})
    two["choices"].append(second)
    swapped = copy.deepcopy(two)
    swapped["choices"].reverse()
    assert fingerprint(two) == fingerprint(swapped) != fingerprint(completion())


def test_bytes_asr_and_other_fingerprints() -> None:
    audio = b"RIFF....WAVEfmt "
    assert fingerprint(audio) == hashlib.sha256(audio).hexdigest()
    assert fingerprint(bytearray(audio)) == fingerprint(audio)
    assert fingerprint(audio + b"\0") != fingerprint(audio)
    asr = fingerprint({"text": "Hello  world.\n", "duration": 1.5})
    assert asr == fingerprint({"text": " hello world. ", "duration": 1.6, "language": "en"})
    assert asr != fingerprint({"text": "hello word."})
    assert fingerprint({"b": 1, "a": [1, 2]}) == fingerprint({"a": [1, 2], "b": 1})
    assert fingerprint({"a": [1, 2]}) != fingerprint({"a": [2, 1]})
    assert fingerprint({"text": "x"}) != fingerprint("x")


# --- decide -----------------------------------------------------------------------------------

def test_decide_agreement() -> None:
    verdict = decide([("a", "x"), ("b", "x")], str, quorum=2)
    assert verdict.agreed and verdict.answer == "x"
    assert (verdict.agreeing, verdict.replicas, verdict.quorum) == (2, 2, 2)
    assert verdict.backends == ["a", "b"] and verdict.fingerprints == ["x", "x"]
    assert verdict.winner == "x" and verdict.agreeing_backends == ["a", "b"]
    assert verdict.failures == []


def test_decide_disagreement_and_tie() -> None:
    split = decide([("a", "x"), ("b", "y")], str, quorum=2)
    assert not split.agreed and split.answer is None and split.agreeing == 1
    assert split.agreeing_backends == []
    tie = decide([("a", "x"), ("b", "x"), ("c", "y"), ("d", "y")], str, quorum=2)
    assert not tie.agreed and tie.answer is None and tie.agreeing == 2
    majority = decide([("a", "x"), ("b", "y"), ("c", "x")], str, quorum=2)
    assert majority.agreed and majority.answer == "x" and majority.agreeing_backends == ["a", "c"]
    low = decide([("a", "x"), ("b", "y"), ("c", "x")], str, quorum=1)
    assert low.agreed and low.answer == "x"  # the largest group still wins


def test_decide_first_answer_of_the_winning_group_is_returned() -> None:
    answers = [completion(id="one"), completion(id="two")]
    verdict = decide([("a", answers[0]), ("b", answers[1])], fingerprint, quorum=2)
    assert verdict.answer is answers[0]


def test_decide_failures_count_as_disagreement() -> None:
    boom = GatewayError(ErrorKind.UPSTREAM_ERROR, "backend 'b' failed")
    verdict = decide([("a", "x"), ("b", boom), ("c", "x")], str, quorum=2)
    assert verdict.agreed and verdict.answer == "x"
    assert verdict.fingerprints == ["x", FAILED, "x"] and verdict.failures == [("b", boom)]
    short = decide([("a", "x"), ("b", boom)], str, quorum=2)
    assert not short.agreed and short.agreeing == 1
    none = decide([("a", boom), ("b", boom)], str, quorum=2)
    assert not none.agreed and none.agreeing == 0 and len(none.failures) == 2


def test_decide_an_answer_that_cannot_be_fingerprinted_is_a_failure() -> None:
    verdict: Verdict[object] = decide([("a", {"x": 1}), ("b", {"x": object()})], fingerprint,
                                      quorum=1)
    assert verdict.agreed and verdict.answer == {"x": 1}
    assert verdict.fingerprints[1] == FAILED and verdict.failures[0][0] == "b"
    with pytest.raises(ValueError):
        decide([("a", "x")], str, quorum=0)


# --- task_address -----------------------------------------------------------------------------

def test_task_address_is_stable_and_specific() -> None:
    fps = [fingerprint(b"a"), fingerprint(b"b")]
    address = task_address("req-1", BIG, fps)
    assert len(address) == 64 and all(c in "0123456789abcdef" for c in address)
    assert task_address("req-1", BIG, list(reversed(fps))) == address  # replica order: no matter
    assert task_address("req-1", BIG, tuple(fps)) == address
    assert task_address("req-2", BIG, fps) != address
    assert task_address("req-1", SMALL, fps) != address
    assert task_address("req-1", BIG, fps[:1]) != address
    # No ambiguity where one field ends and the next begins.
    assert task_address("a", "bc", []) != task_address("ab", "c", [])


# --- run_redundant ----------------------------------------------------------------------------

async def test_run_redundant_runs_concurrently_and_decides() -> None:
    started: list[str] = []
    both_started = asyncio.Event()

    async def run_one(name: str) -> str:
        started.append(name)
        if len(started) == 3:
            both_started.set()
        await asyncio.wait_for(both_started.wait(), 2)  # deadlocks unless concurrent
        if name == "c":
            raise GatewayError(ErrorKind.UPSTREAM_TIMEOUT, "backend 'c' did not answer in time")
        return "answer"

    verdict = await run_redundant(["a", "b", "c"], run_one, key=str, quorum=2, name=str)
    assert verdict.agreed and verdict.answer == "answer" and verdict.agreeing == 2
    assert verdict.backends == ["a", "b", "c"] and verdict.fingerprints[2] == FAILED
    assert isinstance(verdict.failures[0][1], GatewayError)


async def test_run_redundant_cancellation_reaches_every_replica() -> None:
    running = 0
    cleaned: list[str] = []
    entered = asyncio.Event()

    async def run_one(name: str) -> str:
        nonlocal running
        running += 1
        if running == 2:
            entered.set()
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits (closing an upstream request)
            cleaned.append(name)
        return name

    task = asyncio.create_task(run_redundant(["a", "b"], run_one, key=str, quorum=2, name=str))
    await asyncio.wait_for(entered.wait(), 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cleaned) == ["a", "b"]  # both replicas stopped before the caller went on


async def test_run_redundant_under_a_deadline() -> None:
    async def run_one(name: str) -> str:
        await asyncio.sleep(0 if name == "fast" else 30)
        return name

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await run_redundant(["fast", "slow"], run_one, key=str, quorum=2, name=str)


async def test_run_redundant_a_replica_cancelled_on_its_own_is_a_failure() -> None:
    async def run_one(name: str) -> str:
        if name == "b":
            raise asyncio.CancelledError
        return "x"

    verdict = await run_redundant(["a", "b", "c"], run_one, key=str, quorum=2, name=str)
    assert verdict.agreed and verdict.fingerprints == ["x", FAILED, "x"]


# --- real simulators --------------------------------------------------------------------------

CHAT = {"model": BIG, "messages": [{"role": "user", "content": "Say something."}],
        "temperature": 0.8, "seed": 0}


async def ask(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
              headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def test_two_simulated_replicas_agree_with_the_same_seed(
        simulator: SimulatorFactory) -> None:
    servers = [await simulator(models=(BIG,)), await simulator(models=(BIG,))]
    backends = [Backend(spec(f"sim-{i}", modes=("network",), url=str(s.make_url("")).rstrip("/")))
                for i, s in enumerate(servers)]
    async with aiohttp.ClientSession() as session:
        async def run_one(backend: Backend, body: dict[str, Any] = CHAT) -> dict[str, Any]:
            return await ask(session, backend.base_url, body)

        verdict = await run_redundant(backends, run_one, key=fingerprint, quorum=2,
                                      name=lambda b: b.name)
        assert verdict.agreed, verdict
        assert verdict.answer is not None and verdict.answer["choices"][0]["message"]["content"]
        # The envelopes differ (random ids), yet the fingerprints agree.
        first, second = [await run_one(b) for b in backends]
        assert first["id"] != second["id"]
        assert fingerprint(first) == fingerprint(second) == verdict.winner

        # A tool call: each server makes up its own call id; the call itself agrees.
        tools = {**CHAT, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}}}}}], "tool_choice": "required"}
        calls = await run_redundant(backends, lambda b: run_one(b, tools), key=fingerprint,
                                    quorum=2, name=lambda b: b.name)
        assert calls.agreed
        assert calls.answer is not None and calls.answer["choices"][0]["message"]["tool_calls"]

        # Another seed is another answer.
        other_seed = await ask(session, backends[0].base_url, {**CHAT, "seed": 1})
        assert fingerprint(other_seed) != verdict.fingerprints[0]


async def test_simulated_replicas_disagree_when_one_answers_differently(
        simulator: SimulatorFactory) -> None:
    servers = [await simulator(models=(BIG,)), await simulator(models=(BIG,))]
    urls = [str(s.make_url("")).rstrip("/") for s in servers]
    async with aiohttp.ClientSession() as session:
        async def run_one(i: int) -> dict[str, Any]:
            headers = {"x-sim-tokens": "5"} if i == 1 else None
            return await ask(session, urls[i], CHAT, headers)

        verdict = await run_redundant([0, 1], run_one, key=fingerprint, quorum=2,
                                      name=lambda i: f"sim-{i}")
    assert not verdict.agreed and verdict.answer is None
    assert verdict.agreeing == 1 and len(set(verdict.fingerprints)) == 2
    assert verdict.backends == ["sim-0", "sim-1"]
