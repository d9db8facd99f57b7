"""The load-test tooling works: the benchmark driver runs end to end, its pieces do what the
figures rely on, and the locustfile loads.

No timing thresholds here: CI machines are shared, so the figures are for people to read
(loadtests/README.md); CI only proves the driver measures both sides and every answer checks out.
CI has no nginx: the quick run uses the Python simulator, and the nginx mock's own test is
skipped where nginx is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtests import clock, loadgen, mock, procs, report
from loadtests.checks import StreamCheck, completion_problem
from loadtests.servers import Server, free_port, nginx_args, nginx_binary, wait_ready
from tests.support.config_files import GENEROUS_TIERS, MODEL, write_config
from tests.support.processes import wait_until_ready

ROOT = Path(__file__).resolve().parent.parent
LOADED = ("throughput", "stream", "open_loop")


def test_bench_quick_run_measures_both_targets_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.bench", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["phases"]) == {*LOADED, "rss"}
    for key in LOADED:
        for target in ("direct", "gateway"):
            summary = figures["phases"][key][target]
            assert summary["requests_per_s"] > 0, (key, target)
            assert summary["p50_ms"] > 0, (key, target)
            assert summary["errors"] == 0, (key, target, summary["error_kinds"])
    for target in ("direct", "gateway"):
        stream = figures["phases"]["stream"][target]
        assert stream["events_per_request"] == mock.STREAM_EVENTS, target  # same 52 both sides
        assert figures["phases"]["open_loop"][target]["lag_p99_ms"] >= 0
    rss = figures["phases"]["rss"]
    assert rss["direct"] is None
    assert rss["gateway"]["errors"] == 0, rss["gateway"]["error_kinds"]
    assert rss["gateway"]["streams_open"] == figures["meta"]["streams"] == 50
    assert rss["gateway"]["rss_idle_mb"] > 0 and rss["gateway"]["rss_open_mb"] > 0
    # A smoke run judges errors only; timing targets are shown, never checked.
    assert figures["passed"] is True
    assert [c["passed"] for c in figures["checks"] if c["field"] != "errors"] == [None] * 5
    assert "verdict:" in result.stdout
    assert "pinned: gateway worker" in result.stdout or "not pinned" in result.stdout
    # --quick stays a smoke run, whatever this machine's speed (its wall time is the
    # benchmark's to report, not a test's to bound): a second of load a phase, 50 streams.
    meta = figures["meta"]
    assert (meta["duration_s"], meta["warmup_s"], meta["streams"]) == (1.0, 0.3, 50)


def test_paired_run_measures_direct_base_and_this_without_errors(tmp_path: Path) -> None:
    """Two gateways at once (the base given as a folder: this checkout again, so no git is
    needed), alternating slices; every answer checks out and the difference is measured."""
    out = tmp_path / "paired.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.paired", str(ROOT), "--rounds", "2", "--slice", "0.3",
         "--rate", "100", "--keys", "5", "--mock", "simulator", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(out.read_text())
    for target in ("direct", "base", "this"):
        row = found["targets"][target]
        assert row["errors"] == 0 and row["requests"] == 2 * 30, (target, row)  # 0.3 s x 100/s
        assert row["p50_ms"] > 0
    for q in ("p50_ms", "p99_ms"):
        diff = found["this_minus_base"][q]
        assert diff["min"] <= diff["median"] <= diff["max"] and math.isfinite(diff["median"])
    assert "this - base, p50:" in result.stdout


def test_routing_quick_run_serves_every_pick_without_errors(tmp_path: Path) -> None:
    """`python -m loadtests.routing --quick`: three simulators and a two-worker gateway per pick;
    every pick streams its requests without an error and the engines' counters were read.
    `prefix` runs as `prefix-events`: the same pick, reading the simulators' KV-cache events."""
    out = tmp_path / "routing.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.routing", "--quick", "--json", str(out),
         "--picks", "p2c,engine,prefix-events",  # the routers, where installed: tests/loadtests/
         "--score", "running_weight=0.25"],  # given to the gateway's [routing]: it must load
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert list(figures["picks"]) == ["p2c", "engine", "prefix-events"]
    for pick, summary in figures["picks"].items():
        assert summary["errors"] == 0, (pick, summary["error_kinds"])
        assert summary["requests"] > 0 and summary["ttft_p50_ms"] > 0, pick
        assert sum(r["completed"] for r in summary["replicas"]) > 0, pick  # /metrics deltas
        assert summary["prefix_cache_hit_rate"] > 0, pick  # the shared starts hit
        # The busiest replica's completed per unit of capacity over the pool's.
        done = [(r["completed"], r["speed"]) for r in summary["replicas"]]
        pool = sum(c for c, _ in done) / sum(s for _, s in done)
        assert summary["capacity_load_max_over_mean"] == pytest.approx(
            max(c / s for c, s in done) / pool), pick
        # The gateway's own count of requests that waited for their prompt's holder.
        assert set(summary["holder_waits"]) <= {"holder", "elsewhere"}, pick
        assert all(n >= 0 for n in summary["holder_waits"].values()), pick
    assert figures["meta"]["score"] == {"running_weight": 0.25}
    assert "running_weight 0.25" in result.stdout
    # A smoke run judges errors only (here: engine against p2c; no router ran).
    assert figures["passed"] is True
    assert [c["passed"] for c in figures["checks"] if c["name"] != "failed requests, all picks"
            ] == [None]
    # --quick stays a smoke run, whatever this machine's speed (its wall time is the
    # benchmark's to report, not a test's to bound): three seconds of load a pick, one run.
    meta = figures["meta"]
    assert (meta["duration_s"], meta["warmup_s"], meta["runs"]) == (3.0, 0.5, 1)


def test_race_small_run_holds_the_token_limit_and_the_budget(tmp_path: Path) -> None:
    """`python -m loadtests.race` made small (~10 s): a real Redis Cluster, two one-worker
    gateways, 40 requests at once, two rounds on fresh accounts. Every property holds: only 200,
    429 (the token limit's) and 402 (the budget's), both limits bind, nothing over-admitted,
    the window, journal and engine agree, reconcile is clean."""
    out = tmp_path / "race.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.race", "--requests", "40", "--gateways", "2",
         "--workers", "1", "--rounds", "2", "--strict", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["passed"] is True and len(found["rounds"]) == 2
    assert [c["name"] for c in found["checks"] if not c["passed"]] == []
    for rnd in found["rounds"]:
        kinds = {(a["status"], a["error_type"]) for a in rnd["answers"]}
        assert kinds == {(200, ""), (429, "rate_limited"), (402, "budget_exceeded")}, kinds
        assert rnd["charges"] == sum(1 for a in rnd["answers"] if a["status"] == 200)
    assert "-> PASS" in result.stdout


def test_mock_stream_is_52_events_vllm_would_send() -> None:
    events = mock.stream_events()
    assert len(events) == mock.STREAM_EVENTS == 52
    docs = [json.loads(e) for e in events[:-1]]
    assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(d["choices"][0]["delta"]["content"] for d in docs[1:49])
    assert docs[49]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "stop"}
    assert docs[50]["choices"] == [] and docs[50]["usage"]["completion_tokens"] == 48
    assert events[-1] == b"[DONE]"
    check = StreamCheck()
    check.feed(mock.stream_body())
    assert check.finish() is None
    assert check.events == 52
    completion = mock.completion_body()
    assert completion_problem(200, completion) is None
    assert json.loads(completion)["usage"]["completion_tokens"] == mock.COMPLETION_TOKENS


def test_nginx_conf_parameters_fit_nginx_buffer(tmp_path: Path) -> None:
    conf = mock.nginx_conf(tmp_path, port=8081, slow_model="acme/slow-chat")
    # nginx refuses a single parameter longer than its 4 KiB config buffer.
    assert max(len(s) for s in re.findall(r'"(?:[^"\\]|\\.)*"', conf)) < 4000
    assert "access_log off;" in conf and "worker_processes 1;" in conf
    assert "limit_rate" in conf


def test_nginx_mock_answers(tmp_path: Path) -> None:
    binary = nginx_binary()
    if binary is None:
        pytest.fail("the benchmark's upstream mock is Debian's nginx, and it is missing: install "
                    "it with `apt-get install -y nginx-light` (as root)", pytrace=False)
    port = free_port()
    conf = mock.write_conf(tmp_path / "nginx", port=port, slow_model="acme/slow-chat")
    server = Server("nginx", nginx_args(binary, conf), tmp_path / "nginx.log", None)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/health", server=server, timeout=10)

        def post(path: str, accept: str) -> Any:
            request = urllib.request.Request(base + path, data=b"{}", method="POST",
                                             headers={"Accept": accept})
            return urllib.request.urlopen(request, timeout=5)

        with post("/v1/chat/completions", "application/json") as resp:
            assert resp.headers["Content-Type"] == "application/json"
            assert resp.read() == mock.completion_body()
        with post("/v1/chat/completions", "text/event-stream") as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            assert resp.read() == mock.stream_body()
        with post("/slow/v1/chat/completions", "application/json") as resp:  # deep probes
            assert completion_problem(200, resp.read()) is None
        started = time.monotonic()
        with post("/slow/v1/chat/completions", "text/event-stream") as resp:
            check = StreamCheck()
            while not check.feed(resp.read1(4096)):
                pass
            assert time.monotonic() - started < 1  # the first token at once, then a trickle
    finally:
        server.stop()


def test_gateway_target_rotates_keys_and_both_send_accept() -> None:
    target = loadgen.Target("gateway", "http://x", ("k1", "k2", "k3"))
    sent = [target.headers(stream=False)["X-API-Key"] for _ in range(4)]
    assert sent == ["k1", "k2", "k3", "k1"]
    assert target.headers(stream=True)["Accept"] == "text/event-stream"
    direct = loadgen.Target("direct", "http://x")
    assert direct.headers(stream=False) == {"Accept": "application/json"}
    body = json.loads(loadgen.chat_body("m", stream=True, max_tokens=64))
    assert body["stream_options"] == {"include_usage": True}


async def test_open_loop_keeps_the_schedule_and_times_from_it() -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=mock.completion_body(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with TestServer(app) as server:
        target = loadgen.Target("direct", str(server.make_url("/v1/chat/completions")))
        tally = loadgen.Tally()
        body = loadgen.chat_body("m", stream=False, max_tokens=8)
        async with loadgen.new_session(64) as session:
            started = time.perf_counter()
            await loadgen.run_open_loop(session, target, body, loadgen.chat_once, rate=400,
                                        duration_s=0.25, tally=tally)
            took = time.perf_counter() - started
    summary = tally.summary()
    assert summary["requests"] == 100 and summary["errors"] == 0
    assert len(tally.lags_s) == 100
    assert took >= 99 / 400  # the last request was not sent before its time
    assert min(tally.lags_s) >= 0  # nor any other
    assert all(lat >= lag for lat, lag in zip(sorted(tally.latencies_s), sorted(tally.lags_s),
                                              strict=True))


@pytest.mark.parametrize("precise", [
    pytest.param(True, id="timerfd",
                 marks=pytest.mark.skipif(not clock.PRECISE, reason="timerfd: Linux only")),
    pytest.param(False, id="sleeps")])
def test_the_clock_on_uvloop_is_never_early(precise: bool) -> None:
    """uvloop's millisecond timers ended sleeps up to ~1 ms early, so open-loop requests started
    before their due time and their latencies came out short. Both ways of waiting (a timerfd on
    Linux, sleeping again elsewhere) return only once the due time has passed."""
    seen: list[tuple[float, float]] = []

    async def run() -> None:
        start = time.perf_counter()
        with contextlib.closing(clock.Clock(precise)) as waits:
            for i in range(300):
                due = start + i / 2000
                await waits.until(due)
                seen.append((due, time.perf_counter()))
                if i % 3 == 0:  # a loop kept busy now and then, as under load
                    busy_until = time.perf_counter() + 0.0007
                    while time.perf_counter() < busy_until:
                        pass

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    assert len(seen) == 300
    assert all(at >= due for due, at in seen)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning: Linux only")
def test_core_times_count_a_busy_core_as_busy() -> None:
    """This thread spins 0.3 s pinned to one core: that core reads at least that busy (the
    tick-sampled /proc/stat misread a load that kept time with the tick)."""
    core = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        before = procs.core_times()
        spin_until = time.perf_counter() + 0.3
        while time.perf_counter() < spin_until:
            pass
        after = procs.core_times()
    finally:
        os.sched_setaffinity(0, saved)
    busy = after[core][0] - before[core][0]
    total = after[core][1] - before[core][1]
    assert 0.25 <= busy <= total + 0.01


def test_idle_seconds_need_every_cpu(tmp_path: Path) -> None:
    for cpu in range(os.cpu_count() or 1):
        for state, micros in (("state0", 1_000), ("state1", 2_500_000)):
            (tmp_path / f"cpu{cpu}" / "cpuidle" / state).mkdir(parents=True)
            (tmp_path / f"cpu{cpu}" / "cpuidle" / state / "time").write_text(f"{micros}\n")
    assert procs._idle_seconds(tmp_path) == {cpu: 2.501 for cpu in range(os.cpu_count() or 1)}
    for state in ("state0", "state1"):  # one CPU without the counters: none are used
        (tmp_path / "cpu0" / "cpuidle" / state / "time").unlink()
    assert procs._idle_seconds(tmp_path) == {}


def _summary(**values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"requests": 10, "errors": 0, "error_kinds": {},
                            "requests_per_s": math.nan, "p50_ms": math.nan, "p99_ms": math.nan,
                            "events_per_request": math.nan, "events_per_s": math.nan,
                            "lag_p99_ms": 0.1, "lag_max_ms": 0.2, "client_cpu_pct": 1.0,
                            "server_cpu_pct": {}, "core_busy_pct": {}}
    return {**base, **values}


def _figures(*, judged: bool, gateway_rps: float = 3000, added_p99: float = 1.0,
             rss_mb: float = 90.0, errors: int = 0) -> dict[str, Any]:
    summaries: dict[str, dict[str, dict[str, Any] | None]] = {
        "throughput": {"direct": _summary(requests_per_s=9000),
                       "gateway": _summary(requests_per_s=gateway_rps, errors=errors,
                                           error_kinds={"HTTP 503": errors} if errors else {})},
        "stream": {"direct": _summary(requests_per_s=5000),
                   "gateway": _summary(requests_per_s=1600)},
        "open_loop": {"direct": _summary(p50_ms=0.3, p99_ms=1.0),
                      "gateway": _summary(p50_ms=0.7, p99_ms=1.0 + added_p99)},
        "rss": {"direct": None, "gateway": _summary(rss_idle_mb=70, rss_open_mb=rss_mb)},
    }
    meta = {"usable_cores": 2, "load_average_1m": {"before": 0.5, "after": 2.5}, "notes": [],
            "judged": judged}
    return report.build(meta, summaries, {}, judged=judged)


def test_report_verdicts() -> None:
    good = _figures(judged=True)
    assert good["passed"] is True
    assert good["phases"]["open_loop"]["compare"]["added_p50_ms"] == pytest.approx(0.4)
    assert good["phases"]["throughput"]["compare"]["requests_per_s_ratio"] == pytest.approx(1 / 3)
    assert math.isnan(good["phases"]["rss"]["compare"].get("x", math.nan))
    for bad in (_figures(judged=True, gateway_rps=2400), _figures(judged=True, added_p99=2.5),
                _figures(judged=True, rss_mb=101), _figures(judged=True, rss_mb=math.nan),
                _figures(judged=True, errors=1)):
        assert bad["passed"] is False
    # The smoke run judges errors only.
    assert _figures(judged=False, gateway_rps=10, rss_mb=500)["passed"] is True
    assert _figures(judged=False, errors=2)["passed"] is False
    text = report.render(_figures(judged=True, errors=2))
    assert "HTTP 503 x2" in text and "FAIL" in text
    assert "n/a" in text  # the memory phase has no direct side


def test_locustfile_loads_without_starting_a_run() -> None:
    # In a subprocess: importing locust monkey-patches the interpreter with gevent.
    result = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--list"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ChatUser" in result.stdout
    assert "StreamingChatUser" in result.stdout
    assert "AsyncTaskUser" in result.stdout


def test_locust_async_scenario_runs_against_a_gateway(tmp_path: Path) -> None:
    """The async scenario for real: a `serve` in front of a simulator, locust headless for a few
    seconds with AsyncTaskUser only; its verdict (exit code) passes and tasks completed."""
    sim_port, gw_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_ADMIN_TOKEN": secrets.token_hex(8)}
    env.pop("GATEWAY_REDIS_URL", None)
    folder = write_config(
        tmp_path / "config",
        [{"name": "chat-a", "kind": "vllm", "url": f"http://127.0.0.1:{sim_port}",
          "models": [MODEL]}],
        gateway={"port": gw_port, "data_dir": str(tmp_path / "data"), "workers": 1},
        policies={"tiers.toml": GENEROUS_TIERS})
    sim = subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "vllm", "--port",
                            str(sim_port), "--model", MODEL], env=env)
    gateway = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config",
                                str(folder)], env=env)
    try:
        wait_until_ready(f"http://127.0.0.1:{sim_port}/health", sim)
        wait_until_ready(f"http://127.0.0.1:{gw_port}/readyz", gateway)
        key = subprocess.run([sys.executable, "-m", "proxy", "keys", "create", "--account",
                              "load", "--tier", "max", "--config", str(folder)], env=env,
                             capture_output=True, text=True, check=True).stdout.split()[0]
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "AsyncTaskUser",
             "--headless", "-u", "4", "-r", "4", "-t", "4s", "--host",
             f"http://127.0.0.1:{gw_port}", "--api-key", key, "--csv", str(tmp_path / "run")],
            cwd=ROOT, capture_output=True, text=True, timeout=90, env=env, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        stats = (tmp_path / "run_stats.csv").read_text()
        tasks = next(line for line in stats.splitlines() if ",async task," in line).split(",")
        assert int(tasks[2]) > 0 and int(tasks[3]) == 0  # requests, failures
    finally:
        for proc in (gateway, sim):
            proc.terminate()
            proc.wait(15)
