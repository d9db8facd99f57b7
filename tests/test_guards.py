"""Source-level guards for promises a functional test cannot show on every path."""

from __future__ import annotations

from pathlib import Path

PROXY = Path(__file__).resolve().parent.parent / "proxy"


def test_rate_limits_only_hit_never_test_then_hit() -> None:
    # reliability.md R1: `test()` then `hit()` is a race; admission must use the atomic hit.
    source = (PROXY / "ratelimit.py").read_text()
    assert ".hit(" in source and ".test(" not in source


def test_pure_modules_do_no_io() -> None:
    # Policy, translation, parsing and pricing stay free of I/O so they test fast.
    pure = ["policy.py", "pricing.py", "sse.py", "headers.py", "errors.py", "validate.py",
            "schemas.py", "translate/base.py", "translate/openai.py", "translate/served.py",
            "translate/upstream.py", "translate/anthropic.py", "translate/ollama.py"]
    for name in pure:
        text = (PROXY / name).read_text()
        for io in ("import aiohttp", "from aiohttp", "import redis", "from redis"):
            assert io not in text, f"{name} imports {io.split()[-1]}"
