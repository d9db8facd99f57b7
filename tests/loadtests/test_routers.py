"""The routing benchmark's Rust routers (issue 31) and its sessions workload.

The routers are real processes from PyPI (in the `test` extra, and alone as `.[routers]`) in front
of real vLLM simulators.
No timing thresholds: the figures are for people to read (loadtests/README.md).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from loadtests import routers, routing
from loadtests.servers import Server, free_port, wait_ready
from proxy.simulators.textgen import prompt_tokens

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = routers.installed()


def test_sessions_repeat_the_conversation_and_draw_system_prompts_by_zipf() -> None:
    workload = routing.Sessions(prompts=10, zipf=1.2, system_tokens=60, turns=(3, 3),
                                question_tokens=(5, 10), reply_tokens=6, think_s=0.5)
    schedule = routing.plan_sessions(workload, 40.0, 30.0, seed=5)
    assert schedule == routing.plan_sessions(workload, 40.0, 30.0, seed=5)  # seeded
    assert schedule != routing.plan_sessions(workload, 40.0, 30.0, seed=6)
    offsets = [p.offset_s for p in schedule]
    assert offsets == sorted(offsets) and offsets[0] > 0 and offsets[-1] < 30.0
    assert 0.7 * 40 * 30 < len(schedule) < 1.3 * 40 * 30  # turns arrive at about the rate
    bodies = [orjson.loads(p.body) for p in schedule]
    systems = [m["content"] for m in workload.systems()]
    drawn = [systems.index(b["messages"][0]["content"]) for b in bodies
             if len(b["messages"]) == 2]  # each session's first turn
    counts = [drawn.count(i) for i in range(len(systems))]
    assert counts[0] > counts[2] > counts[-1], counts  # the most popular first
    # Every later turn repeats an earlier one whole, then a reply and a new user turn.
    firsts = {orjson.dumps(b["messages"]) for b in bodies if len(b["messages"]) == 2}
    seconds = [b["messages"] for b in bodies if len(b["messages"]) == 4]
    assert seconds and all(orjson.dumps(m[:2]) in firsts for m in seconds)
    assert all([m["role"] for m in b["messages"]] in (
        ["system", "user"], ["system", "user", "assistant", "user"],
        ["system", "user", "assistant", "user", "assistant", "user"]) for b in bodies)
    assert all(b["stream"] and b["model"] == routing.MODEL for b in bodies)
    assert all(p.prompt_tokens == prompt_tokens(b["messages"])
               for p, b in zip(schedule, bodies, strict=True))


def test_routers_extra_pins_the_versions_installed() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["routers"]
    pins = dict(item.split("==") for item in extra)
    assert set(pins) == set(routers.ROUTERS) == set(VERSIONS)
    for name, version in VERSIONS.items():
        assert version in (None, pins[name]), (name, version, pins[name])


def test_a_router_that_is_not_installed_is_skipped_or_required(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A router whose package cannot be imported: skipped with a line saying so, or an error
    with --routers (here nothing else is asked for, so neither run starts a server)."""
    monkeypatch.setitem(routers.ROUTERS, "vllm-router", routers.Router(
        "vllm-router", "no_such_package_for_this_test.launch_router", "warning"))
    assert routers.installed()["vllm-router"] is None
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert routing.main(["--quick", "--picks", "vllm-router"]) == 2
        err = capsys.readouterr().err
        assert "skipping vllm-router: not installed" in err and "nothing to run" in err
        assert routing.main(["--quick", "--picks", "vllm-router", "--routers"]) == 2
        assert "--routers: vllm-router: not installed" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def simulators(tmp_path: Path, count: int) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(count):
            port = free_port()
            server = Server(f"sim-{i}", routing.Engines(
                prefill_ms_per_1k_tokens=5, tokens_per_s=0, ttft_ms=0, completion_tokens=4,
            ).args(port, 1.0), tmp_path / f"sim-{i}.log", None)
            stack.callback(server.stop)
            urls.append(f"http://127.0.0.1:{port}")
            wait_ready(urls[-1] + "/health", server=server)
        yield urls


def _chat(url: str, system: str, question: str) -> str:
    body = {"model": routing.MODEL, "stream": True, "max_tokens": 8,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    request = urllib.request.Request(url + routers.CHAT_PATH, orjson.dumps(body),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def _completed(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return routing.parse_metrics(resp.read().decode()).get("vllm:request_success_total",
                                                                0.0)


@pytest.mark.parametrize("name", routers.ROUTERS)
def test_router_streams_through_and_keeps_a_prefix_on_one_worker(name: str,
                                                                 tmp_path: Path) -> None:
    """Started as the benchmark starts it, in front of three simulators: streamed chat goes
    through whole, and requests that share a long system prompt go to one worker (its
    cache-aware policy), while another system prompt may go elsewhere."""
    with simulators(tmp_path, 3) as sims:
        server, url = routers.start(name, sims, tmp_path / f"{name}.log")
        try:
            system = "You are the help desk. " + " ".join(["lorem ipsum dolor sit amet."] * 80)
            for i in range(6):
                answer = _chat(url, system, f"question {i} about the weather")
                assert answer.rstrip().endswith("data: [DONE]"), answer[-200:]
                assert '"finish_reason":"stop"' in answer
            done = [_completed(s) for s in sims]
            assert sum(done) == 6 and max(done) == 6, done
            assert server.popen.poll() is None
        finally:
            server.stop()
        # The Prometheus listener was given its own port: a second router can start at once.
        assert "Address already in use" not in server.log_tail(200)


def test_routing_quick_run_with_both_routers_and_sessions(tmp_path: Path) -> None:
    """`python -m loadtests.routing --quick --workload sessions --runs 2 --routers`: both
    routers (the gateway's picks run in tests/test_loadtests.py), fresh simulators for each,
    two runs; no errors, the engines' counters read, and each figure's mean and min-max
    reported."""
    out = tmp_path / "routing.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.routing", "--quick", "--workload", "sessions",
         "--runs", "2", "--duration", "1.5", "--warmup", "0.3", "--routers",
         "--picks", "vllm-router,sglang-router", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["picks"]) == ["vllm-router", "sglang-router"]
    assert doc["meta"]["workload_kind"] == "sessions" and doc["meta"]["runs"] == 2
    assert len(doc["runs"]) == 2 and doc["meta"]["skipped"] == []
    for name, summary in doc["picks"].items():
        assert summary["errors"] == 0, (name, summary["error_kinds"])
        assert summary["routed_by"] == f"{name} {VERSIONS[name]}"
        for run in doc["runs"]:
            assert run[name]["requests"] > 0 and run[name]["ttft_p50_ms"] > 0, name
            assert sum(r["completed"] for r in run[name]["replicas"]) > 0, name
            assert run[name]["prefix_cache_hit_rate"] > 0, name
        for key in ("ttft_p50_ms", "ttft_p99_ms", "prefix_cache_hit_rate",
                    "capacity_load_max_over_mean"):
            s = summary["spread"][key]
            assert s["min"] <= s["mean"] <= s["max"] and len(s["values"]) == 2, (name, key)
            assert summary[key] == s["mean"]
    assert "p99 min-max" in result.stdout and "vllm-router 0.1.17" in result.stdout
    assert (doc["meta"]["duration_s"], doc["meta"]["warmup_s"]) == (1.5, 0.3)
