"""The health state machine (no I/O; the clock is passed in): passive ejection (U1), half-open
recovery (U2), the ejection cap, two-tier probes (U6), and the supervisor's restart backoff."""

from __future__ import annotations

import pytest

from proxy.upstream.fleet_state import FleetRecord, RestartBackoff
from proxy.upstream.health import BackendHealth, EjectionPolicy, Probe, ejection_allowed

POLICY = EjectionPolicy(threshold=5, base_s=10.0, max_s=300.0)


def health(deep: bool = True) -> BackendHealth:
    return BackendHealth(POLICY, deep_available=deep)


def fail(h: BackendHealth, now: float, times: int = 1, may_eject: bool = True) -> bool:
    return any([h.record_failure(now, may_eject=may_eject) for _ in range(times)])


def test_ejected_after_n_consecutive_failures_and_not_before() -> None:
    h = health()
    assert not fail(h, 0.0, 4)
    assert h.admits(0.0, 0) and not h.ejected
    assert fail(h, 0.0)
    assert h.ejected and not h.admits(0.0, 0) and h.ejected_until == 10.0


def test_a_success_resets_the_consecutive_count() -> None:
    h = health()
    fail(h, 0.0, 4)
    h.record_success(0.0)
    assert not fail(h, 0.0, 4) and h.admits(0.0, 0)


def test_cool_down_doubles_with_each_ejection_in_a_row_up_to_the_cap() -> None:
    h = health()
    fail(h, 0.0, 5)
    cool_downs = []
    now = 0.0
    for _ in range(8):
        assert h.ejected_until is not None
        cool_downs.append(h.ejected_until - now)
        now = h.ejected_until  # half-open: the trial request fails
        assert h.admits(now, 0)
        assert fail(h, now)
    assert cool_downs == [10, 20, 40, 80, 160, 300, 300, 300]


def test_the_doubling_is_forgotten_after_staying_in_for_max_s() -> None:
    h = health()
    fail(h, 0.0, 5)
    h.record_success(10.0)  # half-open trial succeeds: back in
    fail(h, 20.0, 5)
    assert h.ejected_until == 20.0 + 20  # soon again: the next, longer cool-down
    h.record_success(40.0)
    fail(h, 40.0 + 300, 5)
    assert h.ejected_until == 340.0 + 10  # stayed in for max_s: back to the base


def test_half_open_admits_one_request_at_a_time_and_one_outcome_decides() -> None:
    h = health()
    fail(h, 0.0, 5)
    assert not h.admits(9.9, 0)  # cooling down
    assert h.half_open(10.0) and h.admits(10.0, in_flight=0)
    assert not h.admits(10.0, in_flight=1)  # the trial is running: nobody else
    h.record_success(10.5)
    assert not h.ejected and h.admits(10.5, in_flight=3)
    assert h.consecutive_failures == 0


def test_a_success_during_the_cool_down_does_not_readmit_early() -> None:
    h = health()
    fail(h, 0.0, 5)
    h.record_success(5.0)  # a request started before the ejection
    assert h.ejected and not h.admits(5.0, 0)


@pytest.mark.parametrize(
    ("already", "size", "ratio", "allowed"),
    [
        (0, 1, 0.5, True),  # always one (Envoy's rule), even alone in its pool
        (1, 2, 0.5, False),  # half of two is one
        (0, 2, 0.5, True),
        (1, 4, 0.5, True),
        (2, 4, 0.5, False),
        (2, 10, 0.3, True),
        (3, 10, 0.3, False),
        (0, 3, 0.0, False),  # 0 turns passive ejection off
        (2, 3, 1.0, True),
    ],
)
def test_ejection_cap(already: int, size: int, ratio: float, allowed: bool) -> None:
    assert ejection_allowed(already, size, ratio) is allowed


def test_beyond_the_cap_the_backend_stays_in() -> None:
    h = health()
    assert not fail(h, 0.0, 7, may_eject=False)
    assert h.admits(0.0, 0) and h.consecutive_failures == 7
    assert fail(h, 1.0, may_eject=True)  # room again (another backend came back): now it goes


def test_cheap_probe_while_requests_succeed_deep_while_in_doubt() -> None:
    h = health()
    assert h.probe_kind(0.0) is Probe.CHEAP
    fail(h, 0.0)  # one failed request: health is in doubt
    assert h.probe_kind(0.0) is Probe.DEEP
    h.record_probe(0.0, Probe.DEEP, ok=True)  # a real generation worked
    assert h.probe_kind(0.0) is Probe.CHEAP and h.consecutive_failures == 0
    fail(h, 1.0)
    h.record_success(1.0)  # so did a real request
    assert h.probe_kind(1.0) is Probe.CHEAP


def test_health_ok_but_generation_failing_is_taken_out() -> None:
    """U6: /health answers 200, generations fail: the deep probe decides."""
    h = health()
    h.record_probe(0.0, Probe.CHEAP, ok=True)
    fail(h, 0.0)
    assert h.probe_kind(0.0) is Probe.DEEP
    h.record_probe(0.0, Probe.DEEP, ok=False)
    assert not h.admits(0.0, 0)
    # The cheap probe still answers OK, which is not enough to come back ...
    h.record_probe(5.0, Probe.CHEAP, ok=True)
    assert not h.admits(5.0, 0) and h.probe_kind(5.0) is Probe.DEEP
    h.record_probe(5.0, Probe.DEEP, ok=False)
    assert not h.admits(5.0, 0)
    # ... only a generation that works is.
    h.record_probe(10.0, Probe.DEEP, ok=True)
    assert h.admits(10.0, 0)


def test_a_probe_that_just_recovered_is_followed_by_a_deep_one() -> None:
    h = health()
    h.record_probe(0.0, Probe.CHEAP, ok=False)  # the server is down
    assert not h.admits(0.0, 0) and h.probe_kind(0.0) is Probe.CHEAP  # no generations at it
    h.record_probe(5.0, Probe.CHEAP, ok=True)
    assert not h.admits(5.0, 0) and h.probe_kind(5.0) is Probe.DEEP
    h.record_probe(5.0, Probe.DEEP, ok=True)
    assert h.admits(5.0, 0)


def test_without_a_deep_probe_the_cheap_one_is_conclusive() -> None:
    h = health(deep=False)
    fail(h, 0.0)
    assert h.probe_kind(0.0) is Probe.CHEAP
    h.record_probe(0.0, Probe.CHEAP, ok=False)
    assert not h.admits(0.0, 0)
    h.record_probe(1.0, Probe.CHEAP, ok=True)
    assert h.admits(1.0, 0)


def test_probes_during_the_cool_down_are_cheap_and_the_trial_after_it_is_deep() -> None:
    h = health()
    fail(h, 0.0, 5)
    assert h.probe_kind(5.0) is Probe.CHEAP
    h.record_probe(5.0, Probe.CHEAP, ok=True)
    assert not h.admits(5.0, 0)  # a good probe does not cut the cool-down short
    assert h.next_probe_at(last=5.0, interval=30.0) == 10.0  # probed as the cool-down ends
    assert h.probe_kind(10.0) is Probe.DEEP
    h.record_probe(10.0, Probe.DEEP, ok=False)  # trial failed: out again, for longer
    assert h.ejected_until == 30.0
    h.record_probe(30.0, Probe.DEEP, ok=True)
    assert not h.ejected and h.admits(30.0, 0)


def test_reset_forgets_everything() -> None:
    h = health()
    fail(h, 0.0, 5)
    h.record_probe(0.0, Probe.CHEAP, ok=False)
    h.reset()
    assert h.admits(0.0, 0) and not h.ejected and h.probe_kind(0.0) is Probe.CHEAP


def test_restart_backoff_doubles_and_is_forgotten_after_a_stable_run() -> None:
    backoff = RestartBackoff(base_s=1.0, max_s=8.0, stable_s=60.0)
    assert [backoff.exited(t) for t in range(6)] == [1, 2, 4, 8, 8, 8]
    backoff.ready(100.0)
    assert backoff.exited(130.0) == 8  # crashed after 30 s: not stable yet
    backoff.ready(200.0)
    assert backoff.exited(260.0) == 1  # ran for a minute: a first crash again


def test_fleet_record_round_trip_and_garbage() -> None:
    record = FleetRecord(state="ready", since=1.5, restarts=2, pid=42)
    assert FleetRecord.decode(record.encode()) == record
    assert FleetRecord.decode(b'{"state": "exploded", "since": 1}') is None
    assert FleetRecord.decode(b"not json") is None
