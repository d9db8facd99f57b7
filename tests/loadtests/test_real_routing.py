"""The real-vLLM routing benchmark's own parts (loadtests/real_routing.py): its workload, its
arguments, its load (against a simulator) and its summary. Its runs start real vLLM replicas (a
minute each), so the suite does not run one; the figures are in loadtests/README.md.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest

from loadtests import real_routing, routing
from tests.support.upstreams import SimulatorFactory


def test_the_workload_is_seeded_and_draws_the_popular_system_prompts_most() -> None:
    conversations = real_routing.workload(3, 400)
    assert conversations == real_routing.workload(3, 400)
    assert conversations != real_routing.workload(4, 400)
    systems = collections.Counter(c[0]["content"] for c in conversations)
    assert 10 < len(systems) <= real_routing.PROMPTS
    counts = sorted(systems.values(), reverse=True)
    assert counts[0] > 4 * counts[-1]  # Zipf: the first is drawn about 24 times the last
    questions = [c[1]["content"] for c in conversations]
    assert len(set(questions)) == 400  # every request ends in a prompt of its own
    assert all(len(c[0]["content"].split()) == 60 for c in conversations)


def test_the_summary_is_the_mean_and_range_of_each_configs_runs() -> None:
    runs = [{"config": "prefix", "seed": s, "errors": e, "requests": 240, "hit_rate": h,
             "ttft_p50_ms": p50, "ttft_p99_ms": p99, "prefill_ms_per_1k_tokens": 100.0 * s,
             "learned_ms_per_1k_tokens": 50.0 * s, "req_per_s": 40.0 + 10 * s,
             "ttft_max_start_ms": 100.0 + s}
            for s, e, h, p50, p99 in ((1, 0, 0.6, 90.0, 300.0), (2, 1, 0.7, 100.0, 200.0))]
    runs.append({"config": "vllm-router", "seed": 1, "errors": 0, "requests": 240,
                 "hit_rate": 0.5, "ttft_p50_ms": 80.0, "ttft_p99_ms": 900.0,
                 "prefill_ms_per_1k_tokens": 90.0, "learned_ms_per_1k_tokens": float("nan"),
                 "req_per_s": 80.0, "ttft_max_start_ms": 90.0})
    [prefix, router] = real_routing.summarise(runs, ["prefix", "vllm-router"])
    assert prefix["runs"] == 2 and prefix["errors"] == 1
    assert prefix["hit_rate"] == pytest.approx(0.65)
    assert prefix["hit_rate_range"] == (0.6, 0.7)
    assert prefix["ttft_p99_ms"] == 250.0 and prefix["ttft_p99_ms_range"] == (200.0, 300.0)
    assert prefix["prefill_ms_per_1k_tokens"] == 150.0
    assert prefix["learned_ms_per_1k_tokens"] == 75.0
    assert router["runs"] == 1 and router["ttft_p50_ms"] == 80.0
    table = real_routing.render([prefix, router])
    assert "65.0 % (60.0-70.0)" in table and "250 (200-300)" in table
    # the sums' ratio; the fit; completed requests a second; the start's slowest
    assert table.splitlines()[1].split()[-4:] == ["150", "75", "55.0", "102"]


@pytest.mark.parametrize("argv", [["--seeds", "x"], ["--configs", "nginx"], ["--seeds", ""],
                                  ["--requests", "0"], ["--concurrency", "-1"],
                                  ["--rate", "0"], ["--warmup", "-1"],
                                  ["--requests", "10", "--warmup", "10"]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        real_routing.parse_args(argv)
    assert exit_.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_defaults_run_every_config_on_three_seeds() -> None:
    args = real_routing.parse_args([])
    assert args.seeds == [1, 2, 3]
    assert args.configs == ["prefix", "prefix-events", "vllm-router", "sglang-router"]


def test_trace_sorts_requests_by_what_their_replica_held(tmp_path: Path) -> None:
    a, b = [{"role": "system", "content": "A"}], [{"role": "system", "content": "B"}]
    conversations = [a, a, b, a, a, b]
    (tmp_path / "r0.log").write_text("INFO Received request chatcmpl-0: params: ...\n"
                                     "INFO Received request chatcmpl-1: params: ...\n"
                                     "INFO Received request chatcmpl-4: params: ...\n")
    (tmp_path / "r1.log").write_text("INFO Received request chatcmpl-2: params: ...\n"
                                     "INFO Received request chatcmpl-3: params: ...\n")
    traced = {0: ("chatcmpl-0", 400, 0, 0.2),     # A's first sight, on r0
              1: ("chatcmpl-1", 400, 384, 0.1),   # A again on r0: cached
              2: ("chatcmpl-2", 400, 0, 0.2),     # B's first sight, on r1
              3: ("chatcmpl-3", 400, 0, 0.3),     # A on r1, which had never been sent it
              4: ("chatcmpl-4", 400, 32, 0.2),    # A on r0 again, evicted since
              5: ("chatcmpl-9", 400, 384, 0.1)}   # logged by neither
    kinds = real_routing.kind_of(conversations, traced, real_routing.replica_of(
        {"r0": tmp_path / "r0.log", "r1": tmp_path / "r1.log"}))
    assert kinds == {0: "first", 1: "hit", 2: "first", 3: "elsewhere", 4: "evicted",
                     5: "unmatched"}
    kinds_counted = real_routing.count_kinds(kinds)
    assert kinds_counted == {"first": 2, "elsewhere": 1, "evicted": 1, "hit": 1,
                             "unmatched": 1}


def test_the_gateways_holder_waits_are_read_by_outcome() -> None:
    text = ('# TYPE igw_prefix_holder_waits_total counter\n'
            'igw_prefix_holder_waits_total{model="a",outcome="holder"} 8.0\n'
            'igw_prefix_holder_waits_total{model="b",outcome="holder"} 2.0\n'
            'igw_prefix_holder_waits_total{model="a",outcome="elsewhere"} 1.0\n'
            'igw_prefix_holder_waits_created{model="a",outcome="holder"} 1.7e9\n')
    assert routing.by_label(text, routing.HOLDER_WAITS, "outcome") == {"holder": 10.0,
                                                                        "elsewhere": 1.0}


async def test_the_open_loop_sends_each_request_when_due_answered_or_not(
        simulator: SimulatorFactory) -> None:
    """A simulator that takes 300 ms before each first token and runs one request at a time
    (`max_concurrency` 1, the rest queued): closed loop, one at a time, the ten take 3 s; open
    loop at 100 a second, all ten are sent within about 0.1 s, so the engine's queue holds them
    and the later ones' first tokens wait longer."""
    sim = await simulator(models=(real_routing.SERVED,), ttft_ms=300, max_concurrency=1)
    url = str(sim.make_url("/v1/chat/completions"))
    conversations = real_routing.workload(1, 10)
    begun = time.perf_counter()
    ttfts, errors = await real_routing.drive(url, (), conversations, 1)
    closed_s = time.perf_counter() - begun
    assert errors == 0 and sorted(ttfts) == list(range(10))  # by conversation
    assert closed_s >= 3.0 and max(ttfts.values()) < 0.6  # each waited for no other
    begun = time.perf_counter()
    ttfts, errors = await real_routing.drive(url, (), conversations, 1, rate=100.0, seed=1)
    open_s = time.perf_counter() - begun
    assert errors == 0 and len(ttfts) == 10
    assert open_s >= 3.0  # the engine still serves one at a time
    assert max(ttfts.values()) > 2.0  # the last queued behind the nine sent before it
