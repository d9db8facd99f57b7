"""The gateway's Prometheus metrics: what each worker counts as requests go by.

Every label value comes from a fixed set the operator's config or the code defines (route
templates, configured models and backends, tier names, error types, outcomes), never from a
key, an account id or anything a client typed: `Labels` maps anything else to "other".

Under `serve` the workers are separate processes: prometheus-client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set by the master before it starts them) keeps each process's values
in files, and whichever worker answers `/metrics` adds them all up (proxy.observe.scrape). What
only makes sense at scrape time (backend health, supervised restarts, the task queue) is read
then, not counted here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from proxy.observe.trace import Trace

disable_created_metrics()  # type: ignore[no-untyped-call]  # `_created`: dashboard noise
OTHER = "other"  # a label value outside the fixed set
# Seconds: fast non-streamed answers to long generations and video jobs.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DENIED = frozenset({401, 402, 403})
# Units a settlement counts besides tokens: the journal's name -> (the label, its scale).
MEDIA_UNITS = {"characters": ("characters", 1), "audio_ms": ("audio_seconds", 1000),
               "images": ("images", 1), "video_ms": ("video_seconds", 1000)}


class Labels:
    """The fixed sets label values are drawn from."""

    def __init__(self, models: Iterable[str], tiers: Callable[[], Container[str]],
                 backends: Iterable[str]) -> None:
        self.models = frozenset(models)
        self.tiers = tiers  # the live policy's: a reload may add one
        self.backends = frozenset(backends)

    def model(self, name: str | None) -> str:
        return name if name in self.models else ("" if name is None else OTHER)

    def tier(self, name: str | None) -> str:
        if name is None:
            return ""
        return name if name in self.tiers() else OTHER

    def backend(self, name: str | None) -> str:
        return name if name in self.backends else ("" if name is None else OTHER)


class Metrics:
    """One process's metric objects (in `app[METRICS]`). `registry`: where they are registered
    for a single-process scrape; in multiprocess mode their values go to files regardless."""

    def __init__(self, labels: Labels, registry: CollectorRegistry) -> None:
        self.labels = labels
        self.registry = registry
        r = registry
        self.requests = Counter(
            "igw_requests", "Requests answered, by route template, model, tier and status.",
            ("route", "model", "tier", "status"), registry=r)
        self.duration = Histogram(
            "igw_request_duration_seconds",
            "Time from the request's arrival to the end of its answer (a stream's last byte).",
            ("route", "model", "tier", "status"), buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram(
            "igw_time_to_first_token_seconds",
            "Time from a streamed request's arrival to its first content event.",
            ("route", "model"), buckets=FIRST_TOKEN_BUCKETS, registry=r)
        self.in_flight = Gauge(
            "igw_requests_in_flight", "Requests being answered now.", ("route",),
            multiprocess_mode="livesum", registry=r)
        self.errors = Counter(
            "igw_errors", "Error answers, by route and error type (DESIGN §6).",
            ("route", "type"), registry=r)
        self.rate_limited = Counter(
            "igw_rate_limited", "Requests refused by the rate limit (429), by tier.", ("tier",),
            registry=r)
        self.denied = Counter(
            "igw_denied", "Requests refused for identity, access or credits (401, 402, 403).",
            ("tier", "type"), registry=r)
        self.stream_endings = Counter(
            "igw_stream_endings", "How streamed answers ended (completed, cut, timeout, ...).",
            ("route", "outcome"), registry=r)
        self.upstream_latency = Histogram(
            "igw_upstream_response_seconds",
            "Time from sending a request upstream to the upstream's response headers.",
            ("backend",), buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_failures = Counter(
            "igw_upstream_failures", "Upstream exchanges that failed, by backend and kind.",
            ("backend", "type"), registry=r)
        self.backend_in_flight = Gauge(
            "igw_backend_in_flight", "Requests open on each backend (all workers).",
            ("backend",), multiprocess_mode="livesum", registry=r)
        self.ejections = Counter(
            "igw_backend_ejections", "Times a backend was ejected after consecutive failures.",
            ("backend",), registry=r)
        self.tokens = Counter(
            "igw_tokens", "Tokens settled, by model and kind (prompt, completion).",
            ("model", "kind"), registry=r)
        self.media = Counter(
            "igw_media_units", "Speech characters, audio and video seconds and images settled.",
            ("model", "unit"), registry=r)
        self.credits = Counter(
            "igw_credits_charged", "Credits charged at settlement, by model and tier.",
            ("model", "tier"), registry=r)
        self.redis_errors = Counter(
            "igw_redis_errors", "Requests or settlement batches that failed on Redis.",
            ("store",), registry=r)
        self.settlements_lost = Counter(
            "igw_settlements_lost", "Settlement writes dropped after every retry failed (their "
            "holds expire and the sweeper releases them).", registry=r)

    def answered(self, trace: Trace, status: int) -> None:
        """A request's answer is out (or its client left: 499)."""
        labels = self.labels
        model, tier, code = labels.model(trace.model), labels.tier(trace.tier), str(status)
        self.requests.labels(trace.route, model, tier, code).inc()
        self.duration.labels(trace.route, model, tier, code).observe(
            time.monotonic() - trace.started)
        if trace.first_byte_s is not None:
            self.first_token.labels(trace.route, model).observe(trace.first_byte_s)
        if trace.outcome is not None:
            self.stream_endings.labels(trace.route, trace.outcome).inc()
        if trace.error is not None:
            self.errors.labels(trace.route, trace.error).inc()
            if status == 429:
                self.rate_limited.labels(tier).inc()
            elif status in _DENIED:
                self.denied.labels(tier, trace.error).inc()

    def settled(self, model: str, tier: str | None, cost_micro: int,
                units: Mapping[str, int]) -> None:
        """A settlement was queued: count what it charges and the units it used."""
        model_label = self.labels.model(model)
        if cost_micro > 0:
            self.credits.labels(model_label, self.labels.tier(tier)).inc(cost_micro / 1e6)
        for kind in ("prompt", "completion"):
            count = units.get(f"{kind}_tokens", 0)
            if count > 0:
                self.tokens.labels(model_label, kind).inc(count)
        for name, (unit, scale) in MEDIA_UNITS.items():
            count = units.get(name, 0)
            if count > 0:
                self.media.labels(model_label, unit).inc(count / scale)
