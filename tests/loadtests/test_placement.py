"""The placement replay (loadtests/placement.py): its model of vLLM's prefix cache and its
rules, on sequences small enough to reason about."""

from __future__ import annotations

from loadtests import placement
from loadtests.placement import BLOCK_TOKENS, Engine, replay, requests
from loadtests.placement import request as ask


def test_a_cache_finds_a_prompt_again_until_others_evict_it_from_its_end() -> None:
    engine = Engine(blocks=20)
    first = ask("a " * 200, "q1").tokens  # ~300 tokens: 9 full blocks
    assert engine.start(0, first) == 0
    engine.end(0)
    assert engine.start(1, first) == (len(first) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    engine.end(1)
    # Others fill the cache: the prompt's last blocks go first, its beginning stays a while.
    other = ask("b " * 300, "q2").tokens
    engine.start(2, other)
    engine.end(2)
    found = engine.start(3, first)
    assert 0 < found < (len(first) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def test_every_request_is_sorted_once_and_a_rule_never_finds_more_than_it_asks() -> None:
    sequence = requests(5, 120)
    for rule in placement.RULES:
        out = replay(sequence, rule)
        assert out["first"] + out["elsewhere"] + out["evicted"] + out["hit"] == 120
        assert out["first"] == len({r.system for r in sequence})
        assert 0 < out["found"] < out["queried"]
    # sglang-router's tree never forgets where it sent a prompt: never elsewhere.
    assert replay(sequence, "sglang")["elsewhere"] == 0


def test_a_smaller_cache_evicts_more() -> None:
    sequence = requests(1, 200)
    roomy, cramped = (replay(sequence, "gateway", blocks=n) for n in (400, 60))
    assert roomy["evicted"] < cramped["evicted"]
    assert roomy["found"] > cramped["found"]


def test_the_command_prints_a_row_per_rule(capsys: object) -> None:
    placement.main(["--seeds", "1", "--requests", "60"])
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [row[0] for row in rows] == list(placement.RULES)
    assert all(row[-1].endswith("%") for row in rows)
