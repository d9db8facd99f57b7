"""`inference-gateway policy replay` on a real gateway's access log: the live policies replayed
reprice every request to the micro-credit the meter charged; a stricter candidate refuses
what its tiers would have, and says why and whom it hits."""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import orjson
from redis.asyncio import Redis

from proxy.cli import main
from proxy.credits.ledger import Ledger
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

TIERS = """
[tiers.guest]
requests_per_minute = 100
families = ["chat"]
models = { "*" = ["direct"] }
[tiers.basic]
requests_per_minute = 100
families = ["chat", "embed"]
models = { "*" = ["direct"] }
[tiers.max]
requests_per_minute = 100
families = ["chat", "embed"]
models = { "*" = ["direct"] }
"""
PRICES = """
version = "live"
[default]
prompt_per_1k_tokens = 700
completion_per_1k_tokens = 2100
cached_prompt_per_1k_tokens = 100
"""


def cli(log: Path, policies: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The command as an operator runs it (a process of its own)."""
    return subprocess.run([sys.executable, "-m", "proxy", "policy", "replay", "--log", str(log),
                           "--policies", str(policies), *extra],
                          capture_output=True, text=True, timeout=60)


def replay(log: Path, policies: Path, *extra: str) -> dict[str, Any]:
    """The same command's entry point in this process (`--json`): no interpreter start."""
    out = io.BytesIO()
    text = io.TextIOWrapper(out, write_through=True)  # `--json` writes to its buffer
    with contextlib.redirect_stdout(text):
        assert main(["policy", "replay", "--log", str(log), "--policies", str(policies),
                     "--json", *extra]) == 0
    text.flush()
    report: dict[str, Any] = orjson.loads(out.getvalue())
    text.detach()
    return report


async def test_replaying_the_live_policies_and_a_stricter_one(
        gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
        tmp_path: Path) -> None:
    chat = await simulator("vllm", ("acme/chat",), prompt_tokens_details=True)
    tei = await simulator("tei", ("acme/embed",))
    log = tmp_path / "access.log"
    gw = await gateway(
        {"name": "c", "kind": "vllm", "url": str(chat.make_url("/")).rstrip("/"),
         "models": ["acme/chat"]},
        {"name": "e", "kind": "tei", "url": str(tei.make_url("/")).rstrip("/"),
         "models": ["acme/embed"]},
        settings={"access_log": str(log)}, policies={"tiers.toml": TIERS, "prices.toml": PRICES})
    redis = Redis.from_url(clean_redis.url)
    keys = {}
    for account, tier in (("heavy", "basic"), ("light", "basic"), ("big", "max")):
        keys[account] = await new_key(clean_redis.url, tier, account=account)
        await Ledger(redis).credit(account, 10**9, {"reason": "test"})
    await redis.aclose()
    system = {"role": "system", "content": "You answer briefly. " * 20}  # cached after once
    for account, count in (("heavy", 6), ("light", 2), ("big", 3)):
        async with openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")),
                                      api_key=keys[account], max_retries=0) as client:
            for i in range(count):
                await client.chat.completions.create(
                    model="acme/chat", max_tokens=8,
                    messages=[system, {"role": "user", "content": f"question {i}"}])
            await client.embeddings.create(model="acme/embed", input=["one", "two"])
    await settled(gw)
    for _ in range(100):  # the access log's writer thread: lines land within ~50 ms
        if log.exists() and len(log.read_bytes().splitlines()) >= 14:
            break
        await asyncio.sleep(0.05)
    lines = [orjson.loads(raw) for raw in log.read_bytes().splitlines()]
    assert {(x["family"], x["mode"]) for x in lines} == {("chat", "direct"), ("embed", "direct")}
    assert any(x["units"].get("cached_tokens") for x in lines)
    assert {x.get("max_tokens") for x in lines if x["family"] == "chat"} == {8}
    assert not any("max_tokens" in x for x in lines if x["family"] == "embed")

    live = tmp_path / "config" / "policies"
    same = replay(log, live)
    assert same["total"]["requests"] == 14
    assert same["total"]["decisions"] == {"admitted": 14}
    assert same["total"]["live_micro_credits"] == same["total"]["candidate_micro_credits"] > 0

    candidate = tmp_path / "candidate"
    shutil.copytree(live, candidate)
    (candidate / "tiers.toml").write_text(TIERS.replace(
        '[tiers.basic]\nrequests_per_minute = 100\nfamilies = ["chat", "embed"]',
        '[tiers.basic]\nrequests_per_minute = 4\nfamilies = ["chat"]'))
    (candidate / "prices.toml").write_text(PRICES.replace("= 2100", "= 4200"))
    strict = replay(log, candidate)
    rows = {(r["tier"], r["model"]): r for r in strict["by_tier_model"]}
    assert rows["basic", "acme/chat"]["decisions"] == {"admitted": 6, "rate_limited": 2}
    # heavy's embeddings come after its four: over the rate first (a 429 beats a 403, as live)
    assert rows["basic", "acme/embed"]["decisions"] == {"forbidden": 1, "rate_limited": 1}
    assert rows["max", "acme/chat"]["decisions"] == {"admitted": 3}
    assert rows["max", "acme/chat"]["difference_micro_credits"] > 0  # dearer completions
    assert strict["accounts_by_new_refusals"][0]["account"] == "heavy"
    assert strict["refusal_reasons"] == {"basic: more than 4 requests a minute": 3,
                                         "the basic tier does not include embeddings": 1}
    # A folder with only the file that changes (a shadow set): the rest is the live folder's,
    # from --config, so the prices are the live ones and only the limits differ.
    shadow = tmp_path / "config" / "policies" / "shadow"
    shadow.mkdir()
    (shadow / "tiers.toml").write_text((candidate / "tiers.toml").read_text())
    partial = replay(log, shadow, "--config", str(tmp_path / "config"))
    rows = {(r["tier"], r["model"]): r for r in partial["by_tier_model"]}
    assert rows["basic", "acme/chat"]["decisions"] == {"admitted": 6, "rate_limited": 2}
    assert rows["max", "acme/chat"]["difference_micro_credits"] == 0
    # The completion cap, against the max_tokens each line recorded (8 asked).
    capped = tmp_path / "capped"
    shutil.copytree(live, capped)
    (capped / "tiers.toml").write_text(TIERS.replace(
        "[tiers.max]\n", "[tiers.max]\nmax_tokens_per_request = 7\n"))
    rows = {(r["tier"], r["model"]): r for r in replay(log, capped)["by_tier_model"]}
    assert rows["max", "acme/chat"]["decisions"] == {"forbidden": 3}
    assert rows["max", "acme/embed"]["decisions"] == {"admitted": 1}
    table = cli(log, candidate).stdout
    assert "basic / acme/chat" in table and "heavy" in table
    later = replay(log, candidate, "--since", str(lines[-1]["ts"] + 1))
    assert later["total"]["requests"] == 0
    typo = cli(log, tmp_path / "nowhere")
    assert typo.returncode == 2 and "not a folder" in typo.stderr
    (candidate / "tiers.toml").write_text("[tiers.basic]\nrequests_per_minute = -1\n")
    broken = cli(log, candidate)
    assert broken.returncode == 2 and "tiers.toml" in broken.stderr
