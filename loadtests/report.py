"""Figures, comparisons and verdicts against the DESIGN §7 targets, as JSON and as a table.

Pure: no I/O. Latencies compare as added milliseconds (gateway minus direct, per percentile);
rates as the ratio gateway / direct. A figure that could not be measured is NaN and fails its
target rather than passing by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

Compare = Literal["added", "ratio"] | None


@dataclass(frozen=True)
class Target:
    """One DESIGN §7 target: `on` says whether it bounds the added figure or the gateway's own."""

    name: str
    phase: str
    field: str
    on: Literal["added", "gateway"]
    op: Literal["<=", ">="]
    limit: float
    unit: str

    def met(self, value: float) -> bool:
        return value <= self.limit if self.op == "<=" else value >= self.limit

    def text(self) -> str:
        if self.on == "added":
            return f"{self.op} +{self.limit:g} {self.unit}"
        return f"{self.op} {self.limit:,.0f} {self.unit}"


TARGETS = (
    Target("added p50 latency, c=1", "latency", "p50_ms", "added", "<=", 0.6, "ms"),
    Target("added p99 latency, c=1", "latency", "p99_ms", "added", "<=", 1.5, "ms"),
    Target("non-streaming throughput", "throughput", "requests_per_s", "gateway", ">=", 2000,
           "req/s"),
    Target("relayed SSE events", "stream", "events_per_s", "gateway", ">=", 10_000, "ev/s"),
    # At concurrency 1: under saturation TTFT is mostly queueing, not the gateway's own delay.
    Target("added TTFT p50, c=1", "stream_c1", "ttft_p50_ms", "added", "<=", 1.0, "ms"),
)

# Per phase: (label, summary field, how gateway compares with direct).
ROWS: dict[str, list[tuple[str, str, Compare]]] = {
    "latency": [("p50 ms", "p50_ms", "added"), ("p99 ms", "p99_ms", "added"),
                ("req/s", "requests_per_s", "ratio"), ("errors", "errors", None)],
    "throughput": [("req/s", "requests_per_s", "ratio"), ("p50 ms", "p50_ms", "added"),
                   ("p99 ms", "p99_ms", "added"), ("errors", "errors", None)],
    "stream_c1": [("TTFT p50 ms", "ttft_p50_ms", "added"), ("TTFT p99 ms", "ttft_p99_ms", "added"),
                  ("req/s", "requests_per_s", "ratio"), ("errors", "errors", None)],
    "stream": [("events/s", "events_per_s", "ratio"), ("TTFT p50 ms", "ttft_p50_ms", "added"),
               ("req/s", "requests_per_s", "ratio"), ("events/request", "events_per_request", None),
               ("errors", "errors", None)],
}


def build(meta: dict[str, Any], summaries: dict[str, dict[str, dict[str, Any]]],
          titles: dict[str, str]) -> dict[str, Any]:
    """`summaries[phase][target]` as from `Tally.summary()`; returns the whole JSON document."""
    phases: dict[str, Any] = {}
    for key, by_target in summaries.items():
        direct, gateway = by_target["direct"], by_target["gateway"]
        compare: dict[str, float] = {}
        for _, name, how in ROWS.get(key, []):
            if how == "added":
                compare[f"added_{name}"] = gateway[name] - direct[name]
            elif how == "ratio":
                compare[f"{name}_ratio"] = _ratio(gateway[name], direct[name])
        phases[key] = {"title": titles.get(key, key), "direct": direct, "gateway": gateway,
                       "compare": compare}

    checks = []
    for target in TARGETS:
        phase = phases.get(target.phase)
        value = math.nan
        if phase is not None:
            value = (phase["compare"][f"added_{target.field}"] if target.on == "added"
                     else phase["gateway"][target.field])
        checks.append({"name": target.name, "phase": target.phase, "field": target.field,
                       "on": target.on, "value": value, "target": target.text(),
                       "passed": target.met(value)})
    errors = sum(p[t]["errors"] for p in phases.values() for t in ("direct", "gateway"))
    checks.append({"name": "failed requests, all phases", "phase": None, "field": "errors",
                   "on": "both", "value": errors, "target": "0", "passed": errors == 0})
    return {"meta": meta, "phases": phases, "checks": checks,
            "passed": all(c["passed"] for c in checks)}


def render(figures: dict[str, Any]) -> str:
    meta = figures["meta"]
    lines = [
        "Inference Gateway benchmark: straight to the upstream (direct) vs through the gateway",
        f"  {meta['usable_cores']} usable cores; load average (1 min) "
        f"{meta['load_average_1m']['before']:.2f} before the run, "
        f"{meta['load_average_1m']['after']:.2f} after (the run itself adds about 2; more means "
        "other work shared the cores)",
        *(f"  {note}" for note in meta["notes"]),
        f"  {meta['duration_s']:g} s per phase and target in {meta['rounds']} ABBA rounds after a "
        f"{meta['warmup_s']:g} s warm-up; concurrency {meta['concurrency']}; "
        f"{meta['completion_tokens']} completion tokens; upstream: "
        + (f"{meta['kind']} simulator answering instantly" if "simulator" in
           meta["started_servers"] else meta["targets"]["direct"]),
        "",
    ]
    verdicts = {(c["phase"], c["field"]): c for c in figures["checks"] if c["phase"]}
    header = ("phase", "figure", "direct", "gateway", "gateway vs direct", "target", "verdict")
    rows: list[tuple[str, ...]] = []
    for key, phase in figures["phases"].items():
        for i, (label, name, how) in enumerate(ROWS.get(key, [])):
            check = verdicts.get((key, name))
            rows.append((
                phase["title"] if i == 0 else "", label,
                _number(phase["direct"][name], name), _number(phase["gateway"][name], name),
                _compared(phase["compare"], name, how),
                check["target"] if check else "",
                ("PASS" if check["passed"] else "FAIL") if check else "",
            ))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    align = ("<", "<", ">", ">", ">", "<", "<")
    for row in (header, tuple("-" * w for w in widths), *rows):
        lines.append("  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths,
                                                                    strict=True)).rstrip())

    lines += ["", "CPU, % of one core (load generator | servers started here):"]
    for phase in figures["phases"].values():
        parts = []
        for target in ("direct", "gateway"):
            s = phase[target]
            servers = ", ".join(f"{k} {v:.0f}%" for k, v in sorted(s["server_cpu_pct"].items()))
            parts.append(f"{target}: client {s['client_cpu_pct']:.0f}%"
                         + (f" | {servers}" if servers else ""))
        lines.append(f"  {phase['title']:<28} " + "    ".join(parts))

    failed = [c for c in figures["checks"] if not c["passed"]]
    lines.append("")
    for check in figures["checks"]:
        if not check["passed"] and check["field"] == "errors":
            kinds = _error_kinds(figures)
            lines.append(f"FAIL {check['name']}: {check['value']} ({kinds})")
    lines.append(f"verdict: {len(figures['checks']) - len(failed)}/{len(figures['checks'])} "
                 f"targets met -> {'PASS' if figures['passed'] else 'FAIL'}"
                 " (exit status is non-zero on FAIL only with --strict)")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def _number(value: float, name: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if name == "errors":
        return str(value)
    if name.endswith("_ms"):
        return f"{value:.3f}"
    if name == "events_per_request":
        return f"{value:.1f}"
    return f"{value:,.0f}"


def _compared(compare: dict[str, float], name: str, how: Compare) -> str:
    if how is None:
        return ""
    value = compare[f"added_{name}" if how == "added" else f"{name}_ratio"]
    if math.isnan(value):
        return "n/a"
    return f"{value:+.3f} ms" if how == "added" else f"{value:.2f}x"


def _error_kinds(figures: dict[str, Any]) -> str:
    found = [f"{key}/{target}: {kind} x{n}"
             for key, phase in figures["phases"].items() for target in ("direct", "gateway")
             for kind, n in phase[target]["error_kinds"].items()]
    return "; ".join(found)
