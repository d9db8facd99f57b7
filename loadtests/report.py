"""Figures, comparisons and verdicts against the issue 11 targets, as JSON and as a table.

Pure: no I/O. Latencies compare as added milliseconds (gateway minus direct, per percentile);
rates as the ratio gateway / direct. A figure that could not be measured is NaN and fails its
target rather than passing by default. A phase measured through the gateway only (the memory
phase) has `direct: null`. Without `judged` (the quick smoke run) only the error count is a
verdict: the timing targets are shown but not checked.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

Compare = Literal["added", "ratio"] | None


@dataclass(frozen=True)
class Target:
    """One target: `on` says whether it bounds the added figure or the gateway's own."""

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
    Target("non-streamed requests/s", "throughput", "requests_per_s", "gateway", ">=", 2500,
           "req/s"),
    Target("streamed responses/s", "stream", "requests_per_s", "gateway", ">=", 1500, "resp/s"),
    Target("added p50 latency, open loop", "open_loop", "p50_ms", "added", "<=", 0.5, "ms"),
    Target("added p99 latency, open loop", "open_loop", "p99_ms", "added", "<=", 2.0, "ms"),
    Target("worker RSS holding the open streams", "rss", "rss_open_mb", "gateway", "<=", 100,
           "MB"),
)

# Per phase: (label, summary field, how gateway compares with direct).
ROWS: dict[str, list[tuple[str, str, Compare]]] = {
    "throughput": [("req/s", "requests_per_s", "ratio"), ("p50 ms", "p50_ms", "added"),
                   ("p99 ms", "p99_ms", "added"), ("errors", "errors", None)],
    "stream": [("responses/s", "requests_per_s", "ratio"),
               ("events/response", "events_per_request", None),
               ("events/s", "events_per_s", "ratio"),
               ("p50 ms, whole stream", "p50_ms", "added"), ("errors", "errors", None)],
    "open_loop": [("p50 ms", "p50_ms", "added"), ("p99 ms", "p99_ms", "added"),
                  ("req/s done", "requests_per_s", "ratio"),
                  ("client lag p99 ms", "lag_p99_ms", None),
                  ("client lag max ms", "lag_max_ms", None), ("errors", "errors", None)],
    "rss": [("worker RSS at start MB", "rss_start_mb", None),
            ("worker RSS idle, before MB", "rss_idle_mb", None),
            ("worker RSS, streams open MB", "rss_open_mb", None),
            ("streams open", "requests", None), ("s to open them all", "open_s", None),
            ("errors", "errors", None)],
}
# The client is late when its open-loop lag p99 exceeds this; both sides' latencies include it.
LAG_WARNING_MS = 1.0


def build(meta: dict[str, Any], summaries: dict[str, dict[str, dict[str, Any] | None]],
          titles: dict[str, str], *, judged: bool = True,
          skipped: Collection[str] = (), unjudged: Collection[str] = ()) -> dict[str, Any]:
    """`summaries[phase][target]` as from `Tally.summary()` (None: not measured on that target);
    returns the whole JSON document. The targets of `skipped` phases are left out; those of
    `unjudged` phases (run with other settings than the target's) are shown but not checked."""
    phases: dict[str, Any] = {}
    for key, by_target in summaries.items():
        direct, gateway = by_target.get("direct"), by_target.get("gateway")
        compare: dict[str, float] = {}
        for _, name, how in ROWS.get(key, []):
            if how is None:
                continue
            d = direct[name] if direct is not None else math.nan
            g = gateway[name] if gateway is not None else math.nan
            if how == "added":
                compare[f"added_{name}"] = g - d
            else:
                compare[f"{name}_ratio"] = _ratio(g, d)
        phases[key] = {"title": titles.get(key, key), "direct": direct, "gateway": gateway,
                       "compare": compare}

    checks: list[dict[str, Any]] = []
    for target in TARGETS:
        phase = phases.get(target.phase)
        if phase is None and target.phase in skipped:
            continue  # not asked for
        value = math.nan
        if phase is not None:
            if target.on == "added":
                value = phase["compare"][f"added_{target.field}"]
            elif phase["gateway"] is not None:
                value = phase["gateway"][target.field]
        checks.append({"name": target.name, "phase": target.phase, "field": target.field,
                       "on": target.on, "value": value, "target": target.text(),
                       "passed": (target.met(value) if judged and target.phase not in unjudged
                                  else None)})
    errors = sum(p[t]["errors"] for p in phases.values() for t in ("direct", "gateway")
                 if p[t] is not None)
    checks.append({"name": "failed requests, all phases", "phase": None, "field": "errors",
                   "on": "both", "value": errors, "target": "0", "passed": errors == 0})
    return {"meta": meta, "phases": phases, "checks": checks,
            "passed": all(c["passed"] is not False for c in checks)}


def render(figures: dict[str, Any]) -> str:
    meta = figures["meta"]
    load = meta["load_average_1m"]
    lines = [
        "Inference Gateway benchmark: straight to the upstream (direct) vs through the gateway",
        f"  {meta['usable_cores']} usable cores; load average (1 min) {load['before']:.2f} "
        f"before the run, {load['after']:.2f} after (the run itself adds about 2; more means "
        "other work shared the cores)",
        *(f"  {note}" for note in meta["notes"]),
        "",
    ]
    verdicts = {(c["phase"], c["field"]): c for c in figures["checks"] if c["phase"]}
    header = ("phase", "figure", "direct", "gateway", "gateway vs direct", "target", "verdict")
    rows: list[tuple[str, ...]] = []
    for key, phase in figures["phases"].items():
        for i, (label, name, how) in enumerate(ROWS.get(key, [])):
            check = verdicts.get((key, name))
            verdict = ""
            if check is not None:
                verdict = ("-" if check["passed"] is None
                           else "PASS" if check["passed"] else "FAIL")
            rows.append((
                phase["title"] if i == 0 else "", label,
                _cell(phase["direct"], name), _cell(phase["gateway"], name),
                _compared(phase["compare"], name, how),
                check["target"] if check else "", verdict,
            ))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    align = ("<", "<", ">", ">", ">", "<", "<")
    for row in (header, tuple("-" * w for w in widths), *rows):
        lines.append("  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths,
                                                                    strict=True)).rstrip())

    lines += ["", "CPU, % of one core: this load generator (client), the servers started here "
              "(below 1 % left out), and how busy each core was, whoever used it:"]
    title_width = max((len(p["title"]) for p in figures["phases"].values()), default=0)
    for phase in figures["phases"].values():
        for target in ("direct", "gateway"):
            s = phase[target]
            if s is None:
                continue
            servers = ", ".join(f"{k} {v:.0f}%" for k, v in s["server_cpu_pct"].items()
                                if v >= 1)
            cores = ", ".join(f"{k} core {v:.0f}%" for k, v in s["core_busy_pct"].items())
            lines.append(f"  {phase['title']:<{title_width}}  {target:<7}  client "
                         f"{s['client_cpu_pct']:.0f}%" + (f" | {servers}" if servers else "")
                         + (f" | busy: {cores}" if cores else ""))

    lines.append("")
    open_loop = figures["phases"].get("open_loop")
    if open_loop is not None:
        late = [f"{t} {open_loop[t]['lag_p99_ms']:.2f} ms" for t in ("direct", "gateway")
                if open_loop[t] is not None and open_loop[t]["lag_p99_ms"] > LAG_WARNING_MS]
        if late:
            lines.append(f"NOTE the load generator started open-loop requests late (lag p99: "
                         f"{', '.join(late)}); those latencies include its lateness")
    for check in figures["checks"]:
        if check["passed"] is False and check["field"] == "errors":
            lines.append(f"FAIL {check['name']}: {check['value']} ({_error_kinds(figures)})")
    judged = [c for c in figures["checks"] if c["passed"] is not None]
    met = sum(1 for c in judged if c["passed"])
    lines.append(f"verdict: {met}/{len(judged)} checks met -> "
                 f"{'PASS' if figures['passed'] else 'FAIL'}"
                 + ("" if meta.get("judged", True) else
                    " (quick smoke run: only errors are judged, timing targets are not)")
                 + " (exit status is non-zero on FAIL only with --strict)")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _cell(summary: dict[str, Any] | None, name: str) -> str:
    if summary is None:
        return "n/a"
    return _number(summary.get(name, math.nan), name)


def _number(value: float, name: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if name in ("errors", "requests"):
        return str(value)
    if name.endswith("_ms"):
        return f"{value:.3f}"
    if name.endswith("_mb") or name in ("open_s", "events_per_request"):
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
             if phase[target] is not None
             for kind, n in phase[target]["error_kinds"].items()]
    return "; ".join(found)
