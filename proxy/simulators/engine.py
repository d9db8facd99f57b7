"""What the chat simulators report of their engine: latency histograms and /metrics text
(prometheus_client's exposition, as vLLM 0.32 serves it; the families a gateway reads). The
engine itself (batch, queue, KV and prefix cache) is `scheduler` and `kvcache`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

# vLLM 0.32's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break

    def series(self, name: str, labels: Mapping[str, str]) -> list[str]:
        """Cumulative `_bucket` lines (with +Inf), then `_count` and `_sum`."""
        lines, running, plain = [], 0, _labels(labels)
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            lines.append(f"{name}_bucket{{{_labels({**labels, 'le': str(bound)})}}} "
                         f"{float(running)}")
        lines.append(f"{name}_bucket{{{_labels({**labels, 'le': '+Inf'})}}} {float(self.count)}")
        lines.append(f"{name}_count{{{plain}}} {float(self.count)}")
        lines.append(f"{name}_sum{{{plain}}} {self.sum}")
        return lines


def buckets_1_2_5(largest: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's `build_1_2_5_buckets`, which sizes
    the prefill token histogram by the model's context)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


class Latencies:
    """Time to first token and end-to-end latency of finished requests; the time each spent
    from being scheduled to its first token (vLLM's PREFILL phase) and the prompt tokens it
    computed there (those not found cached)."""

    def __init__(self, max_model_len: int) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prefill = Histogram(E2E_BUCKETS)  # vLLM's request_latency_buckets, as e2e
        self.computed = Histogram(buckets_1_2_5(max_model_len))


CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
QUEUE_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

Row = tuple[Mapping[str, str], float]  # a sample's own labels (beyond engine, model) and value


class Exposition:
    """Prometheus text in prometheus_client's layout: HELP, TYPE, then the samples, each
    with its labels in alphabetical order (`engine`, `finished_reason`, `model_name`)."""

    def __init__(self, model: str) -> None:
        self.base = {"engine": "0", "model_name": model}
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, rows: Iterable[Row],
               engine: bool = True) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        base = self.base if engine else {"model_name": self.base["model_name"]}
        for labels, value in rows:
            self.lines.append(f"{name}{{{_labels({**base, **labels})}}} {float(value)}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self.family(name, "gauge", help_text, [({}, value)])

    def info(self, name: str, help_text: str, labels: Mapping[str, str]) -> None:
        """A gauge of 1 whose labels are the information (vLLM's `*_config_info`): the
        engine's label, no model's."""
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                       f"{name}{{{_labels({'engine': self.base['engine'], **labels})}}} 1.0"]

    def counter(self, name: str, help_text: str, value: float) -> None:
        self.family(name, "counter", help_text, [({}, value)])

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        self.lines += histogram.series(name, self.base)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def by(label: str, values: Iterable[str], counts: Callable[[str], float]) -> list[Row]:
    return [({label: value}, counts(value)) for value in values]
