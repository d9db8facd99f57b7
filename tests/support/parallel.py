"""How scripts/test's two pytest-xdist workers share the suite: a pytest plugin (the main
process's scheduler).

Each test module is one unit of work, so its module-scoped servers start once, and the whole
real-engine tier (tests/real_engine/) is one, on one worker, so its replicas start once. Units
go out in the run's order (tests/conftest.py puts the tier and the `long` tests first), not
xdist's default of the most tests first, which left a one-test module of minutes to the end.
`--dist loadgroup` would group with markers, but pytest-xdist 3.8 names groups by rewriting
`item._nodeid`, which pytest 9 no longer reads; a scheduler's `_split_scope` is the extension
point xdist's own schedulers override.
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
    config.option.loadscopereorder = False  # xdist's --no-loadscope-reorder
    return ModulesAndTheTier(config, log)
