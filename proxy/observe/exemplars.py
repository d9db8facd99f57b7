"""Exemplars: a kept trace's id on the latency histogram bucket its request fell in, so Grafana
can jump from a slow bucket to a trace of it (OpenMetrics only: the Prometheus text format has
no exemplars).

prometheus-client keeps no exemplars in multiprocess mode, so each worker keeps the newest
exemplar per series and bucket itself (`Exemplars.note`, on the request path: one dict write)
and, when it flushes its counts, writes them to a file of its own beside the metric files
(`exemplars_<pid>.json` in PROMETHEUS_MULTIPROC_DIR; MultiProcessCollector reads only `*.db`).
The worker that answers a scrape reads every worker's file and puts the newest exemplar of each
bucket on its sample (`attach`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson
from prometheus_client.core import Metric
from prometheus_client.samples import Exemplar, Sample

# (histogram name, its labels as sorted pairs, the bucket's upper bound) -> (trace id, value,
# time)
Key = tuple[str, tuple[tuple[str, str], ...], float]
Noted = tuple[str, float, float]
_PREFIX = "exemplars_"


class Exemplars:
    """This process's newest exemplar per histogram series and bucket."""

    def __init__(self) -> None:
        self.noted: dict[Key, Noted] = {}
        self._changed = False

    def note(self, histogram: str, labels: Iterable[tuple[str, str]], bound: float,
             trace_id: str, value: float) -> None:
        self.noted[(histogram, tuple(sorted(labels)), bound)] = (trace_id, value, time.time())
        self._changed = True

    def write(self, folder: str) -> None:
        """Publish this process's exemplars for the scrape (multiprocess mode)."""
        if not self._changed:
            return
        self._changed = False
        rows = [[name, labels, _bound_text(bound), *noted]
                for (name, labels, bound), noted in self.noted.items()]
        path = Path(folder) / f"{_PREFIX}{os.getpid()}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(orjson.dumps(rows))
        temporary.replace(path)  # a scrape never reads half a file


def gathered(folder: str | None, own: Exemplars) -> dict[Key, Noted]:
    """Every worker's exemplars (the newest per bucket), or this process's alone."""
    if folder is None:
        return own.noted
    found: dict[Key, Noted] = {}
    for path in Path(folder).glob(f"{_PREFIX}*.json"):
        try:
            rows = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue  # a worker's file being replaced, or gone
        for name, labels, bound, trace_id, value, at in rows:
            key = (name, tuple((k, v) for k, v in labels), float(bound))
            if key not in found or found[key][2] < at:
                found[key] = (trace_id, value, at)
    return found


def attach(families: Iterable[Metric], noted: dict[Key, Noted]) -> Iterator[Metric]:
    """The families, with each bucket sample that has an exemplar carrying it."""
    names = {key[0] for key in noted}
    for family in families:
        if family.name in names:
            family.samples = list(_with_exemplars(family, noted))
        yield family


def _with_exemplars(family: Metric, noted: dict[Key, Noted]) -> Iterator[Sample]:
    bucket = f"{family.name}_bucket"
    for sample in family.samples:
        if sample.name == bucket:
            labels = dict(sample.labels)
            bound = float(labels.pop("le"))
            found = noted.get((family.name, tuple(sorted(labels.items())), bound))
            if found is not None:
                trace_id, value, at = found
                sample = sample._replace(exemplar=Exemplar({"trace_id": trace_id}, value, at))
        yield sample


def _bound_text(bound: float) -> str | float:
    return "+Inf" if math.isinf(bound) else bound
