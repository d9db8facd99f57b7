"""The servers under test as child processes: an upstream mock (nginx or the Python simulator), a
slow simulator for the open-streams phase, and a gateway with one worker in front of them.

Each child gets its own session (a terminal's Ctrl-C reaches only the driver, which then stops
them in order) and, on Linux, a parent-death signal, so even a SIGKILLed driver leaves no
servers behind. Everything starts on the load core; once the gateway is ready, its one worker
process (every thread of it) is moved alone to the other core (DESIGN §7).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests import procs

_PR_SET_PDEATHSIG = 1
# The children run `python -m proxy` from this working tree, whatever the caller's directory.
ROOT = Path(__file__).resolve().parent.parent
WORKER_MODULE = "proxy.runtime.worker"
BENCH_TIER = "bench"
# Where Debian and most distributions install nginx; often missing from a non-root PATH.
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
# Variables that would point a started gateway (or the key provisioning) at someone else's Redis.
_SCRUBBED_ENV = ("GATEWAY_REDIS_URL", "GATEWAY_RATELIMIT_REDIS_URL")


class ServerFailed(RuntimeError):
    """A server exited early or never became ready; the message ends with its log tail."""


@dataclass(frozen=True)
class Pinning:
    worker_core: int  # the gateway's one worker process, alone
    load_core: int  # load generator, upstream mocks, the gateway's master and redis-servers


def plan_pinning() -> Pinning | None:
    """The gateway worker on the first usable core, everything else on the second."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return Pinning(cores[0], cores[1]) if len(cores) >= 2 else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}


class Server:
    """One child process, its output in a log file."""

    def __init__(self, name: str, args: Sequence[str], log_path: Path, core: int | None,
                 root: Path = ROOT, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=root, env={**child_env(), **(env or {})}, start_new_session=True,
                preexec_fn=_child_setup(core),
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pids(self) -> list[int]:
        """The process and everything below it (nginx's worker, the gateway's redis-servers)."""
        return [self.pid, *(c.pid for c in procs.descendants(self.pid))]

    def stop(self, grace: float = 8.0) -> None:
        """SIGTERM (the gateway drains, then stops its own redis-servers), then SIGKILL."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
                return
            except subprocess.TimeoutExpired:
                pass
        for child in procs.descendants(self.pid):  # the gateway's worker has its own session
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def failed(self, why: str) -> ServerFailed:
        return ServerFailed(f"{self.name} {why}; its last output:\n{self.log_tail()}")


def wait_ready(url: str, *, timeout: float = 30.0, server: Server | None = None,
               in_a_row: int = 1) -> None:
    """Poll `url` until it answers 200 `in_a_row` times (each on a fresh connection, which the
    kernel gives to any of a gateway's workers: several in a row mean each one is ready); fail
    fast when the server has already exited."""
    deadline = time.monotonic() + timeout
    ready = 0
    while True:
        if server is not None and server.popen.poll() is not None:
            raise server.failed(f"exited with code {server.popen.returncode}")
        ok = False
        # URLError (refused, or HTTPError for a 503 while not ready yet) is an OSError.
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            ok = resp.status == 200
        ready = ready + 1 if ok else 0
        if ready >= in_a_row:
            return
        if ok:
            continue
        if time.monotonic() > deadline:
            if server is not None:
                raise server.failed(f"not ready at {url} after {timeout:.0f} s")
            raise ServerFailed(f"not ready at {url} after {timeout:.0f} s")
        time.sleep(0.05)


def nginx_binary() -> str | None:
    """nginx from PATH, or from the sbin folders a non-root PATH often lacks."""
    return shutil.which("nginx") or shutil.which("nginx", path=_SBIN)


def nginx_args(binary: str, conf: Path) -> list[str]:
    # -e: the error log before the config is read (the default, /var/log/nginx, may be
    # unwritable); -p: relative paths in the config are taken from its folder.
    return [binary, "-e", str(conf.parent / "error.log"), "-p", str(conf.parent), "-c", str(conf)]


def simulator_args(
    kind: str, port: int, model: str, *, completion_tokens: int, tokens_per_s: float = 0,
    max_concurrency: int = 128, ttft_ms: float = 0,
) -> list[str]:
    return [
        sys.executable, "-m", "proxy", "simulate", kind, "--host", "127.0.0.1",
        "--port", str(port), "--model", model, "--tokens-per-s", f"{tokens_per_s:g}",
        "--ttft-ms", f"{ttft_ms:g}", "--completion-tokens", str(completion_tokens),
        # The TGI simulator answers 429 above its cap, which would count as gateway errors.
        "--max-concurrency", str(max_concurrency),
    ]


def gateway_args(config_dir: Path, port: int, workers: int = 1) -> list[str]:
    # The benchmark measures one worker (DESIGN §7); the routing benchmark runs two.
    return [sys.executable, "-m", "proxy", "serve", "--config", str(config_dir),
            "--port", str(port), "--workers", str(workers)]


@dataclass(frozen=True)
class Backend:
    name: str
    kind: str
    url: str
    model: str
    weight: int = 1  # backends.toml `weight`: picks favour it in proportion
    max_concurrency: int = 100_000  # its slots (the engine's batch); default: never binds
    kv_events: str | None = None  # where its engine publishes its KV-cache events


def write_gateway_config(folder: Path, *, port: int, backends: Sequence[Backend],
                         ledger_fsync: str = "always", access_log: str = "stderr",
                         routing: Mapping[str, str | float | bool] | None = None,
                         limits: bool = False, traces_to: str | None = None,
                         sample_ratio: float = 1.0, shadow: bool = False) -> Path:
    """A config whose embedded redis-servers live in `folder` (JSON strings are valid TOML basic
    strings, which quotes paths and URLs safely); `routing`: its [routing] section, if any;
    `limits`: the bench tier has token limits too (never binding: their whole path runs);
    `traces_to`: tracing on ([telemetry]), exporting there, keeping `sample_ratio` of them;
    `shadow`: shadow policies (policies/shadow/) judge every request: the tier with token
    limits and other prices, never binding."""
    q = json.dumps
    folder.mkdir(parents=True, exist_ok=True)
    text = ("[gateway]\n"
            f'host = "127.0.0.1"\nport = {port}\ndata_dir = {q(str(folder / "data"))}\n'
            f"drain_timeout_s = 2\nledger_fsync = {q(ledger_fsync)}\n"
            f"access_log = {q(access_log)}\n\n"
            # Probes still run every 5 s, but a mock slowed down by the busy load core must not
            # be ejected mid-run (that would show as 503 "no healthy backend").
            "[health]\ntimeout_s = 10\n")
    if routing:
        text += "\n[routing]\n" + "".join(f"{k} = {q(v)}\n" for k, v in routing.items())
    if traces_to:
        text += f"\n[telemetry]\nendpoint = {q(traces_to)}\nsample_ratio = {sample_ratio}\n"
    for b in backends:
        text += ("\n[[backends]]\n"
                 f"name = {q(b.name)}\nkind = {q(b.kind)}\nurl = {q(b.url)}\n"
                 f"models = [{q(b.model)}]\nmax_concurrency = {b.max_concurrency}\n"
                 + (f"weight = {b.weight}\n" if b.weight != 1 else "")
                 + (f"kv_events = {q(b.kv_events)}\n" if b.kv_events else ""))
    (folder / "backends.toml").write_text(text)
    policies = folder / "policies"
    policies.mkdir(exist_ok=True)
    # One tier whose limit never binds (per account: 200 accounts share at most a few thousand
    # requests/s, the limit is 1,000,000 a minute each), so the full policy path runs on every
    # request (key lookup, the sliding-window hit, the credit hold) without refusing any.
    (policies / "tiers.toml").write_text(
        '[tiers.guest]\nrequests_per_minute = 3\nfamilies = ["chat"]\n'
        'models = { "*" = ["direct"] }\n\n'
        f'[tiers.{BENCH_TIER}]\nrequests_per_minute = 1000000\nfamilies = ["chat", "embed"]\n'
        'models = { "*" = ["direct", "network"] }\n'
        + ("tokens_per_minute = 10000000000\ntokens_per_day = 1000000000000\n" if limits
           else "")
    )
    # Real prices, so every request holds credits and settles a charge.
    (policies / "prices.toml").write_text(
        'version = "bench"\n\n[default]\nprompt_per_1k_tokens = 100\n'
        "completion_per_1k_tokens = 300\n"
    )
    if shadow:
        (policies / "shadow").mkdir(exist_ok=True)
        (policies / "shadow" / "tiers.toml").write_text(
            (policies / "tiers.toml").read_text().replace(
                "requests_per_minute = 1000000", "requests_per_minute = 900000")
            + ("" if limits else "tokens_per_minute = 10000000000\ntokens_per_day = "
               "1000000000000\n"))
        (policies / "shadow" / "prices.toml").write_text(
            (policies / "prices.toml").read_text().replace("= 300", "= 250"))
    return folder


def create_keys(config_dir: Path, count: int, *, credits_each: int, budgets: bool = False
                ) -> list[str]:
    """`count` keys of the bench tier, one account each, every account topped up with
    `credits_each` credits (`budgets`: and given a monthly budget of as much, never binding).
    The same library calls as `proxy keys create` and `proxy credits add`, in one process:
    200 CLI runs would take a minute."""
    accounts = [(f"bench-{i:04d}", BENCH_TIER) for i in range(count)]
    return asyncio.run(_create_keys(config_dir, accounts, credits_each, budgets))


def account_keys(config_dir: Path, tiers: Mapping[str, str], *, credits_each: int
                 ) -> dict[str, str]:
    """A key for each account of `tiers` (account -> tier), topped up alike: account -> key."""
    keys = asyncio.run(_create_keys(config_dir, list(tiers.items()), credits_each))
    return dict(zip(tiers, keys, strict=True))


async def _create_keys(config_dir: Path, accounts: Sequence[tuple[str, str]],
                       credits_each: int, budgets: bool = False) -> list[str]:
    from proxy.config import load_config
    from proxy.credits.ledger import Ledger
    from proxy.identity.keystore import KeyStore
    from proxy.store.client import connect_redis
    from proxy.store.redis_process import RedisProcess

    config = load_config(config_dir)
    redis = connect_redis(RedisProcess(config.data_dir / "redis").url, timeout_s=10.0)
    try:
        store = KeyStore(redis, config.policies.auth.keys)
        ledger = Ledger(redis)

        async def one(account: str, tier: str) -> str:
            raw, _ = await store.create(account, tier, "loadtests")
            await ledger.credit(account, credits_each * 1_000_000,
                                {"reason": "benchmark", "actor": "loadtests",
                                 "ts": int(time.time())})
            if budgets:
                await ledger.set_budget(account, "month", credits_each * 1_000_000)
            return raw

        keys: list[str] = []
        for start in range(0, len(accounts), 50):  # a few at a time: the ledger fsyncs each
            keys += await asyncio.gather(*(one(*a) for a in accounts[start:start + 50]))
        return keys
    finally:
        await redis.aclose()


def gateway_worker_pid(master_pid: int, *, timeout: float = 10.0) -> int:
    """The `python -m proxy.runtime.worker` child of a gateway master started with one worker."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [c.pid for c in procs.descendants(master_pid) if WORKER_MODULE in c.cmdline]
        if len(workers) == 1:
            return workers[0]
        if time.monotonic() > deadline:
            raise ServerFailed(f"expected one gateway worker process, found {len(workers)}")
        time.sleep(0.05)


def gateway_worker_pids(master_pid: int, count: int, *, timeout: float = 10.0) -> list[int]:
    """The `count` worker processes of a gateway master started with `--workers count`."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [c.pid for c in procs.descendants(master_pid) if WORKER_MODULE in c.cmdline]
        if len(workers) == count:
            return workers
        if time.monotonic() > deadline:
            raise ServerFailed(f"expected {count} gateway worker processes, found {len(workers)}")
        time.sleep(0.05)


def redis_pids(master_pid: int) -> list[int]:
    # redis-server rewrites its title ("/path/redis-server unixsocket:/..."), so match loosely.
    return [c.pid for c in procs.descendants(master_pid) if "redis-server" in " ".join(c.cmdline)]


def _child_setup(core: int | None) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        if core is not None:
            os.sched_setaffinity(0, {core})  # inherited by the gateway's redis-servers too
        if sys.platform == "linux":
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup

