"""The gateway's queue (proxy.upstream.queue), without I/O: strict tier order, accounts taking
turns within a tier (fair queuing tags), leaving, and expected waits."""

from __future__ import annotations

from proxy.config import TierPolicy
from proxy.upstream.queue import Drain, Ticket, TierQueue, Turns, Waiter, ticket_for


def ticket(tier: str, priority: int, account: str) -> Ticket:
    return Ticket(tier, priority, account, 30.0)


async def test_higher_priority_first_then_the_smallest_turn() -> None:
    queue = TierQueue()
    turns = Turns()
    # a's burst of three, then b's two, then c's one, all of one tier: tagged by turns.
    waiters = []
    for account, name in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("b", "b2"),
                          ("c", "c1")]:
        tag = turns.tag(account)
        turns.queued(account, tag)
        waiters.append(Waiter(ticket("basic", 1, account), tag=tag, want=name))
    assert [w.tag for w in waiters] == [0, 1, 2, 0, 1, 0]
    for waiter in waiters:
        queue.push(waiter)
    queue.push(Waiter(ticket("max", 3, "m"), want="m1"))
    queue.push(Waiter(ticket("pro", 2, "p"), want="p1"))
    assert len(queue) == 8
    assert queue.ahead(1) == 8 and queue.ahead(2) == 2 and queue.ahead(3) == 1
    # A new request of tier 1 with tag 1 waits behind both higher tiers and the three 0s.
    assert queue.ahead(1, tag=1) == 2 + 3 and queue.ahead(0) == 8
    assert queue.depth() == {"basic": 6, "max": 1, "pro": 1}
    order = []
    while (waiter := queue.pop()) is not None:
        order.append(waiter.want)
        if waiter.ticket.tier == "basic":
            turns.served(waiter.ticket.account, waiter.tag)
    # Max, then Pro, then Basic by turns (arrival order among equal turns): a's burst
    # interleaved with the others' requests.
    assert order == ["m1", "p1", "a1", "b1", "c1", "a2", "b2", "a3"]
    assert len(queue) == 0 and queue.pop() is None and queue.peek() is None
    # An account that sent nothing meanwhile runs at the next turn; a's backlog is behind it.
    assert turns.now == 2 and turns.tag("d") == 2 and turns.tag("a") == 3


def test_a_turn_given_up_is_the_accounts_again() -> None:
    turns = Turns()
    first = turns.tag("a")
    turns.queued("a", first)
    second = turns.tag("a")
    turns.queued("a", second)
    turns.left("a", first)  # not its last: its turns stay as they were
    assert turns.tag("a") == 2
    turns.left("a", second)
    assert turns.tag("a") == 1


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
    # Within 0.5 s with 4 slots held 0.2 s each: 9 ahead at most (10 x 0.2 / 4 = 0.5).
    drain.held_s = 0.2
    assert drain.most_ahead(0.5, 4) == 9 and drain.most_ahead(0.1, 1) == -1


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
