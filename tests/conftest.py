"""The suite's settings: the shared fixtures, loaded as plugins from tests/support/, and the order
the tests run in.

Fixtures and helpers live in tests/support/, by topic; a test module imports helpers from there,
never from another test module or a conftest (tests/test_suite_layout.py). A conftest below this
one keeps only what its own directory uses.
"""

from __future__ import annotations

import pytest

# Before any of them is imported: a failed assert in a helper reports its values, as in a test.
pytest.register_assert_rewrite("tests.support")

pytest_plugins = [
    "tests.support.redis_servers",  # redis_server (session), clean_redis
    "tests.support.upstreams",  # simulator
    "tests.support.gateway",  # gateway
    "tests.support.media_stack",  # media
    "tests.support.object_store",  # s3_server (session), s3_bucket
    "tests.support.trace_backend",  # trace_backend (session): Phoenix, a real OTLP backend
    "tests.support.setup_times",  # the real-engine tier's setup times, at the end of the run
    "tests.support.parallel",  # scripts/test's two workers: a module, and the tier, on one
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-engine tier runs first, then the `long` tests, then the rest in their order:
    on scripts/test's two workers (tests/support/parallel.py) the longest units start at once,
    side by side, and the short modules fill in after, so no long one is left running alone at
    the end. Within the tier the tests that kill an engine run after the others, which then need
    no restart; its replicas stop after its last test (tests/real_engine/conftest.py)."""

    def rank(item: pytest.Item) -> tuple[bool, bool, bool]:
        return (item.get_closest_marker("real_engine") is None,
                item.get_closest_marker("long") is None,
                item.get_closest_marker("kills_engine") is not None)

    items.sort(key=rank)  # stable: the rest keep their order
