"""`/metrics` under `serve` with two workers: whichever worker answers the scrape, it counts every
worker's requests, a killed worker's counts included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.observe.metrics import FLUSH_S
from proxy.store.redis_process import RedisProcess
from tests.support.config_files import MODEL
from tests.support.fleet import Stack
from tests.support.processes import free_port, wait_until_ready

CHAT = "/v2/compat/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def served(tmp_path: Path, clean_redis: RedisProcess) -> Iterator[Stack]:
    sim_port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "vllm", "--port",
                            str(sim_port), "--model", MODEL])
    stack = Stack(tmp_path, [{"name": "b0", "kind": "vllm", "url": f"http://127.0.0.1:{sim_port}",
                              "models": [MODEL]}], workers=2, redis_url=clean_redis.url,
                  gateway_extra={"access_log": "off"})
    try:
        wait_until_ready(f"http://127.0.0.1:{sim_port}/health", sim)
        yield stack.ready()
    finally:
        stack.close()
        sim.terminate()
        sim.wait(15)


def requests_counted(url: str) -> tuple[float, float]:
    """(chat requests answered 200, requests in flight) in one scrape, on a new connection
    (so any worker may answer it)."""
    text = httpx.get(f"{url}/metrics", headers={"Connection": "close"}).text
    answered = in_flight = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "igw_requests_total" and sample.labels["route"] == CHAT
                    and sample.labels["status"] == "200"):
                answered += sample.value
            elif sample.name == "igw_requests_in_flight":
                in_flight += sample.value
    return answered, in_flight


def settle(url: str, sent: int) -> None:
    """Wait until every worker has flushed its counts (each does so every FLUSH_S): all `sent`
    requests answered, and in flight only the scrape itself (a dead worker's gauge is gone)."""
    deadline = time.monotonic() + 3 * FLUSH_S + 2
    while requests_counted(url) != (sent, 1):
        assert time.monotonic() < deadline, requests_counted(url)
        time.sleep(0.1)


def test_every_workers_requests_are_in_every_scrape(served: Stack) -> None:
    url = served.url  # guests may chat on these tiers: no key needed
    sent, prefixes = 0, set[str]()
    for _ in range(200):  # new connections until both workers have answered some
        r = httpx.post(f"{url}{CHAT}", json=BODY, headers={"Connection": "close"})
        assert r.status_code == 200, r.text
        sent += 1
        prefixes.add(r.headers["X-Request-Id"][:16])  # each process has its own id prefix
        if len(prefixes) == 2 and sent >= 10:
            break
    assert len(prefixes) == 2, "the kernel gave every connection to one worker"
    settle(url, sent)
    for _ in range(6):  # whichever worker answers the scrape
        assert requests_counted(url)[0] == sent
    # A worker killed outright: its counts stay (its files remain), its replacement adds on.
    os.kill(served.workers()[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while len(served.workers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(served.workers()) == 2, "the killed worker was not replaced"
    time.sleep(1.0)  # the replacement binds the port once its app is up
    for _ in range(5):
        assert httpx.post(f"{url}{CHAT}", json=BODY, headers={"Connection": "close"}
                          ).status_code == 200
        sent += 1
    settle(url, sent)
    for _ in range(6):
        assert requests_counted(url)[0] == sent
