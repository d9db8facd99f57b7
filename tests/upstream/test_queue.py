"""The gateway's queue (proxy.upstream.queue), without I/O: strict tier order, accounts taking
turns within a tier, leaving, and expected waits."""

from __future__ import annotations

from proxy.config import TierPolicy
from proxy.upstream.queue import Drain, Ticket, TierQueue, Waiter, ticket_for


def ticket(tier: str, priority: int, account: str) -> Ticket:
    return Ticket(tier, priority, account, 30.0)


async def test_higher_priority_first_and_accounts_take_turns_within_a_tier() -> None:
    queue = TierQueue()
    waiters = [Waiter(ticket("basic", 1, account), want=name) for account, name in [
        ("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("b", "b2")]]
    for waiter in waiters:
        queue.push(waiter)
    queue.push(Waiter(ticket("max", 3, "m"), want="m1"))
    queue.push(Waiter(ticket("pro", 2, "p"), want="p1"))
    assert queue.ahead(1) == 7 and queue.ahead(2) == 2 and queue.ahead(3) == 1
    # A new request's place: a's fourth waits behind all of b's; b's third behind a's three;
    # a new account's first only behind one of each.
    assert queue.place(ticket("basic", 1, "a")) == 2 + 3 + 2
    assert queue.place(ticket("basic", 1, "b")) == 2 + 2 + 3
    assert queue.place(ticket("basic", 1, "c")) == 2 + 0 + 1 + 1
    assert queue.place(ticket("max", 3, "m")) == 1 and queue.place(ticket("guest", 0, "g")) == 7
    assert queue.depth() == {"basic": 5, "max": 1, "pro": 1}
    order = []
    while (waiter := queue.pop()) is not None:
        order.append(waiter.want)
    # Max, then Pro, then Basic with a's burst interleaved with b's requests.
    assert order == ["m1", "p1", "a1", "b1", "a2", "b2", "a3"]
    assert len(queue) == 0 and queue.pop() is None and queue.peek() is None


async def test_a_waiter_that_leaves_is_gone_and_leaving_twice_is_harmless() -> None:
    queue = TierQueue()
    first, second = Waiter(ticket("basic", 1, "a")), Waiter(ticket("basic", 1, "a"))
    queue.push(first)
    queue.push(second)
    first.leave()
    first.leave()
    assert len(queue) == 1 and queue.peek() is second
    second.leave()
    assert len(queue) == 0 and queue.depth() == {}


def test_expected_wait_follows_how_fast_slots_free() -> None:
    drain = Drain(initial_s=1.0)
    assert drain.wait_s(ahead=0, slots=1) == 1.0
    assert drain.wait_s(ahead=3, slots=2) == 2.0
    for _ in range(50):
        drain.observe(0.2)
    assert abs(drain.held_s - 0.2) < 0.01
    assert abs(drain.wait_s(ahead=9, slots=4) - 0.5) < 0.03


def test_a_ticket_knows_the_tiers_above_it() -> None:
    def tier(priority: int, wait: float) -> TierPolicy:
        return TierPolicy(requests_per_minute=10, families=["chat"], models={"*": ["direct"]},
                          priority=priority, max_queue_wait_s=wait)

    tiers = {"guest": tier(0, 2), "basic": tier(1, 5), "pro": tier(2, 15), "max": tier(3, 30)}
    basic = ticket_for("basic", tiers, "acct")
    assert basic == Ticket("basic", 1, "acct", 5.0, (2, 3))
    top = ticket_for("max", tiers, "acct")
    assert top is not None and top.higher == ()
    assert ticket_for("gone", tiers, "acct") is None
