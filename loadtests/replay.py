"""How fast `policy replay` reads a day of a busy gateway (issue 34): `python -m loadtests.replay
[--lines N] [--rounds R]`.

It writes N access-log lines as the gateway writes them (chat, embeddings and speech; four
tiers, 2,000 accounts, seeded), then replays them through a candidate policy set stricter than
the live one (a lower Basic rate and token limit, dearer completions) in this one process, and
prints lines per second for each round (the median last). One core: the replay is one Python
loop. What it measures is the whole command but the file read and the printing: parsing,
sorting by arrival, the decisions and the prices."""

from __future__ import annotations

import argparse
import random
import statistics
import time

import msgspec
import orjson

from proxy.config import Policies, PricesPolicy, TiersPolicy
from proxy.credits.pricing import format_credits
from proxy.policy.replay import Replay

CANDIDATE_TIERS = """
[groups]
large-chat = ["acme/gpt-oss-120b"]
[tiers.guest]
requests_per_minute = 3
families = ["chat", "tts", "embed"]
models = { "*" = ["direct"] }
[tiers.basic]
requests_per_minute = 10
tokens_per_minute = 20000
families = ["chat", "embed"]
models = { standard = ["direct"] }
[tiers.pro]
requests_per_minute = 60
families = ["chat", "tts", "embed"]
models = { standard = ["direct"], large-chat = ["direct"] }
[tiers.max]
requests_per_minute = 130
families = ["chat", "tts", "embed"]
models = { "*" = ["direct", "network"] }
"""
CANDIDATE_PRICES = """
version = "candidate"
[default]
prompt_per_1k_tokens = 100
completion_per_1k_tokens = 400
[models."acme/gpt-oss-120b"]
prompt_per_1k_tokens = 600
completion_per_1k_tokens = 3000
[models."acme/csm-1b"]
per_1k_characters = 15000
[models."acme/embed-small"]
prompt_per_1k_tokens = 20
"""
TIERS = ("guest", "basic", "pro", "max")


def access_log(lines: int, seed: int = 1) -> list[bytes]:
    """`lines` lines over a day, in the order they ended, as the gateway writes them."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        tier = rng.choices(TIERS, (1, 5, 3, 1))[0]
        kind = rng.choices(("chat", "big", "embed", "tts"), (6, 1, 2, 1))[0]
        line: dict[str, object] = {
            "ts": round(1795800000 + i * 86400 / lines, 3),
            "request_id": f"{rng.getrandbits(128):032x}", "method": "POST", "status": 200,
            "latency_ms": round(rng.uniform(5, 3000), 1), "tier": tier, "mode": "direct",
            "backend": "chat-a"}
        if tier != "guest":
            line["account"] = f"acct-{rng.randrange(2000)}"
        if kind in ("chat", "big"):
            prompt, completion = rng.randrange(20, 4000), rng.randrange(1, 800)
            line.update(route="/v2/compat/v1/chat/completions", family="chat",
                        model="acme/gpt-oss-120b" if kind == "big" else "acme/small-chat",
                        units={"prompt_tokens": prompt, "completion_tokens": completion},
                        first_byte_ms=round(rng.uniform(5, 500), 1))
            micro = -(-(prompt * 100 + completion * 300) // 1000)
        elif kind == "embed":
            tokens = rng.randrange(5, 2000)
            line.update(route="/v2/compat/v1/embeddings", family="embed",
                        model="acme/embed-small", units={"prompt_tokens": tokens})
            micro = -(-tokens * 20 // 1000)
        else:
            chars = rng.randrange(10, 2000)
            line.update(route="/v2/audio/tts/engine", family="tts", model="acme/csm-1b",
                        units={"characters": chars})
            micro = -(-chars * 15000 // 1000)
        if tier != "guest":
            line["credits"] = format_credits(micro)
        out.append(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    policies = Policies(tiers=msgspec.toml.decode(CANDIDATE_TIERS, type=TiersPolicy),
                        prices=msgspec.toml.decode(CANDIDATE_PRICES, type=PricesPolicy))
    lines = access_log(args.lines)
    size = sum(map(len, lines))
    print(f"{args.lines} lines, {size / 1e6:.0f} MB, one core")
    rates = []
    for round_ in range(args.rounds):
        began = time.perf_counter()
        report = Replay(policies).run(lines).report()
        seconds = time.perf_counter() - began
        rates.append(args.lines / seconds)
        total = report["total"]
        print(f"round {round_ + 1}: {seconds:.2f} s, {rates[-1]:,.0f} lines/s "
              f"(refused {total['requests'] - total['decisions'].get('admitted', 0)}, "
              f"revenue change {total['difference_micro_credits'] / 1e6:+.2f} credits)")
    print(f"median: {statistics.median(rates):,.0f} lines/s")


if __name__ == "__main__":
    main()
