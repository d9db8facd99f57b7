"""`GET /metrics`: the Prometheus text of the whole process group.

What the workers count (proxy.observe.metrics) is summed over every worker's files in
multiprocess mode, or read from this process's registry when it runs alone (tests, embedding).
Then what is only true now is read at scrape time by the worker that answers: its view of each
backend's health, the supervisor's word on supervised backends (state,
restarts: from the fleet records every worker follows), the engines' own load (queue, batch,
KV cache: scraped by the master), and the async task queue (Redis).

A scraper that accepts OpenMetrics (Prometheus with exemplar storage on) gets it, with the
latency buckets' exemplars: the ids of kept traces (proxy.observe.exemplars).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics import exposition as openmetrics
from redis.exceptions import RedisError

from proxy.appkeys import METRICS, REDIS, ROUTER
from proxy.observe.exemplars import attach, gathered
from proxy.store.client import Store
from proxy.tasks.store import GROUP, QUEUE
from proxy.upstream.fleet_state import BACKING_OFF, READY, STARTING, STOPPED, UNHEALTHY
from proxy.upstream.pool import Backend

# Read at scrape time (not counted by the workers): the dashboard's test checks against these.
SCRAPE_TIME_METRICS = ("igw_backend_up", "igw_backend_state", "igw_backend_restarts",
                       "igw_task_queue_depth", "igw_engine_waiting", "igw_engine_running",
                       "igw_engine_kv_cache_usage", "igw_engine_prefill_ms_per_1k_tokens")
_STATES = (STARTING, READY, UNHEALTHY, BACKING_OFF, STOPPED)

log = logging.getLogger("proxy.observe")


class _Families:
    """A one-off collector: metric families already built for this scrape."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    own = app[METRICS]
    own.flush()  # this worker's counts up to now; the others' are at most FLUSH_S old
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")  # set by the master (runtime.master)
    counted = CollectorRegistry()
    if folder:
        MultiProcessCollector(counted)  # type: ignore[no-untyped-call]
    else:
        counted = own.registry
    registry = CollectorRegistry()
    registry.register(_Families(attach(counted.collect(), gathered(folder, own.exemplars))))
    queue = await _queue_depth(app[REDIS])
    registry.register(_Families([*backend_families(app[ROUTER].backends), *queue]))
    if "application/openmetrics-text" in request.headers.get("Accept", ""):
        return web.Response(body=openmetrics.generate_latest(registry),  # type: ignore[no-untyped-call]
                            headers={"Content-Type": openmetrics.CONTENT_TYPE_LATEST})
    return web.Response(body=generate_latest(registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def backend_families(backends: Iterable[Backend]) -> list[Metric]:
    """This worker's view of each backend, and the supervisor's records of supervised ones."""
    up = GaugeMetricFamily("igw_backend_up", "1 while the backend may take requests (this "
                           "worker's view: supervisor ready, probes and ejections).",
                           labels=("backend", "model", "kind"))
    state = GaugeMetricFamily("igw_backend_state", "1 for a supervised backend's state.",
                              labels=("backend", "state"))
    restarts = CounterMetricFamily("igw_backend_restarts",
                                   "Restarts of a supervised backend by the supervisor.",
                                   labels=("backend",))
    now = time.time()
    engine = {name: GaugeMetricFamily(f"igw_engine_{name}", text, labels=("backend",))
              for name, text in (
                  ("waiting", "Requests waiting in the engine's own queue (vLLM, TGI)."),
                  ("running", "Requests in the engine's running batch (vLLM, TGI)."),
                  ("kv_cache_usage", "Share of the engine's KV cache in use, 0-1 (vLLM; TGI: "
                                     "of its batch token budget)."),
                  ("prefill_ms_per_1k_tokens", "The engine's prefill time per 1,000 prompt "
                                               "tokens, fitted from its own figures (vLLM)."))}
    for backend in backends:
        load = backend.load(now)
        if load is not None:  # fresh figures only: a gap shows a scrape that failed
            engine["waiting"].add_metric((backend.name,), load.waiting)
            engine["running"].add_metric((backend.name,), load.running)
            if load.kv is not None:
                engine["kv_cache_usage"].add_metric((backend.name,), load.kv)
        if backend.prefill.per_token_s is not None:
            engine["prefill_ms_per_1k_tokens"].add_metric((backend.name,),
                                                          backend.prefill.per_token_s * 1e6)
        for model in backend.spec.models:
            up.add_metric((backend.name, model, backend.spec.kind),
                          1.0 if backend.healthy else 0.0)
        record = backend.record
        if backend.supervised:
            current = record.state if record is not None else STARTING
            for name in _STATES:
                state.add_metric((backend.name, name), 1.0 if name == current else 0.0)
            restarts.add_metric((backend.name,), record.restarts if record else 0)
    return [up, state, restarts, *engine.values()]


async def _queue_depth(redis: Store) -> list[Metric]:
    """Async tasks waiting for a runner and running now (a runner deletes an entry when done,
    so the stream holds exactly these; the group's pending ones are running)."""
    depth = GaugeMetricFamily("igw_task_queue_depth", "Async tasks waiting and running.",
                              labels=("state",))
    try:
        length = await redis.xlen(QUEUE)
        running = 0
        if length:
            summary: Any = await redis.xpending(QUEUE, GROUP)
            running = int(summary.get("pending", 0)) if isinstance(summary, dict) else 0
    except RedisError as exc:
        if "NOGROUP" not in str(exc):
            log.warning("task queue depth unreadable (%s)", type(exc).__name__)
            return []  # absent rather than wrong: Prometheus shows the gap
        running = 0
    depth.add_metric(("waiting",), max(0, length - running))
    depth.add_metric(("running",), running)
    return [depth]
