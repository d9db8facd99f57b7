"""Fixtures for tests that run the real `serve` process tree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.store.redis_process import RedisProcess
from tests.support.fleet import Stack


@pytest.fixture
def redis_url(clean_redis: RedisProcess) -> str:
    """A Redis the test can read too (instead of the embedded one)."""
    return clean_redis.url


@pytest.fixture
def stacks(tmp_path: Path) -> Iterator[list[Stack]]:
    """`serve` trees started by a test; each is stopped (and its children killed) at the end."""
    started: list[Stack] = []
    yield started
    for stack in started:
        stack.close()
        errors = stack.errors()
        if errors:  # shown with a failing test's output
            print(f"\n--- errors logged by the gateway in {stack.folder.parent}:\n{errors}")
