"""The load-test tooling works: the benchmark driver runs end to end and the locustfile loads.

No timing thresholds here: CI machines are shared, so the figures are for people to read
(loadtests/README.md); CI only proves the driver measures both sides and every answer checks out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_quick_run_measures_both_targets_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.bench", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert set(figures["phases"]) == {"latency", "throughput", "stream_c1", "stream"}
    for key, phase in figures["phases"].items():
        for target in ("direct", "gateway"):
            summary = phase[target]
            assert summary["requests_per_s"] > 0, (key, target)
            assert summary["errors"] == 0, (key, target, summary["error_kinds"])
    for target in ("direct", "gateway"):
        assert figures["phases"]["stream"][target]["events_per_s"] > 0
    assert "verdict:" in result.stdout


def test_locustfile_loads_without_starting_a_run() -> None:
    # In a subprocess: importing locust monkey-patches the interpreter with gevent.
    result = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--list"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ChatUser" in result.stdout
    assert "StreamingChatUser" in result.stdout
