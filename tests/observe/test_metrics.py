"""`/metrics` and the access log after real traffic: gateway -> real simulator, over HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer, make_mocked_request
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from proxy.credits.ledger import Ledger
from proxy.observe.access_log import BATCH_MAX, QUEUE_MAX, AccessLog
from proxy.observe.metrics import Labels, Metrics
from proxy.observe.trace import Trace
from tests.support.accounts import new_key
from tests.support.config_files import GENEROUS_TIERS, MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

CHAT = "/v2/compat/v1/chat/completions"
ROUTE = "/v2/compat/v1/chat/completions"  # the route template: this route has no parameters
HELLO = [{"role": "user", "content": "Say hello."}]
# A tier that allows one request a minute, to see 429s counted.
TIERS = GENEROUS_TIERS + """
[tiers.basic]
requests_per_minute = 1
families = ["chat"]
models = { "*" = ["direct"] }
"""
PRICES = f"""
version = "test-v1"
default_max_tokens = 100
[models."{MODEL}"]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(gw: TestServer) -> tuple[str, Samples]:
    async with aiohttp.ClientSession() as session, session.get(gw.make_url("/metrics")) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


async def fund(redis_url: str, *accounts: str) -> None:
    redis = Redis.from_url(redis_url)
    try:
        for account in accounts:
            await Ledger(redis).credit(account, 10**9, {"reason": "test"})
    finally:
        await redis.aclose()


async def chat(gw: TestServer, key: str | None, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(CHAT), data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **auth, **(headers or {})}) as r:
        return r.status, await r.read()


async def test_a_scrape_after_mixed_traffic(simulator: SimulatorFactory,
                                            gateway: GatewayFactory, clean_redis: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, policies={"tiers.toml": TIERS, "prices.toml": PRICES})
    key: str = gw.api_key  # type: ignore[attr-defined]
    basic = await new_key(clean_redis.url, tier="basic", account="acct-basic")
    await fund(clean_redis.url, "acct-test", "acct-basic")
    _, before = await scrape(gw)

    status, body = await chat(gw, key, {"model": MODEL, "messages": HELLO})
    assert status == 200
    usage = orjson.loads(body)["usage"]
    status, _ = await chat(gw, key, {"model": MODEL, "messages": HELLO, "stream": True})
    assert status == 200
    assert (await chat(gw, "sk-not-a-real-key", {"model": MODEL, "messages": HELLO}))[0] == 401
    evil = "acme/../../secret-model-name"  # client text must never become a label
    assert (await chat(gw, key, {"model": evil, "messages": HELLO}))[0] == 404
    assert (await chat(gw, basic, {"model": MODEL, "messages": HELLO}))[0] == 200
    assert (await chat(gw, basic, {"model": MODEL, "messages": HELLO}))[0] == 429
    status, _ = await chat(gw, key, {"model": MODEL, "messages": HELLO, "stream": True},
                           {"x-sim-cut-after": "3"})
    assert status == 200  # the stream broke after its 200: an in-band error event
    assert (await chat(gw, None, {"model": MODEL, "messages": HELLO}))[0] == 200  # a guest
    await settled(gw)
    text, after = await scrape(gw)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = {"route": ROUTE, "model": MODEL, "tier": "max", "status": "200"}
    assert delta("igw_requests_total", **ok) == 3
    assert delta("igw_request_duration_seconds_count", **ok) == 3
    assert delta("igw_requests_total", route=ROUTE, tier="", status="401") == 1
    assert delta("igw_denied_total", type="invalid_api_key") == 1
    assert delta("igw_requests_total", route=ROUTE, model="", tier="max", status="404") == 1
    assert delta("igw_errors_total", route=ROUTE, type="not_found") == 1
    assert delta("igw_rate_limited_total", tier="basic") == 1
    assert delta("igw_requests_total", route=ROUTE, tier="basic", status="429") == 1
    assert delta("igw_time_to_first_token_seconds_count", route=ROUTE, model=MODEL) == 2
    assert delta("igw_stream_endings_total", route=ROUTE, outcome="completed") == 1
    assert delta("igw_stream_endings_total", route=ROUTE, outcome="cut") == 1
    assert delta("igw_upstream_failures_total", backend="b0", type="stream_broken") == 1
    assert delta("igw_upstream_response_seconds_count", backend="b0") == 5  # 200s and the cut
    assert delta("igw_tokens_total", model=MODEL, kind="prompt") >= usage["prompt_tokens"]
    assert delta("igw_requests_in_flight") == 0
    assert value(after, "igw_backend_up", backend="b0", model=MODEL, kind="vllm") == 1
    assert value(after, "igw_backend_in_flight", backend="b0") == 0
    assert value(after, "igw_task_queue_depth", state="waiting") == 0
    # Credits: what the ledger says both accounts spent, to the micro-credit.
    redis = Redis.from_url(clean_redis.url)
    try:
        ledger = Ledger(redis)
        spent = sum([(await ledger.balance(a)).spent for a in ("acct-test", "acct-basic")])
    finally:
        await redis.aclose()
    charged = delta("igw_credits_charged_total", model=MODEL)
    assert spent > 0 and abs(charged - spent / 1e6) < 1e-9
    assert delta("igw_credits_charged_total", model=MODEL, tier="basic") > 0
    assert delta("igw_credits_charged_total", tier="guest") == 0  # guests pay nothing ...
    assert delta("igw_requests_total", tier="guest", status="200") == 1  # ... but are counted
    # Label values come from fixed sets: no key, account or client text.
    for secret in (key, basic, "acct-test", "acct-basic", evil, "sk-not-a-real-key"):
        assert secret not in text


async def test_access_log_lines(simulator: SimulatorFactory, gateway: GatewayFactory,
                                tmp_path: Path, clean_redis: Any) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, settings={"access_log": "logs/access.jsonl"},
                       policies={"prices.toml": PRICES})
    key: str = gw.api_key  # type: ignore[attr-defined]
    await fund(clean_redis.url, "acct-test")
    status, _ = await chat(gw, key, {"model": MODEL, "messages": HELLO},
                           {"X-Request-Id": "client-req-1"})
    assert status == 200
    await chat(gw, key, {"model": MODEL, "messages": HELLO, "stream": True},
               {"x-sim-cut-after": "2", "X-Request-Id": "client-req-2"})
    await chat(gw, key, {"model": MODEL, "messages": HELLO}, {"x-sim-status": "500",
                                                               "X-Request-Id": "client-req-3"})
    await chat(gw, None, {"model": MODEL, "messages": HELLO, "secret": "in-the-body"},
               {"Authorization": "Bearer sk-wrong-key", "X-Request-Id": "client-req-4"})
    async with aiohttp.ClientSession() as session:
        await (await session.get(gw.make_url("/healthz"))).read()
    await settled(gw)
    path = tmp_path / "config" / "logs" / "access.jsonl"
    lines: list[dict[str, Any]] = []
    for _ in range(100):  # written by the log's own thread
        if path.exists():
            lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        if len(lines) >= 4:
            break
        await asyncio.sleep(0.02)
    by_id = {line["request_id"]: line for line in lines}
    assert set(by_id) == {"client-req-1", "client-req-2", "client-req-3", "client-req-4"}
    ok = by_id["client-req-1"]
    assert ok["route"] == ROUTE and ok["status"] == 200 and ok["method"] == "POST"
    assert ok["model"] == MODEL and ok["tier"] == "max" and ok["account"] == "acct-test"
    assert ok["backend"] == "b0" and ok["units"]["completion_tokens"] > 0
    # Credits as the account API writes them: 7 prompt and 16 completion tokens at the test's
    # prices (1,000 and 10,000 micro-credits per 1k tokens), rounded up once.
    assert ok["credits"] == "0.000167"
    assert ok["latency_ms"] >= 0 and "error" not in ok
    cut = by_id["client-req-2"]
    assert cut["status"] == 200 and cut["outcome"] == "cut" and cut["first_byte_ms"] >= 0
    assert by_id["client-req-3"]["status"] == 502
    assert by_id["client-req-3"]["error"] == "upstream_error"
    denied = by_id["client-req-4"]
    assert denied["status"] == 401 and denied["error"] == "invalid_api_key"
    assert "account" not in denied
    text = path.read_text()
    for secret in (key, "sk-wrong-key", "in-the-body", "Authorization"):
        assert secret not in text
    # logrotate moves the file away: the next line starts a new one.
    path.rename(path.with_suffix(".1"))
    await chat(gw, key, {"model": MODEL, "messages": HELLO}, {"X-Request-Id": "client-req-5"})
    for _ in range(100):
        if path.exists() and path.read_bytes().endswith(b"\n"):
            break
        await asyncio.sleep(0.02)
    assert [orjson.loads(line)["request_id"] for line in path.read_bytes().splitlines()] == [
        "client-req-5"]


_STDERR_LOG = """
import sys
from aiohttp.test_utils import make_mocked_request
from proxy.observe.access_log import AccessLog
from proxy.observe.trace import Trace

def writes() -> int:  # write system calls made by this process so far
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("syscw:")).split()[1])

log = AccessLog("stderr", ".")
log.start()
request = make_mocked_request("POST", sys.argv[1])
before = writes()
for i in range(400):
    log.write(request, Trace(sys.argv[2]), 200, f"req-{i}")
log.stop()
print(writes() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts writes in /proc/self/io")
def test_access_log_to_stderr_writes_batches_not_lines() -> None:
    """stderr (the default) has no buffer of its own in Python; the log gives it one, so 400
    lines (~40 KB) take a few writes, not 400, and every line arrives whole."""
    done = subprocess.run([sys.executable, "-c", _STDERR_LOG, CHAT, ROUTE], capture_output=True,
                          check=True, cwd=Path(__file__).parents[2], timeout=60)
    lines = [orjson.loads(line) for line in done.stderr.splitlines()]
    assert [line["request_id"] for line in lines] == [f"req-{i}" for i in range(400)]
    assert int(done.stdout) < 40  # ~100 lines per 4 KB write (and stop's print, if counted)


def test_a_writer_that_cannot_keep_up_drops_lines_and_counts_them(tmp_path: Path) -> None:
    """The log goes to a pipe nobody reads: the writer blocks, the queue fills to QUEUE_MAX, and
    further lines are dropped (the request path never waits) and counted in
    igw_access_log_dropped_total, instead of growing the worker's memory."""
    fifo = tmp_path / "full.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, never read
    metrics = Metrics(Labels([MODEL], lambda: {"max"}, ["b0"]), CollectorRegistry())
    log = AccessLog(fifo.name, str(tmp_path), metrics)
    log.start()
    request = make_mocked_request("POST", CHAT)
    try:
        # The writer takes one batch (at most BATCH_MAX lines, more than the pipe's 64 KB
        # buffer holds) and blocks writing it; the queue keeps the next QUEUE_MAX.
        extra = 500
        for _ in range(BATCH_MAX + QUEUE_MAX + extra):
            log.write(request, Trace(ROUTE), 200, "req")
        assert log.dropped >= extra
        assert metrics.registry.get_sample_value("igw_access_log_dropped_total") == log.dropped
    finally:
        os.close(reader)  # the writer's next write fails (no reader): it ends its batch
        log.stop()
