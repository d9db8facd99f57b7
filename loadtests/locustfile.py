"""Locust scenarios: steady chat, non-streaming, streaming and async (submit and poll), with a
verdict at the end.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8080                  # the gateway
    locust -f loadtests/locustfile.py --host http://127.0.0.1:8081 --target direct  # a simulator

Options (each also an environment variable): --target gateway|direct (LOADTEST_TARGET),
--max-error-rate (LOADTEST_MAX_ERROR_RATE, default 0.01), --model (LOADTEST_MODEL),
--max-tokens (LOADTEST_MAX_TOKENS), --api-key (LOADTEST_API_KEY, sent to the gateway only).

Every answer is checked as the benchmark driver checks it (loadtests/checks.py). Streams report
their whole duration under "chat stream" and time to first token as its own entry,
"SSE / time to first token". When locust quits, the exit code is 1 if the error rate of the chat
requests is above the threshold or no request was made.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from locust import FastHttpUser, between, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import WorkerRunner

# locust puts only this file's folder on sys.path; the shared checks live in the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtests.checks import StreamCheck, completion_problem

PATHS = {"gateway": "/v2/compat/v1/chat/completions", "direct": "/v1/chat/completions"}
TTFT_TYPE = "SSE"  # request_type of the time-to-first-token entries; not a request of its own

log = logging.getLogger("loadtests")


# locust's event decorators are untyped.
@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
def _options(parser: Any) -> None:
    parser.add_argument("--target", choices=sorted(PATHS), default="gateway",
                        env_var="LOADTEST_TARGET",
                        help="gateway: /v2/compat/v1/chat/completions; direct: an upstream's "
                             "/v1/chat/completions")
    parser.add_argument("--max-error-rate", type=float, default=0.01,
                        env_var="LOADTEST_MAX_ERROR_RATE",
                        help="exit 1 when failed / total chat requests exceeds this")
    parser.add_argument("--model", default="acme/small-chat", env_var="LOADTEST_MODEL")
    parser.add_argument("--max-tokens", type=int, default=64, env_var="LOADTEST_MAX_TOKENS")
    parser.add_argument("--api-key", default="", env_var="LOADTEST_API_KEY", is_secret=True,
                        help="Bearer token for the gateway (not sent with --target direct)")


class _Chat(FastHttpUser):
    abstract = True
    wait_time = between(0.1, 1.0)
    stream = False

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        target = getattr(opts, "target", "gateway")
        self.path = PATHS[target]
        self.headers = {"Content-Type": "application/json"}
        if target == "gateway" and getattr(opts, "api_key", ""):
            self.headers["Authorization"] = f"Bearer {opts.api_key}"
        # str: FastHttpSession's signature takes str (it encodes it as UTF-8).
        self.body = orjson.dumps({
            "model": getattr(opts, "model", "acme/small-chat"),
            "messages": [{"role": "user", "content": "Say something short."}],
            "max_tokens": getattr(opts, "max_tokens", 64),
            "stream": self.stream,
        }).decode()


class ChatUser(_Chat):
    """Non-streaming chat: one JSON answer per request."""

    weight = 1

    @task
    def chat(self) -> None:
        with self.client.post(self.path, data=self.body, headers=self.headers, name="chat",
                              catch_response=True) as resp:
            problem = completion_problem(resp.status_code, resp.content or b"")
            if problem:
                resp.failure(problem)


class StreamingChatUser(_Chat):
    """Streaming chat, read to `data: [DONE]`; the more common shape of traffic, hence weight 3."""

    weight = 3
    stream = True

    @task
    def chat_stream(self) -> None:
        start = time.perf_counter()
        ttft_ms: float | None = None
        with self.client.post(self.path, data=self.body, headers=self.headers,
                              name="chat stream", stream=True, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            check = StreamCheck()
            size = 0
            for chunk in resp.iter_content(chunk_size=16384, decode_content=False):
                size += len(chunk)
                if check.feed(chunk):
                    ttft_ms = (time.perf_counter() - start) * 1000
            # With stream=True locust times only the headers; report the whole stream instead.
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            resp.request_meta["response_length"] = size
            problem = check.finish()
            if problem:
                resp.failure(problem)
        if ttft_ms is not None:
            self.environment.events.request.fire(
                request_type=TTFT_TYPE, name="time to first token", response_time=ttft_ms,
                response_length=0, exception=None, context={},
            )


class AsyncTaskUser(_Chat):
    """Async chat (`async: true`): submit, then poll `poll_url` until the task ends. Reports
    "async submit" (the 202) and "async task" (submission to completion, polls included).
    Gateway only: a direct upstream has no tasks."""

    weight = 1

    def on_start(self) -> None:
        super().on_start()
        if self.path != PATHS["gateway"]:
            raise StopUser()
        self.body = orjson.dumps({**orjson.loads(self.body), "stream": False,
                                  "async": True}).decode()

    @task
    def submit_and_poll(self) -> None:
        start = time.perf_counter()
        with self.client.post(self.path, data=self.body, headers=self.headers,
                              name="async submit", catch_response=True) as resp:
            if resp.status_code != 202:
                resp.failure(f"HTTP {resp.status_code}")
                return
            poll = orjson.loads(resp.content or b"{}").get("poll_url", "")
        deadline = start + 60
        status = "running"
        while status == "running" and time.perf_counter() < deadline:
            time.sleep(0.1)
            with self.client.get(poll, headers=self.headers, name="async poll",
                                 catch_response=True) as resp:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}")
                    return
                record = orjson.loads(resp.content or b"{}")
                status = record.get("status", "")
        failed = status != "completed" or completion_problem(
            200, orjson.dumps(record.get("result"))) is not None
        self.environment.events.request.fire(
            request_type="TASK", name="async task",
            response_time=(time.perf_counter() - start) * 1000, response_length=0,
            exception=RuntimeError(f"task ended {status}") if failed else None, context={})


@events.quitting.add_listener  # type: ignore[untyped-decorator]
def _verdict(environment: Environment, **_: Any) -> None:
    """A load test with a verdict: too many errors, or no traffic at all, fails the run."""
    if isinstance(environment.runner, WorkerRunner):
        return  # the master judges the totals
    limit = getattr(environment.parsed_options, "max_error_rate", 0.01)
    chats = [s for (_name, method), s in environment.stats.entries.items() if method != TTFT_TYPE]
    total = sum(s.num_requests for s in chats)  # failures are counted in num_requests too
    failed = sum(s.num_failures for s in chats)
    if total == 0:
        log.error("verdict: FAIL, no chat request was made")
        environment.process_exit_code = 1
    elif failed / total > limit:
        log.error("verdict: FAIL, error rate %.2f%% > %.2f%% (%d of %d)",
                  100 * failed / total, 100 * limit, failed, total)
        environment.process_exit_code = 1
    else:
        log.info("verdict: PASS, error rate %.2f%% <= %.2f%% (%d of %d)",
                 100 * failed / total, 100 * limit, failed, total)
