"""The real-engine tier's fixtures: two real vLLM replicas for the whole session.

`engines` installs vLLM and builds the tiny model unless cached (outside the clone), starts two
replicas in parallel (one core each), and stops them by process group when the session ends.
Any failure on the way FAILS every test of the tier with the reason: never a silent skip.
`replicas` is what a test asks for: the same replicas, restarted first if a test killed one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conftest import free_port
from tests.real_engine.engines import MAX_MODEL_LEN, SERVED, Engines, EngineSetupError, Replica

_TIMES: list[str] = []  # for the terminal summary: what the tier's setup cost this run


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    logs = tmp_path_factory.mktemp("real-engines")
    cores = os.cpu_count() or 1
    fleet = Engines([Replica(f"vllm-{i}", free_port(), i % cores, logs / f"vllm-{i}.log")
                     for i in range(2)], logs / "prepare.log")
    try:
        fleet.start()
    except EngineSetupError as exc:
        pytest.fail(f"the real-engine tier cannot run: {exc}", pytrace=False)
    _TIMES.append(f"install/build check {fleet.prepare_s:.1f} s; replicas ready in "
                  + ", ".join(f"{r.started_s:.1f} s" for r in fleet.replicas))
    yield fleet
    fleet.stop()


@pytest.fixture
def replicas(engines: Engines) -> Engines:
    """Both replicas up (one a previous test killed is started again)."""
    restarting = [r for r in engines.replicas if not r.running]
    try:
        engines.ensure_up()
    except EngineSetupError as exc:
        pytest.fail(f"the real-engine tier cannot run: {exc}", pytrace=False)
    if restarting:
        _TIMES.append("restarted " + ", ".join(f"{r.name} in {r.started_s:.1f} s"
                                               for r in restarting))
    return engines


def backend(replica: Replica, **extra: object) -> dict[str, object]:
    """backends.toml's entry for a replica (as an operator writes it for a real vLLM)."""
    return {"name": replica.name, "kind": "vllm", "url": replica.url, "models": [SERVED],
            **extra}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _TIMES:
        terminalreporter.write_line(f"real engines (max_model_len {MAX_MODEL_LEN}): "
                                    + "; ".join(_TIMES))
