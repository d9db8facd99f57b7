"""The gateway's Prometheus metrics: what each worker counts as requests go by.

Every label value comes from a fixed set the operator's config or the code defines (route
templates, configured models and backends, tier names, error types, outcomes), never from a
key, an account id or anything a client typed: `Labels` maps anything else to "other".

Under `serve` the workers are separate processes: prometheus-client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set by the master before it starts them) keeps each process's values
in files, and whichever worker answers `/metrics` adds them all up (proxy.api.scrape). A
request's counts are tallied in plain dicts and written to the metric values once a second
(`flush`): per request that is a few dict updates instead of a dozen locked writes to a mapped
file. What only makes sense at scrape time (backend health, supervised restarts, the task queue,
the engines' own load) is read then, not counted here.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from proxy.observe.exemplars import Exemplars
from proxy.observe.trace import Trace

disable_created_metrics()  # type: ignore[no-untyped-call]  # `_created`: dashboard noise
OTHER = "other"  # a label value outside the fixed set
# Seconds: fast non-streamed answers to long generations and video jobs.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DENIED = frozenset({401, 402, 403})
# How stale another worker's counts may be in a scrape (the answering worker flushes its own
# first): requests counted in plain dicts, written to the shared files once a second.
FLUSH_S = 1.0
# Units a settlement counts besides tokens: the journal's name -> (the label, its scale).
MEDIA_UNITS = {"characters": ("characters", 1), "audio_ms": ("audio_seconds", 1000),
               "images": ("images", 1), "video_ms": ("video_seconds", 1000)}


def bucket_bounds(buckets: Sequence[float]) -> tuple[float, ...]:
    """A histogram's bucket upper bounds as it counts them: ours, then +Inf (the exposition
    format always has a last bucket, `le="+Inf"`; prometheus-client appends it)."""
    bounds = tuple(float(bound) for bound in buckets)
    return bounds if bounds and bounds[-1] == math.inf else (*bounds, math.inf)


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
        # Children by metric and label values (bounded by the fixed label sets, like the
        # series), and what the hot path counted since the last flush.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._added: dict[Any, float] = {}
        self._live: dict[Any, int] = {}  # gauge children: what is open now
        self._observed: dict[Any, list[float]] = {}
        self._bounds: dict[Any, tuple[float, ...]] = {}  # a histogram child's bucket bounds
        self.exemplars = Exemplars()  # kept traces' ids on the latency buckets
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
        self.queue_waiting = Gauge(
            "igw_queue_waiting", "Requests waiting in the gateway's queue for an engine slot, by "
            "model and tier (all workers).", ("model", "tier"), multiprocess_mode="livesum",
            registry=r)
        self.queue_wait = Histogram(
            "igw_queue_wait_seconds", "Time requests waited in the gateway's queue for a slot "
            "(those that got one).", ("model", "tier"), buckets=LATENCY_BUCKETS, registry=r)
        self.queue_shed = Counter(
            "igw_queue_shed", "Requests the queue answered 503: at once (`expected`: their "
            "tier's longest wait would pass) or after waiting it (`waited`).",
            ("model", "tier", "reason"), registry=r)
        self.holder_waits = Counter(
            "igw_prefix_holder_waits", "Requests whose prompt's holders were all busy and worth "
            "waiting for, by how it ended: a holder's slot (`holder`) or, waiting no longer "
            "paid, the first free slot elsewhere (`elsewhere`).", ("model", "outcome"),
            registry=r)
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
        self.access_log_dropped = Counter(
            "igw_access_log_dropped", "Access-log lines dropped because its writer fell too far "
            "behind (a disk or pipe slower than the requests).", registry=r)
        self.trace_spans = Counter(
            "igw_trace_spans", "Trace spans the exporter sent (`sent`) or gave up on after its "
            "retries (`failed`: the trace backend refused them or was unreachable).",
            ("outcome",), registry=r)
        self.settlements_unreplicated = Counter(
            "igw_settlements_unreplicated", "Settlement writes that fewer replicas than "
            "`ledger_ack_replicas` confirmed within 60 s (a failover then could lose them).",
            registry=r)
        self.shadow_decisions = Counter(
            "igw_shadow_decisions", "Requests the shadow policies judged, by tier, the live "
            "decision, the shadow's, and the shadow's reason for a refusal.",
            ("tier", "live", "shadow", "reason"), registry=r)
        self.shadow_credits = Counter(
            "igw_shadow_credits", "Credits the judged requests were charged (`live`) and the "
            "shadow policies would charge (`shadow`), by tier.", ("tier", "policy"), registry=r)
        # The histograms' buckets as they were made, for `observe` to count into.
        self._histogram_bounds = {id(self.duration): bucket_bounds(LATENCY_BUCKETS),
                                  id(self.first_token): bucket_bounds(FIRST_TOKEN_BUCKETS),
                                  id(self.upstream_latency): bucket_bounds(LATENCY_BUCKETS),
                                  id(self.queue_wait): bucket_bounds(LATENCY_BUCKETS)}

    # --- the hot path: tallied in plain dicts, written to the metric values by `flush` ------

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, kept: labels() costs more than the count itself."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
            bounds = self._histogram_bounds.get(id(metric))
            if bounds is not None:
                self._bounds[found] = bounds
        return found

    def add(self, child: Any, amount: float = 1.0) -> None:
        """Count `amount` on a counter's child."""
        self._added[child] = self._added.get(child, 0.0) + amount

    def live(self, child: Any, change: int) -> None:
        """An in-flight gauge's child goes up or down by one; `flush` sets it."""
        self._live[child] = self._live.get(child, 0) + change

    def observe(self, child: Any, value: float) -> None:
        """Observe `value` on a histogram's child (one `child` made)."""
        bounds = self._bounds[child]
        tally = self._observed.get(child)
        if tally is None:
            tally = self._observed[child] = [0.0] * (len(bounds) + 1)
        tally[0] += value  # the sum, then one count per bucket
        tally[1 + bisect_left(bounds, value)] += 1

    def flush(self) -> None:
        """Write what was tallied since the last flush: one update per series, not one per
        request (in multiprocess mode each update is a locked write to a mapped file)."""
        added, self._added = self._added, {}
        observed, self._observed = self._observed, {}
        for child, amount in added.items():
            if amount:
                child.inc(amount)
        for child, open_now in self._live.items():
            child.set(open_now)
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder:
            self.exemplars.write(folder)
        for child, tally in observed.items():
            # prometheus-client has no "observe many": its histogram is a sum and a value
            # per bucket (private: `_sum`, `_buckets`, in tests/test_contracts.py), which is
            # what we add to.
            child._sum.inc(tally[0])
            for bucket, count in zip(child._buckets, tally[1:], strict=True):
                if count:
                    bucket.inc(count)

    def started(self, route: str) -> None:
        self.live(self.child(self.in_flight, route), 1)

    def answered(self, trace: Trace, status: int) -> None:
        """A request's answer is out (or its client left: 499)."""
        labels = self.labels
        route = trace.route
        model, tier = labels.model(trace.model), labels.tier(trace.tier)
        values = (route, model, tier, str(status))
        self.live(self.child(self.in_flight, route), -1)
        self.add(self.child(self.requests, *values))
        seconds = time.monotonic() - trace.started
        self.observe(self.child(self.duration, *values), seconds)
        if trace.first_byte_s is not None:
            self.observe(self.child(self.first_token, route, model), trace.first_byte_s)
        if trace.spans is not None and trace.spans.kept:  # its trace was exported: link to it
            trace_id = f"{trace.spans.trace_id:032x}"
            self._exemplar(self.duration, "igw_request_duration_seconds", zip(
                ("route", "model", "tier", "status"), values, strict=True), seconds, trace_id)
            if trace.first_byte_s is not None:
                self._exemplar(self.first_token, "igw_time_to_first_token_seconds",
                               (("route", route), ("model", model)), trace.first_byte_s,
                               trace_id)
        if trace.outcome is not None:
            self.add(self.child(self.stream_endings, route, trace.outcome))
        if trace.error is not None:
            self.add(self.child(self.errors, route, trace.error))
            if status == 429:
                self.add(self.child(self.rate_limited, tier))
            elif status in _DENIED:
                self.add(self.child(self.denied, tier, trace.error))

    def _exemplar(self, metric: Histogram, name: str, labels: Iterable[tuple[str, str]],
                  value: float, trace_id: str) -> None:
        bounds = self._histogram_bounds[id(metric)]  # the bucket `observe` counted it in
        self.exemplars.note(name, labels, bounds[bisect_left(bounds, value)], trace_id, value)

    def upstream_started(self, backend: str) -> str:
        """An exchange with `backend` begins; returns its label value for the calls below."""
        name = self.labels.backend(backend)
        self.live(self.child(self.backend_in_flight, name), 1)
        return name

    def queued(self, model: str, tier: str, change: int) -> None:
        self.live(self.child(self.queue_waiting, self.labels.model(model),
                             self.labels.tier(tier)), change)

    def waited(self, model: str, tier: str, seconds: float) -> None:
        self.observe(self.child(self.queue_wait, self.labels.model(model),
                                self.labels.tier(tier)), seconds)

    def shed(self, model: str, tier: str, reason: str) -> None:
        self.add(self.child(self.queue_shed, self.labels.model(model), self.labels.tier(tier),
                            reason))

    def held_out(self, model: str, outcome: str) -> None:
        self.add(self.child(self.holder_waits, self.labels.model(model), outcome))

    def upstream_answered(self, name: str, seconds: float) -> None:
        self.observe(self.child(self.upstream_latency, name), seconds)

    def upstream_ended(self, name: str) -> None:
        self.live(self.child(self.backend_in_flight, name), -1)

    def shadow_judged(self, tier: str, live: str, shadow: str, reason: str, live_micro: int,
                      shadow_micro: int) -> None:
        tier = self.labels.tier(tier)
        self.add(self.child(self.shadow_decisions, tier, live, shadow, reason))
        if live_micro:
            self.add(self.child(self.shadow_credits, tier, "live"), live_micro / 1e6)
        if shadow_micro:
            self.add(self.child(self.shadow_credits, tier, "shadow"), shadow_micro / 1e6)

    def settled(self, model: str, tier: str | None, cost_micro: int,
                units: Mapping[str, int]) -> None:
        """A settlement was queued: count what it charges and the units it used."""
        model_label = self.labels.model(model)
        if cost_micro > 0:
            self.add(self.child(self.credits, model_label, self.labels.tier(tier)),
                     cost_micro / 1e6)
        for kind in ("prompt", "completion"):
            count = units.get(f"{kind}_tokens", 0)
            if count > 0:
                self.add(self.child(self.tokens, model_label, kind), count)
        for name, (unit, scale) in MEDIA_UNITS.items():
            count = units.get(name, 0)
            if count > 0:
                self.add(self.child(self.media, model_label, unit), count / scale)


async def flush_metrics(metrics: Metrics) -> None:
    """Flush the tallies every FLUSH_S (a task for the app's lifetime)."""
    while True:
        await asyncio.sleep(FLUSH_S)
        metrics.flush()
