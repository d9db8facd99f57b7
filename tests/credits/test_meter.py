"""The meter on its own: one request's money from its worst case to its one settlement, against
a real redis-server (the ledger's scripts) with no gateway around it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import ModelPrice, PricesPolicy, TierPolicy
from proxy.credits.admission import Admitter
from proxy.credits.ledger import Ledger
from proxy.credits.meter import Meter, Metering, Result, Stage
from proxy.credits.pricing import Units
from proxy.credits.settler import Settler
from proxy.errors import ErrorKind, GatewayError
from proxy.identity.principal import Principal
from proxy.observe.metrics import Labels, Metrics
from proxy.outcome import Outcome
from proxy.store.client import connect_redis
from proxy.store.redis_process import RedisProcess

MODEL = "acme/small-chat"
# 1 micro-credit per prompt token, 2 per completion token, 1,000 per character, per audio second.
PRICES = PricesPolicy(default=ModelPrice(
    prompt_per_1k_tokens=1000, completion_per_1k_tokens=2000, per_1k_characters=1_000_000,
    per_audio_second=1000), hold_ttl_s=60)
TIER = TierPolicy(requests_per_minute=1000, families=["chat", "tts", "asr"],
                  models={"*": ["direct"]})
KEYED = Principal(kind="key", account="acct-meter", tier="basic", key_id="key_1")
GUEST = Principal(kind="guest", account="guest:127.0.0.1", tier="guest")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 92}]}  # 100 bytes bound


@dataclass
class Books:
    metering: Metering
    ledger: Ledger
    settler: Settler

    async def flushed(self) -> None:
        await self.settler.flush()


@pytest.fixture
async def books(clean_redis: RedisProcess) -> AsyncIterator[Books]:
    redis = connect_redis(clean_redis.url)
    ledger = Ledger(redis)
    metrics = Metrics(Labels([MODEL], lambda: {"basic", "guest"}, []), CollectorRegistry())
    admitter = Admitter(ledger, redis)
    settler = Settler(ledger.primaries, [ledger.settle_script], metrics)
    await ledger.credit(KEYED.account, 1_000_000, {"by": "test"})
    yield Books(Metering(admitter, settler, ledger.settle_script, metrics), ledger, settler)
    await admitter.close()
    await settler.drain(timeout_s=5)
    await ledger.close()
    await redis.aclose()


def chat_meter(books: Books, principal: Principal = KEYED, cap: int = 10) -> Meter:
    return books.metering.chat(PRICES, principal, MODEL, "direct", "openai", "req-1", BODY, cap)


async def charges(books: Books) -> list[dict[str, object]]:
    return [e for e in await books.ledger.all_entries(KEYED.account) if e["type"] == "charge"]


async def test_a_chat_request_holds_its_worst_case_then_pays_what_it_used(books: Books) -> None:
    meter = chat_meter(books)
    assert meter.hold is not None and meter.hold.amount == 100 + 2 * 10  # prompt bound + cap
    assert meter.stage is Stage.BEFORE
    window = await meter.admit(TIER)
    assert meter.stage is Stage.ADMITTED and window.remaining == 999
    assert (await books.ledger.balance(KEYED.account)).held == 120

    result = Result()
    result.answered(usage={"prompt_tokens": 30, "completion_tokens": 5})
    result.delivered()
    assert meter.settle(result) == (30 + 2 * 5, {"prompt_tokens": 30, "completion_tokens": 5})
    await books.flushed()
    balance = await books.ledger.balance(KEYED.account)
    assert (balance.held, balance.spent, balance.available) == (0, 40, 1_000_000 - 40)
    [entry] = await charges(books)
    assert entry["status"] == "completed" and entry["cost"] == 40 and entry["held"] == 120


async def test_settle_is_once_and_only_for_what_admission_may_have_held(books: Books) -> None:
    never_admitted = chat_meter(books)
    assert never_admitted.settle(Result(status=Outcome.UPSTREAM_ERROR)) is None  # held nothing
    meter = chat_meter(books)
    await meter.admit(TIER)
    assert meter.settle(Result(status=Outcome.UPSTREAM_ERROR)) == (0, {
        "prompt_tokens": 0, "completion_tokens": 0})
    assert meter.settle(Result(status=Outcome.COMPLETED, usage={
        "prompt_tokens": 1, "completion_tokens": 1})) is None  # a second settle: nothing
    assert books.settler.pending == 1
    await books.flushed()
    assert [e["status"] for e in await charges(books)] == ["upstream_error"]
    assert (await books.ledger.balance(KEYED.account)).held == 0


async def test_a_refused_meter_holds_nothing_and_settles_nothing(books: Books) -> None:
    poor = Principal(kind="key", account="acct-poor", tier="basic", key_id="key_2")
    meter = chat_meter(books, poor)
    with pytest.raises(GatewayError) as refused:
        await meter.admit(TIER)
    assert refused.value.kind is ErrorKind.INSUFFICIENT_CREDITS
    assert meter.stage is Stage.REFUSED
    assert meter.settle(Result()) is None and books.settler.pending == 0
    assert await books.ledger.open_holds("acct-poor") == {}


async def test_a_handed_off_hold_is_left_to_the_task_runner(books: Books) -> None:
    meter = chat_meter(books)
    await meter.admit(TIER)
    meter.handed_off()
    assert meter.settle(Result(status=Outcome.CLIENT_GONE)) is None
    assert books.settler.pending == 0
    hold = meter.hold
    assert hold is not None
    assert set(await books.ledger.open_holds(KEYED.account)) == {hold.hold_id}  # still held

    # The runner's meter for the same task settles it, and says it was async.
    again = books.metering.resume(PRICES, KEYED, MODEL, "direct", meter.details, hold, BODY)
    done = Result()
    done.answered(usage={"prompt_tokens": 2, "completion_tokens": 1})
    done.delivered()
    assert again.settle(done) == (4, {"prompt_tokens": 2, "completion_tokens": 1})
    await books.flushed()
    [entry] = await charges(books)
    assert entry["async"] is True and entry["held"] == 120


@dataclass
class Tally:
    usage: dict[str, object] | None
    chunks: int


async def test_a_cut_stream_pays_what_reached_the_client(books: Books) -> None:
    meter = chat_meter(books)
    await meter.admit(TIER)
    cut = Result(status=Outcome.CUT, tally=Tally(usage=None, chunks=3))
    cost, units = meter.settle(cut) or (None, None)
    # The prompt at its upper bound (92 bytes + 8 per message): it reached the engine whole;
    # a token for each content chunk delivered.
    assert units == {"prompt_tokens": 100, "completion_tokens": 3} and cost == 100 + 6
    await books.flushed()
    [entry] = await charges(books)
    assert entry["status"] == "cut" and entry["estimated"] is True


@pytest.mark.parametrize(("status", "charged"), [
    (Outcome.COMPLETED, 5000), (Outcome.CLIENT_GONE, 5000), (Outcome.UPSTREAM_ERROR, 0),
    (Outcome.FAILED, 0)])
async def test_units_are_charged_only_for_an_answer_made(
        books: Books, status: Outcome, charged: int) -> None:
    meter = books.metering.units(PRICES, KEYED, "acme/csm-1b", "direct", "tts", "req-2",
                                 Units(characters=10))
    assert meter.hold is not None and meter.hold.amount == 10_000
    await meter.admit(TIER)
    result = Result(status=status, used=Units(characters=5))
    assert meter.settle(result) == (charged, {"characters": 5} if charged else {})


async def test_a_guest_pays_nothing_but_its_usage_is_journaled(books: Books) -> None:
    meter = chat_meter(books, GUEST)
    assert meter.hold is None
    await meter.admit(TIER)
    result = Result()
    result.answered(usage={"prompt_tokens": 3, "completion_tokens": 4})
    result.delivered()
    assert meter.settle(result) == (0, {"prompt_tokens": 3, "completion_tokens": 4})
    await books.flushed()
    [entry] = await books.ledger.all_entries(GUEST.account)
    assert entry["status"] == "completed"
    assert (entry["prompt_tokens"], entry["completion_tokens"]) == (3, 4)
