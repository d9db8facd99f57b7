"""How scripts/test's two pytest-xdist workers share the suite: a pytest plugin (the main
process's scheduler).

Each test module is one unit of work, so its module-scoped servers start once, and the whole
real-engine tier (tests/real_engine/) is one, on one worker, so its replicas start once; the
units with the most tests go first (xdist's own order for scopes), the tier among them, while
the other worker takes the modules one by one. `--dist loadgroup` would do this with markers,
but pytest-xdist 3.8 names groups by rewriting `item._nodeid`, which pytest 9 no longer reads;
a scheduler's `_split_scope` is the extension point xdist's own schedulers override.
"""

from __future__ import annotations

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

TIER = "tests/real_engine/"


class ModulesAndTheTier(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return TIER if module.startswith(TIER) else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> ModulesAndTheTier:
    return ModulesAndTheTier(config, log)
