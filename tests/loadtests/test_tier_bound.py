"""The overload model (loadtests/tier_bound.py): its schedulers keep the tier order, lose no
work, and bound what the overload benchmark's targets can ask."""

from __future__ import annotations

import pytest

from loadtests import tier_bound
from loadtests.overload import MIXES, p99
from loadtests.tier_bound import FIRST_S, SERVICE_S, ratios, simulate, tier_rates


@pytest.mark.parametrize("scheduler", tier_bound.SCHEDULERS)
def test_a_light_load_runs_every_request_at_once(scheduler: str) -> None:
    out = simulate(tier_rates(MIXES["lower"], 0.05), 400, 3, scheduler)
    assert all(out.ttfts.values())
    assert all(t == pytest.approx(FIRST_S) for ttfts in out.ttfts.values() for t in ttfts)
    assert not any(out.refused.values())


def test_at_twice_the_capacity_the_strict_order_serves_the_tiers_by_priority() -> None:
    out = simulate(tier_rates(MIXES["lower"], 2.0), 600, 5, "strict")
    worst = {tier: p99(ttfts) for tier, ttfts in out.ttfts.items()}
    assert worst["max"] < worst["pro"] < worst["basic"]
    assert out.refused["max"] == out.refused["pro"] == 0
    assert out.refused["basic"] > 0 and out.refused["guest"] > 0
    assert not out.ttfts["guest"] or max(out.ttfts["guest"]) <= 2 + FIRST_S  # its longest wait
    assert out.use > 0.98


def test_preemption_stops_lower_tiers_for_max_and_loses_no_work() -> None:
    out = simulate(tier_rates(MIXES["lower"], 2.0), 600, 5, "preempt")
    assert max(out.ttfts["max"]) == pytest.approx(FIRST_S)  # never waits: Basic makes way
    # Every request that ended ran its whole service once, however often it was stopped.
    ended = out.busy_s / SERVICE_S
    assert ended == pytest.approx(round(ended), abs=1e-6)
    assert round(ended) <= sum(len(t) for t in out.ttfts.values())


def test_the_paid_mix_asks_pro_more_than_any_scheduler_can_give() -> None:
    """The paying tiers fill 90 % of the pool: Pro waits behind Max even when every lower
    request makes way, far beyond 3 x the half-load p99 of the dispatcher's own order."""
    strict = ratios(MIXES["paid"], 2000, 1, "strict")
    preempt = ratios(MIXES["paid"], 2000, 1, "preempt")
    assert preempt.pro_over > 3 * strict.pro_half
    # On the four-tier mix the same order stays within both targets' reach.
    lower = ratios(MIXES["lower"], 2000, 1, "strict")
    assert lower.max_ratio < 2 and lower.pro_ratio < 3


def test_the_command_prints_a_row_per_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    tier_bound.main(["--runs", "2", "--seconds", "60"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == list(tier_bound.SCHEDULERS)


@pytest.mark.parametrize("argv", [["--runs", "0"], ["--schedulers", "fifo"],
                                  ["--mix", "all"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        tier_bound.main(argv)
    assert exit_.value.code == 2
