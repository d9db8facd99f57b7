"""Race benchmark (issue 32): one key's token limit and monthly budget under a concurrent burst.

    python -m loadtests.race [--requests 200] [--gateways 3] [--workers 2] [--rounds 1]
                             [--ttft-ms 200] [--json PATH] [--logs DIR] [--strict]

A real Redis Cluster (three primaries with a replica each), one vLLM simulator, `--gateways`
`serve` gateways of `--workers` workers sharing it. Each round makes a fresh account and key
(admin API) on a tier whose `tokens_per_minute` is worth ~20 requests' reservations, with a
monthly budget worth ~20 requests' holds, and sends `--requests` chat requests at once, round
robin over the gateways, half streamed: a long prompt with one completion token (reserves ~4,000
tokens, holds little) and a short prompt with a long answer (~140 tokens, most of the money)
alternate, so both limits bind. The simulator waits `--ttft-ms` before answering, so the
burst's admissions meet the holds of those before them (0: settlements race the admissions).

Checked per round, once settled: only 200, 429 (the token limit's `rate_limited`) and 402 (the
budget's `budget_exceeded`), both limits refusing some; tokens charged and spend within the
limit and the cap, and so the window and the budget while the burst ran (sampled every 5 ms);
every hold and reservation ended; one charge per answer; the window's total (`t`) equals the
journal's tokens and the engine's counters, nothing left reserved (`r`); the ledger reconciles
(and `credits reconcile` on the CLI after the last round).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.checks import StreamCheck, completion_problem
from loadtests.servers import ROOT, Server, free_port, gateway_args, simulator_args, wait_ready
from proxy.config import Rates
from proxy.credits.budgets import cap_name, period_index
from proxy.credits.ledger import AccountKeys, Ledger
from proxy.credits.pricing import chat_hold, chat_tokens, format_credits
from proxy.store.client import Store, connect_redis
from tests.support.redis_topologies import ClusterProcesses

MODEL = "acme/race"
TIER = "race"
CHAT = "/v2/compat/v1/chat/completions"
ADMIN_TOKEN = secrets.token_hex(16)
WORTH = 20  # the limit and the cap are each worth this many requests' worst cases
RATES = Rates(prompt_per_1k_tokens=10, completion_per_1k_tokens=10_000)
ANSWER_TOKENS = 64  # the simulator's natural completion: the long answer uses half its cap
# By default every admitted request keeps its reservation and hold at least this long, so the
# burst's later admissions meet them (and the sampler sees them); 0: settlements race them.
TTFT_MS = 200
# Token-heavy and cheap: a 4,000-byte prompt reserves ~4,000 tokens (uses ~900), holds ~50 micro.
WORDY: dict[str, Any] = {
    "model": MODEL, "max_tokens": 1,
    "messages": [{"role": "user", "content": ("tell me about the race " * 174)[:4000]}]}
# Dear and light on tokens: reserves ~140 tokens, holds ~1,300 micro (the completion cap).
COSTLY: dict[str, Any] = {
    "model": MODEL, "max_tokens": 128, "messages": [{"role": "user", "content": "hi"}]}
SHAPES = {"wordy": WORDY, "costly": COSTLY}
# WORTH of each shape, half and half, fill both; the limit has room for two short requests
# more (less than a long one), so whatever the order of arrival the long prompts stop at the
# token limit (429) while the short ones still fit in it and stop at the budget (402).
TPM = round(WORTH * statistics.mean(chat_tokens(b, b["max_tokens"]) for b in SHAPES.values())
            + 2 * chat_tokens(COSTLY, COSTLY["max_tokens"]))
CAP = round(WORTH * statistics.mean(chat_hold(RATES, b, b["max_tokens"])
                                    for b in SHAPES.values()))
WINDOW_S = 60  # the minute: a round longer than this may rightly admit more than TPM


@dataclass
class Answer:
    shape: str
    stream: bool
    status: int  # 0: no HTTP answer
    seconds: float
    error_type: str = ""
    problem: str = ""  # why a 200 did not check out, or a refusal is not the right one


@dataclass
class Round:
    account: str
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0  # the first request sent to the last answer
    charges: int = 0
    estimated: int = 0  # charges the gateway counted itself (no usage from the engine)
    tokens: int = 0  # prompt + completion, over the journal's charges
    spend: int = 0  # micro-credits, over the journal's charges
    window_total: int = -1  # the minute window's 't' once settled
    window_reserved: int = -1  # its 'r'
    engine_tokens: int = -1  # the simulator's prompt + generation counters, this round
    budget_spent: int = -1  # the monthly budget's own spent and held, once settled
    budget_held: int = -1
    peak_window: int = 0  # the most the minute window held while the burst ran (sampled)
    peak_budget: int = 0  # the most the budget's spent + held was (sampled)
    reconcile: list[str] = field(default_factory=list)
    unsettled: str = ""  # holds or reservations still there 30 s after the burst

    def count(self, status: int) -> int:
        return sum(1 for a in self.answers if a.status == status)


def write_config(folder: Path, port: int, sim_url: str, redis_url: str) -> None:
    q = json.dumps
    (folder / "backends.toml").write_text(
        f'[gateway]\nhost = "127.0.0.1"\nport = {port}\ndata_dir = {q(str(folder / "data"))}\n'
        f"redis_url = {q(redis_url)}\nledger_ack_replicas = 1\ndrain_timeout_s = 2\n"
        # A probe slowed by the busy machine must not eject the one backend mid-burst.
        'access_log = "off"\n\n[health]\ntimeout_s = 10\n\n'
        f'[[backends]]\nname = "engine"\nkind = "vllm"\nurl = {q(sim_url)}\n'
        f"models = [{q(MODEL)}]\nmax_concurrency = 1000\n")  # the race is admission's
    policies = folder / "policies"
    policies.mkdir(exist_ok=True)
    (policies / "tiers.toml").write_text(
        '[tiers.guest]\nrequests_per_minute = 3\nfamilies = ["chat"]\n'
        'models = { "*" = ["direct"] }\n\n'
        f'[tiers.{TIER}]\nrequests_per_minute = 100000\nfamilies = ["chat"]\n'
        f'models = {{ "*" = ["direct"] }}\ntokens_per_minute = {TPM}\n')
    (policies / "prices.toml").write_text(
        f'version = "race"\n\n[default]\nprompt_per_1k_tokens = {RATES.prompt_per_1k_tokens}\n'
        f"completion_per_1k_tokens = {RATES.completion_per_1k_tokens}\n")


async def admin(session: aiohttp.ClientSession, url: str, path: str, body: Any) -> Any:
    async with session.post(url + path, json=body,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
        if r.status not in (200, 201):
            raise RuntimeError(f"POST {path}: {r.status} {await r.text()}")
        return await r.json()


def refusal_problem(status: int, headers: Any, payload: bytes) -> tuple[str, str]:
    """(error type, why this refusal is not the limit's own: "" when it is)."""
    try:
        error = orjson.loads(payload)["error"]
        kind, message = str(error["type"]), str(error["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "", "body without an error"
    if status == 429:
        if kind != "rate_limited" or "tokens a minute" not in message:
            return kind, f"not the token limit's: {message[:120]}"
        if "ask for fewer" in message or "Retry-After" not in headers:
            return kind, "a token refusal without a wait"
    elif status == 402 and (kind != "budget_exceeded" or "X-Budget-Reset" not in headers):
        return kind, f"not the budget's: {kind} {message[:120]}"
    return kind, ""


async def ask(session: aiohttp.ClientSession, url: str, key: str, shape: str, stream: bool,
              go: asyncio.Event) -> Answer:
    await go.wait()
    started = time.perf_counter()
    try:
        async with session.post(url + CHAT, json={**SHAPES[shape], "stream": stream},
                                headers={"X-API-Key": key}) as r:
            payload = await r.read()
            status, headers = r.status, r.headers
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer(shape, stream, 0, time.perf_counter() - started, problem=repr(exc))
    answer = Answer(shape, stream, status, time.perf_counter() - started)
    if status == 200 and stream:
        check = StreamCheck()
        check.feed(payload)
        answer.problem = check.finish() or ""
    elif status == 200:
        answer.problem = completion_problem(status, payload) or ""
    elif status in (402, 429):
        answer.error_type, answer.problem = refusal_problem(status, headers, payload)
    else:
        answer.problem = f"HTTP {status}: {payload[:200].decode(errors='replace')}"
    return answer


async def engine_tokens(session: aiohttp.ClientSession, sim: str) -> int:
    """What the engine counted: its prompt and generation token counters."""
    async with session.get(f"{sim}/metrics") as r:
        text = await r.text()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(("vllm:prompt_tokens_total", "vllm:generation_tokens_total")))


async def budget_now(redis: Store, account: str) -> tuple[int, int]:
    """The monthly budget's spent and held now."""
    _, spent, held = AccountKeys.of(account).budgets
    month = f"{cap_name('month')}:{period_index('m', time.time())}"
    charged, holding = await asyncio.gather(redis.hget(spent, month), redis.hget(held, month))
    return int(charged or 0), int(holding or 0)


def minute_window(account: str) -> str:
    """The tier's tokens-a-minute window (its buckets hash: 't' total, 'r' reserved)."""
    return AccountKeys.of(account).token_window(TIER, "*:tm")


async def peek(redis: Store, account: str, rnd: Round) -> None:
    """One look at the minute window's total and the budget's spent + held: keeps the most."""
    total, (spent, held) = await asyncio.gather(
        redis.hget(minute_window(account), "t"), budget_now(redis, account))
    rnd.peak_window = max(rnd.peak_window, int(total or 0))
    rnd.peak_budget = max(rnd.peak_budget, spent + held)


async def sample(redis: Store, account: str, rnd: Round, stop: asyncio.Event) -> None:
    while not stop.is_set():  # a look every 5 ms, while the burst runs
        await peek(redis, account, rnd)
        await asyncio.sleep(0.005)


async def settle(ledger: Ledger, account: str, timeout_s: float = 30.0) -> str:
    """Waits until every hold of the account ended and the window's reservations are gone;
    what is left after `timeout_s` ("" when nothing)."""
    window = minute_window(account)
    deadline = time.monotonic() + timeout_s
    while True:
        left = ((await ledger.balance(account)).held, len(await ledger.open_holds(account)),
                int(await ledger.redis.hget(window, "r") or 0))
        if not any(left):
            return ""
        if time.monotonic() > deadline:
            return "{} micro held by {} holds, {} tokens reserved".format(*left)
        await asyncio.sleep(0.1)


async def race(n: int, urls: list[str], sim: str, ledger: Ledger, requests: int) -> Round:
    rnd = Round(f"race-{n}-{secrets.token_hex(3)}")
    # force_close: every request on its own connection, so the kernel spreads them over each
    # gateway's workers; limit=0: all of them at once.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        key = str((await admin(session, urls[0], "/admin/keys",
                               {"account": rnd.account, "tier": TIER}))["key"])
        await admin(session, urls[1 % len(urls)], f"/admin/accounts/{rnd.account}/credits",
                    {"amount": "1000"})  # plenty: the budget, not the balance, is the cap
        await admin(session, urls[2 % len(urls)], f"/admin/accounts/{rnd.account}/budgets",
                    {"period": "month", "amount": format_credits(CAP)})
        engine_before = await engine_tokens(session, sim)
        go, stop = asyncio.Event(), asyncio.Event()
        # A first look before the burst: the Cluster client reads the slot map and connects
        # now, not while 200 requests crowd the event loop (the sampler would start late).
        await peek(ledger.redis, rnd.account, rnd)
        sampler = asyncio.create_task(sample(ledger.redis, rnd.account, rnd, stop))
        # Shapes alternate; within each shape, streamed and whole answers alternate.
        jobs = [ask(session, urls[i % len(urls)], key, ("wordy", "costly")[i % 2],
                    (i // 2) % 2 == 1, go) for i in range(requests)]
        started = time.perf_counter()
        go.set()
        rnd.answers = list(await asyncio.gather(*jobs))
        rnd.seconds = time.perf_counter() - started
        rnd.unsettled = await settle(ledger, rnd.account)
        stop.set()
        await sampler
        rnd.engine_tokens = await engine_tokens(session, sim) - engine_before
    charges = [e for e in await ledger.all_entries(rnd.account) if e.get("type") == "charge"]
    rnd.charges = len(charges)
    rnd.estimated = sum(1 for e in charges if e.get("estimated"))
    rnd.tokens = sum(int(e["prompt_tokens"]) + int(e["completion_tokens"]) for e in charges)
    rnd.spend = sum(int(e["cost"]) for e in charges)
    total, reserved = await ledger.redis.hmget(minute_window(rnd.account),
                                               ["t", "r"])
    rnd.window_total, rnd.window_reserved = int(total or 0), int(reserved or 0)
    rnd.budget_spent, rnd.budget_held = await budget_now(ledger.redis, rnd.account)
    rnd.reconcile = await ledger.reconcile([rnd.account])
    return rnd


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def checks(rounds: list[Round], cli_problem: str) -> list[dict[str, Any]]:
    """One verdict per property: passed only when it held in every round."""
    found: list[dict[str, Any]] = []

    def check(name: str, target: str, values: list[str], passed: bool) -> None:
        found.append({"name": name, "target": target, "values": values, "passed": passed})

    def answers(name: str, status: int | None) -> None:
        """No answer of `status` with a problem; None: no answer of another status at all."""
        bad = [[f"{a.status} {a.problem}"[:160] for a in r.answers
                if (a.problem if a.status == status else status is None
                    and a.status not in (200, 402, 429))] for r in rounds]
        check(name, "0", [f"{len(b)}" + (f" (first: {b[0]})" if b else "") for b in bad],
              not any(bad))

    answers("answers other than 200, 429 and 402", None)
    answers("200s that are not a whole answer", 200)
    answers("429s not the token limit's (rate_limited)", 429)
    answers("402s not the budget's (budget_exceeded)", 402)
    check("both limits refused some", "429 > 0 and 402 > 0",
          [f"{r.count(429)} / {r.count(402)}" for r in rounds],
          all(r.count(429) and r.count(402) for r in rounds))
    check("tokens charged within the minute's limit", f"<= {TPM:,}, round < {WINDOW_S} s",
          [f"{r.tokens:,} in {r.seconds:.1f} s" for r in rounds],
          all(r.tokens <= TPM and r.seconds < WINDOW_S for r in rounds))
    check("the window never held more than the limit (sampled)", f"<= {TPM:,}",
          [f"{r.peak_window:,}" for r in rounds], all(r.peak_window <= TPM for r in rounds))
    check("spend within the monthly cap", f"<= {CAP:,} micro",
          [f"{r.spend:,}" for r in rounds], all(0 < r.spend <= CAP for r in rounds))
    check("the budget never held more than the cap (sampled)", f"<= {CAP:,} micro",
          [f"{r.peak_budget:,}" for r in rounds], all(r.peak_budget <= CAP for r in rounds))
    check("the budget's spent is the journal's, nothing held", "spent = spend, held 0",
          [f"{r.budget_spent:,} / {r.budget_held}" for r in rounds],
          all(r.budget_spent == r.spend and r.budget_held == 0 for r in rounds))
    check("every hold and reservation ended", "within 30 s",
          [r.unsettled or "yes" for r in rounds], not any(r.unsettled for r in rounds))
    check("one charge per answer", "charges = 200s",
          [f"{r.charges} / {r.count(200)}" for r in rounds],
          all(r.charges == r.count(200) for r in rounds))
    check("window total = journal = engine, nothing reserved", "t = tokens = engine, r = 0",
          [f"{r.window_total:,} / {r.tokens:,} / {r.engine_tokens:,}, r {r.window_reserved}"
           for r in rounds],
          all(r.window_total == r.tokens == r.engine_tokens and r.window_reserved == 0
              for r in rounds))
    check("ledger reconcile", "0 problems", [str(len(r.reconcile)) for r in rounds],
          not any(r.reconcile for r in rounds))
    check("credits reconcile (the CLI, every account)", "exit 0, 0 problem(s)",
          [cli_problem or "clean"], not cli_problem)
    return found


def report(rounds: list[Round], found: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Race: {meta['gateways']} gateways x {meta['workers']} worker(s) on a Redis Cluster "
             f"(3 primaries + replicas), {meta['requests']} requests at once a round, engine "
             f"TTFT {meta['ttft_ms']:g} ms; tokens_per_minute {TPM:,}, monthly cap "
             f"{format_credits(CAP)} credits ({CAP:,} micro), each worth ~{WORTH} requests", "",
             "| round | 200 (streamed) | 429 | 402 | other | tokens charged, peak / limit | "
             "spend, peak / cap (micro) | window t / r | charges (estimated) | answered p50 / "
             "p99 | refused p50 / p99 | seconds |", "|---" * 12 + "|"]
    for i, r in enumerate(rounds, 1):
        ok = [a.seconds * 1000 for a in r.answers if a.status == 200]
        no = [a.seconds * 1000 for a in r.answers if a.status in (402, 429)]
        other = len(r.answers) - r.count(200) - r.count(402) - r.count(429)
        streamed = sum(1 for a in r.answers if a.status == 200 and a.stream)
        lines.append(
            f"| {i} | {r.count(200)} ({streamed}) | {r.count(429)} | {r.count(402)} | {other} "
            f"| {r.tokens:,}, {r.peak_window:,} / {TPM:,} | {r.spend:,}, {r.peak_budget:,} / "
            f"{CAP:,} | {r.window_total:,} / {r.window_reserved} | {r.charges} ({r.estimated}) "
            f"| {percentile(ok, 0.5):.0f} / {percentile(ok, 0.99):.0f} ms | "
            f"{percentile(no, 0.5):.0f} / {percentile(no, 0.99):.0f} ms | {r.seconds:.1f} |")
    for i, r in enumerate(rounds, 1):  # each shape's answers by status and error type
        by = Counter(f"{a.shape} {a.status} {a.error_type}".strip() for a in r.answers)
        lines.append(f"round {i} ({r.account}): " + ", ".join(
            f"{k} x{n}" for k, n in sorted(by.items())))
    lines.append("")
    for c in found:
        lines.append(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']}: "
                     f"{'; '.join(c['values'])} (target {c['target']})")
    met = sum(1 for c in found if c["passed"])
    verdict = "PASS" if met == len(found) else "FAIL"
    lines.append(f"verdict: {met}/{len(found)} checks met -> {verdict} (exit status is non-zero "
                 "on FAIL only with --strict)")
    return "\n".join(lines)


def cli_reconcile(folder: Path, redis_url: str) -> str:
    """'' when `python -m proxy credits reconcile` finds the whole ledger clean."""
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "credits", "reconcile", "--config", str(folder)],
        env={**os.environ, "GATEWAY_REDIS_URL": redis_url}, cwd=ROOT, capture_output=True,
        text=True, timeout=120, check=False)
    if done.returncode == 0 and "0 problem(s)" in done.stdout:
        return ""
    return f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-300:]}"


async def run_rounds(urls: list[str], sim: str, redis_url: str, requests: int, count: int
                     ) -> list[Round]:
    redis = connect_redis(redis_url, timeout_s=10.0)
    ledger = Ledger(redis)
    try:
        return [await race(n, urls, sim, ledger, requests) for n in range(1, count + 1)]
    finally:
        await ledger.close()
        await redis.aclose()


def start(root: Path, cluster_url: str, args: argparse.Namespace, servers: list[Server]
          ) -> tuple[str, list[str]]:
    """The simulator and the gateways (added to `servers`, which the caller stops): their URLs
    once every worker of every gateway is ready."""
    port = free_port()
    sim = f"http://127.0.0.1:{port}"
    servers.append(Server("simulator", simulator_args(
        "vllm", port, MODEL, completion_tokens=ANSWER_TOKENS, tokens_per_s=400,
        ttft_ms=args.ttft_ms, max_concurrency=1000), root / "sim.log", None))
    wait_ready(f"{sim}/health", server=servers[-1])
    urls = []
    for g in range(args.gateways):
        folder, port = root / f"gateway-{g}", free_port()
        folder.mkdir()
        write_config(folder, port, sim, cluster_url)
        servers.append(Server(f"gateway-{g}", gateway_args(folder, port, args.workers),
                              folder / "gateway.log", None,
                              env={"GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}))
        urls.append(f"http://127.0.0.1:{port}")
    for url, server in zip(urls, servers[1:], strict=True):
        wait_ready(f"{url}/readyz", server=server, timeout=60, in_a_row=4 * args.workers)
    return sim, urls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="each with a fresh account")
    parser.add_argument("--ttft-ms", type=float, default=TTFT_MS,
                        help="the simulator's time to first token (0: answers race admissions)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="a new folder to keep the servers' logs in")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a check fails")
    args = parser.parse_args(argv)
    meta = {k: getattr(args, k) for k in ("requests", "gateways", "workers", "rounds", "ttft_ms")}
    folder: contextlib.AbstractContextManager[str] = tempfile.TemporaryDirectory(
        prefix="igw-race-")
    if args.logs:  # a new folder: a Cluster node would take an old one's nodes.conf
        args.logs.mkdir(parents=True)
        folder = contextlib.nullcontext(str(args.logs))
    servers: list[Server] = []
    with folder as tmp, ClusterProcesses(Path(tmp) / "cluster") as cluster:
        try:
            sim, urls = start(Path(tmp), cluster.url, args, servers)
            rounds = asyncio.run(run_rounds(urls, sim, cluster.url, args.requests,
                                            args.rounds))
            found = checks(rounds, cli_reconcile(Path(tmp) / "gateway-0", cluster.url))
        finally:
            for server in reversed(servers):
                server.stop()
    print(report(rounds, found, meta))
    passed = all(c["passed"] for c in found)
    if args.json:
        args.json.write_text(json.dumps({
            "meta": {**meta, "tokens_per_minute": TPM, "monthly_cap_micro": CAP,
                     "prices": {"prompt_per_1k_tokens": RATES.prompt_per_1k_tokens,
                                "completion_per_1k_tokens": RATES.completion_per_1k_tokens}},
            "rounds": [asdict(r) for r in rounds], "checks": found, "passed": passed},
            indent=2))
    return 1 if args.strict and not passed else 0


if __name__ == "__main__":
    raise SystemExit(main())
