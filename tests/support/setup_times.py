"""What the real-engine tier's setup cost this run (installs, starts, restarts), shown at the end
of the run: a pytest plugin, so that pytest-xdist's main process, which runs no test, prints the
times its worker sent back."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.real_engines import MAX_MODEL_LEN

SETUP_TIMES: list[str] = []  # appended to by tests/real_engine/conftest.py


def pytest_sessionfinish(session: pytest.Session) -> None:
    if SETUP_TIMES and hasattr(session.config, "workeroutput"):  # an xdist worker: to the main
        session.config.workeroutput["real_engine_times"] = list(SETUP_TIMES)


def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist, in the main process: the times of the worker that ran the tier."""
    SETUP_TIMES.extend(getattr(node, "workeroutput", {}).get("real_engine_times", ()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SETUP_TIMES:
        terminalreporter.write_line(f"real engines (max_model_len {MAX_MODEL_LEN}): "
                                    + "; ".join(SETUP_TIMES))
