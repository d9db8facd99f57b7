"""The hot path's tallies, once flushed, read exactly as prometheus-client's own updates would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from proxy.observe.metrics import LATENCY_BUCKETS, Labels, Metrics
from proxy.observe.trace import Trace

ROUTE = "/v2/compat/v1/chat/completions"


def metrics() -> Metrics:
    return Metrics(Labels(["m"], lambda: {"max"}, ["b0"]), CollectorRegistry())


def test_histogram_tallies_match_observe_one_by_one() -> None:
    ours = metrics()
    reference = Histogram("ref_seconds", "", ("backend",), buckets=LATENCY_BUCKETS,
                          registry=CollectorRegistry())
    # Values on, below and above bucket bounds, the largest past the last finite one.
    values = [0.0, 0.005, 0.0050001, 0.1, 0.3, 2.5, 1e9, 0.004, 600.0, 601.0]
    name = ours.upstream_started("b0")
    for value in values:
        ours.upstream_answered(name, value)
        reference.labels("b0").observe(value)
    ours.upstream_ended(name)
    assert ours.registry.get_sample_value("igw_upstream_response_seconds_count",
                                          {"backend": "b0"}) == 0  # nothing until the flush
    ours.flush()
    ref = {(s.name.replace("ref_seconds", ""), s.labels.get("le")): s.value
           for family in reference.collect() for s in family.samples}
    got = {(s.name.replace("igw_upstream_response_seconds", ""), s.labels.get("le")): s.value
           for family in ours.upstream_latency.collect() for s in family.samples}
    assert got == ref and got[("_count", None)] == len(values)
    assert ours.registry.get_sample_value("igw_backend_in_flight", {"backend": "b0"}) == 0


def test_counts_and_live_gauges_add_up_across_flushes() -> None:
    ours = metrics()
    for status in (200, 200, 429, 200):
        ours.started(ROUTE)
        trace = Trace(ROUTE, tier="max", model="m", error="rate_limited" if status == 429
                      else None)
        ours.answered(trace, status)
    ours.started(ROUTE)  # one still open at the flush
    ours.flush()
    ours.flush()  # a second flush adds nothing
    sample = ours.registry.get_sample_value
    ok = {"route": ROUTE, "model": "m", "tier": "max", "status": "200"}
    assert sample("igw_requests_total", ok) == 3
    assert sample("igw_request_duration_seconds_count", ok) == 3
    assert sample("igw_rate_limited_total", {"tier": "max"}) == 1
    assert sample("igw_requests_in_flight", {"route": ROUTE}) == 1
    ours.answered(Trace(ROUTE, tier="max", model="m"), 200)
    ours.settled("m", "max", 1_500_000, {"prompt_tokens": 3, "audio_ms": 2500})
    ours.settled("not-configured", "nobody", 0, {"completion_tokens": 2})
    ours.flush()
    assert sample("igw_requests_total", ok) == 4
    assert sample("igw_requests_in_flight", {"route": ROUTE}) == 0
    assert sample("igw_credits_charged_total", {"model": "m", "tier": "max"}) == 1.5
    assert sample("igw_tokens_total", {"model": "m", "kind": "prompt"}) == 3
    assert sample("igw_media_units_total", {"model": "m", "unit": "audio_seconds"}) == 2.5
    assert sample("igw_tokens_total", {"model": "other", "kind": "completion"}) == 2
