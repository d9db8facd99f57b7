"""A policy replay (proxy.policy.replay, pure): access-log lines through a candidate policy set,
decided in arrival order as the gateway decides, repriced as the meter prices."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import orjson

from proxy.config import Policies, PricesPolicy, TiersPolicy
from proxy.policy.replay import Replay, read_line, text

TIERS = """
[tiers.guest]
requests_per_minute = 3
families = ["chat"]
models = { "*" = ["direct"] }
[tiers.basic]
requests_per_minute = 100
families = ["chat", "embed"]
models = { standard = ["direct"] }
[tiers.max]
requests_per_minute = 100
families = ["chat", "embed", "tts"]
models = { "*" = ["direct", "network"] }
"""
PRICES = """
version = "p1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 2000
cached_prompt_per_1k_tokens = 500
[models."acme/tts"]
per_1k_characters = 10000
"""


def policies(tiers: str = TIERS, prices: str = PRICES) -> Policies:
    return Policies(tiers=msgspec.toml.decode(tiers, type=TiersPolicy),
                    prices=msgspec.toml.decode(prices, type=PricesPolicy))


def line(ts: float, account: str | None = "a1", tier: str = "basic", model: str = "acme/chat",
         family: str = "chat", units: dict[str, int] | None = None, credits: str | None = None,
         **extra: Any) -> bytes:
    out: dict[str, Any] = {"ts": ts, "request_id": "r", "method": "POST",
                           "route": "/v2/compat/v1/chat/completions", "status": 200,
                           "latency_ms": 100.0, "model": model, "family": family,
                           "mode": "direct", "tier": tier, **extra}
    if account is not None:
        out["account"] = account
    if units is not None:
        out["units"] = units
    if credits is not None:
        out["credits"] = credits
    return orjson.dumps(out)


CHAT = {"prompt_tokens": 100, "completion_tokens": 50}  # 0.1 + 0.1 credits at PRICES


def test_the_same_policies_change_nothing_and_reprice_exactly() -> None:
    lines = [line(1000 + i, units=CHAT, credits="0.000200") for i in range(5)]
    lines.append(line(1006, units={"prompt_tokens": 1000, "completion_tokens": 0,
                                   "cached_tokens": 600}, credits="0.000700"))
    lines.append(line(1007, tier="max", model="acme/tts", family="tts",
                      units={"characters": 150}, credits="0.001500"))
    report = Replay(policies()).run(lines).report()
    total = report["total"]
    assert total["requests"] == 7 and total["decisions"] == {"admitted": 7}
    assert total["newly_refused"] == total["newly_admitted"] == 0
    assert total["live_micro_credits"] == total["candidate_micro_credits"] == 5 * 200 + 700 + 1500


def test_a_stricter_tier_refuses_in_the_gateways_order() -> None:
    strict = TIERS.replace('families = ["chat", "embed"]\nmodels = { standard = ["direct"] }',
                           'families = ["chat"]\nmodels = { standard = ["direct"] }\n'
                           "requests_per_minute = 2\ntokens_per_minute = 400", 1)
    strict = strict.replace("[tiers.basic]\nrequests_per_minute = 100\n", "[tiers.basic]\n", 1)
    lines = [line(1000, units=CHAT, credits="0.000200"),
             line(1010, units=CHAT, credits="0.000200"),
             line(1020, units=CHAT, credits="0.000200"),  # the third in a minute
             line(1070, family="embed", model="acme/embed", units={"prompt_tokens": 10},
                  credits="0.000010"),  # no embeddings for basic now
             line(1090, units={"prompt_tokens": 300, "completion_tokens": 200},
                  credits="0.000700"),  # 150 + 500 > 400 tokens a minute
             line(1200, account="a2", units=CHAT, credits="0.000200")]
    replay = Replay(policies(strict))
    decisions = [replay.replay(r) for r in sorted(
        (read_line(raw) for raw in lines), key=lambda r: r.start)]  # type: ignore[union-attr]
    assert decisions == ["admitted", "admitted", "rate_limited", "forbidden", "token_limited",
                         "admitted"]
    report = replay.report()
    assert report["total"]["newly_refused"] == 3
    assert report["total"]["live_micro_credits"] == 200 * 4 + 10 + 700
    assert report["total"]["candidate_micro_credits"] == 200 * 3
    assert report["refusal_reasons"] == {
        "basic: more than 2 requests a minute": 1,
        "the basic tier does not include embeddings": 1,
        "basic: 400 tokens a minute": 1}
    top = report["accounts_by_new_refusals"][0]
    assert top["account"] == "a1" and top["newly_refused"] == 3


def test_the_completion_cap_and_the_queue_budget_from_what_the_line_recorded() -> None:
    capped = TIERS.replace("[tiers.basic]\nrequests_per_minute = 100",
                           "[tiers.basic]\nrequests_per_minute = 100\n"
                           "max_tokens_per_request = 256\nqueue_budget = 3")
    lines = [line(1000, units=CHAT, credits="0.000200", max_tokens=256, waiting=2.5),
             line(1001, units=CHAT, credits="0.000200", max_tokens=257),
             line(1002, units=CHAT, credits="0.000200", waiting=3.0),
             line(1003, account=None, tier="guest", units=CHAT, max_tokens=10**6),
             line(1004, status=503, error="pool_saturated", waiting=7.0),
             line(1005, family="embed", model="acme/embed", units={"prompt_tokens": 10},
                  credits="0.000010", max_tokens=999, waiting=3.0)]
    replay = Replay(policies(capped))
    decisions = [replay.replay(r) for r in (read_line(raw) for raw in lines) if r is not None]
    # The cap is a chat request's; the budget is every family's; guests' tier has neither.
    assert decisions == ["admitted", "forbidden", "pool_saturated", "admitted",
                         "pool_saturated", "pool_saturated"]
    report = replay.report()
    assert report["total"]["newly_refused"] == 3  # the one refused live stays refused
    assert report["refusal_reasons"] == {
        "3 requests wait per replica of acme/chat, and the basic tier queues only while "
        "fewer than 3 do": 1,
        "7 requests wait per replica of acme/chat, and the basic tier queues only while "
        "fewer than 3 do": 1,
        "3 requests wait per replica of acme/embed, and the basic tier queues only while "
        "fewer than 3 do": 1,
        "the basic tier allows at most 256 completion tokens a request": 1}
    # Refused live for the queue, admitted by the live policies replayed: newly run.
    again = Replay(policies()).run(lines).report()
    assert again["total"]["newly_admitted"] == 1 and again["total"]["newly_refused"] == 0


def test_refused_live_and_admitted_now_ran_nowhere() -> None:
    lines = [line(1000, status=429, error="rate_limited"),
             line(1001, status=403, error="forbidden", model="acme/big")]
    report = Replay(policies()).run(lines).report()
    assert report["total"]["newly_admitted"] == 2
    assert report["total"]["candidate_micro_credits"] == 0  # no units: no price


def test_prices_guests_and_lines_not_replayed() -> None:
    dearer = PRICES.replace("completion_per_1k_tokens = 2000", "completion_per_1k_tokens = 4000")
    lines = [line(1000, units=CHAT, credits="0.000200"),
             line(1001, account=None, tier="guest", units=CHAT),  # guests pay nothing
             line(1002, tier="gold", units=CHAT, credits="0.000200"),
             b'{"ts": 1003, "status": 401, "route": "/v2/compat/v1/chat/completions"}',
             b"not json", b"[1, 2]"]
    report = Replay(policies(prices=dearer)).run(lines).report()
    rows = {(r["tier"], r["model"]): r for r in report["by_tier_model"]}
    assert rows["basic", "acme/chat"]["candidate_micro_credits"] == 300
    assert rows["basic", "acme/chat"]["difference_micro_credits"] == 100
    assert rows["guest", "acme/chat"]["candidate_micro_credits"] == 0
    assert rows["gold", "acme/chat"]["decisions"] == {"unknown_tier": 1}
    assert report["skipped_lines"] == 3
    assert "basic / acme/chat" in text(report)


def test_deterministic_whatever_the_order_the_lines_were_written_in() -> None:
    rng = random.Random(7)
    lines = [line(1000 + rng.random() * 300, account=f"a{rng.randrange(5)}", units=CHAT,
                  credits="0.000200", latency_ms=rng.random() * 900) for _ in range(400)]
    strict = TIERS.replace("[tiers.basic]\nrequests_per_minute = 100",
                           "[tiers.basic]\nrequests_per_minute = 7")
    first = Replay(policies(strict)).run(lines).report()
    rng.shuffle(lines)
    assert Replay(policies(strict)).run(lines).report() == first
    assert first["total"]["decisions"]["rate_limited"] > 0
    since = Replay(policies(strict)).run(lines, since=1100, until=1200).report()
    assert 0 < since["total"]["requests"] < 400
