"""The real-engine tier's fixtures: two real vLLM replicas for the whole session.

`engines` installs vLLM and builds the tiny model unless cached (outside the clone), starts two
replicas in parallel (one core each), and stops them by process group when the session ends.
They export their traces (an `llm_request` span per request, the child of the request's
`traceparent`) to the session's trace backend (`trace_backend`: Phoenix), which starts while
they do and is ready when `engines` is.
Any failure on the way FAILS every test of the tier with the reason: never a silent skip.
`replicas` is what a test asks for: the same replicas, restarted first if a test killed one.
The tier runs first in the run (tests/conftest.py); the replicas stop after the last test that
uses them, not at the session's end.

`whisper` is one real vLLM Whisper replica (serve-whisper.sh: its own venv and tiny model, built
the same way), started when the first test asks for it, alone (the ASR modules sort before the
chat ones, so the chat replicas are not up yet) and on every core. It stops at the session's end,
or as soon as no later test of the run asks for it, so the chat replicas never share the two
cores (or the RAM: ~4 GB) with it; a later test would start it again.

`embedder` is one real vLLM serving a tiny embedding model (serve-embed.sh: the chat venv, its
own model): launched beside the chat replicas when the run has embedding tests (its start
overlaps theirs), or when the first test asks for it, and stopped when no later test does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.support.processes import free_port
from tests.support.real_engines import (
    EMBED_ARGS,
    EMBED_SCRIPT,
    WHISPER_ARGS,
    WHISPER_SCRIPT,
    Engines,
    EngineSetupError,
    Replica,
)
from tests.support.setup_times import SETUP_TIMES
from tests.support.trace_backend import TraceBackend, TraceBackendError


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory, trace_backend_starting: TraceBackend,
            request: pytest.FixtureRequest) -> Iterator[Engines]:
    traces = trace_backend_starting  # launched, not waited for: it starts beside the replicas
    logs = tmp_path_factory.mktemp("real-engines")
    cores = os.cpu_count() or 1
    fleet = Engines([Replica(f"vllm-{i}", free_port(), i % cores, logs / f"vllm-{i}.log",
                             traces_to=traces.otlp_url, events_port=free_port())
                      for i in range(2)], logs / "prepare.log")
    if _asked_in(request.session.items, "embedder"):
        # Its ~30 s start overlaps the chat replicas' instead of adding to the run; it idles
        # (memory only) until the embedding tests, after the chat ones.
        early = _embed_fleet(tmp_path_factory)
        try:
            early.launch()
        except EngineSetupError:
            early.stop()  # its fixture starts it again, and fails the tests with the reason
        else:
            _EARLY_EMBED.append(early)
    try:
        fleet.start()
    except EngineSetupError as exc:
        pytest.fail(f"the real-engine tier cannot run: {exc}", pytrace=False)
    waiting = time.monotonic()
    try:
        traces.wait_ready()
    except TraceBackendError as exc:
        fleet.stop()
        pytest.fail(f"the real-engine tier cannot run its trace backend: {exc}", pytrace=False)
    SETUP_TIMES.append(f"install/build check {fleet.prepare_s:.1f} s; replicas ready in "
                       + ", ".join(f"{r.started_s:.1f} s" for r in fleet.replicas)
                       + f"; then waited {time.monotonic() - waiting:.1f} s for the trace "
                       "backend")
    yield fleet
    fleet.stop()


@pytest.fixture(autouse=True)
def _stop_the_chat_replicas_after_their_last_test(request: pytest.FixtureRequest
                                                  ) -> Iterator[None]:
    """The tier runs first (tests/conftest.py): once no later test asks for them, the chat
    replicas stop, so the rest of the run has both cores and the RAM."""
    yield
    if "engines" in request.fixturenames and not _asked_later(request, "engines"):
        engines: Engines = request.getfixturevalue("engines")
        engines.stop()


@pytest.fixture
def replicas(engines: Engines) -> Engines:
    """Both replicas up (one a previous test killed is started again)."""
    restarting = [r for r in engines.replicas if not r.running]
    try:
        engines.ensure_up()
    except EngineSetupError as exc:
        pytest.fail(f"the real-engine tier cannot run: {exc}", pytrace=False)
    if restarting:
        SETUP_TIMES.append("restarted " + ", ".join(f"{r.name} in {r.started_s:.1f} s"
                                                    for r in restarting))
    return engines


@pytest.fixture(scope="session")
def whisper_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    logs = tmp_path_factory.mktemp("real-whisper")
    cores = os.cpu_count() or 1
    replica = Replica("whisper-0", free_port(), f"0-{cores - 1}", logs / "whisper-0.log",
                      script=WHISPER_SCRIPT, args=WHISPER_ARGS)
    fleet = Engines([replica], logs / "prepare.log", script=WHISPER_SCRIPT)
    try:
        fleet.start()
    except EngineSetupError as exc:
        pytest.fail(f"the real-engine tier cannot run its Whisper replica: {exc}",
                    pytrace=False)
    SETUP_TIMES.append(f"whisper: install/build check {fleet.prepare_s:.1f} s, ready in "
                       f"{replica.started_s:.1f} s")
    yield fleet
    fleet.stop()


@pytest.fixture
def whisper(whisper_engine: Engines, request: pytest.FixtureRequest) -> Iterator[Replica]:
    """The Whisper replica, up (started again if it was stopped early, or died)."""
    fleet = whisper_engine
    restarting = not fleet[0].running
    try:
        fleet.ensure_up()
    except EngineSetupError as exc:
        pytest.fail(f"the real-engine tier cannot run its Whisper replica: {exc}",
                    pytrace=False)
    if restarting and fleet[0].starts > 1:
        SETUP_TIMES.append(f"whisper: restarted in {fleet[0].started_s:.1f} s")
    yield fleet[0]
    if not _asked_later(request, "whisper"):
        fleet.stop()  # nothing later needs it: free its cores and RAM for the chat replicas


_EARLY_EMBED: list[Engines] = []  # launched beside the chat replicas (`engines`)


def _embed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    logs = tmp_path_factory.mktemp("real-embed")
    cores = os.cpu_count() or 1
    replica = Replica("embed-0", free_port(), f"0-{cores - 1}", logs / "embed-0.log",
                      script=EMBED_SCRIPT, args=EMBED_ARGS)
    return Engines([replica], logs / "prepare.log", script=EMBED_SCRIPT)


@pytest.fixture(scope="session")
def embed_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    fleet = _EARLY_EMBED.pop() if _EARLY_EMBED else _embed_fleet(tmp_path_factory)
    try:
        if fleet[0].proc is None:
            fleet.start()
        else:
            fleet.ensure_up()  # launched early: wait for it
    except EngineSetupError as exc:
        fleet.stop()
        pytest.fail(f"the real-engine tier cannot run its embedding replica: {exc}",
                    pytrace=False)
    except BaseException:
        fleet.stop()
        raise
    SETUP_TIMES.append(f"embeddings: install/build check {fleet.prepare_s:.1f} s, ready in "
                       f"{fleet[0].started_s:.1f} s from its start")
    yield fleet
    fleet.stop()


@pytest.fixture
def embedder(embed_engine: Engines, request: pytest.FixtureRequest) -> Iterator[Replica]:
    """The embedding replica, up; stopped once no later test of the run asks for it."""
    fleet = embed_engine
    try:
        fleet.ensure_up()
    except EngineSetupError as exc:
        pytest.fail(f"the real-engine tier cannot run its embedding replica: {exc}",
                    pytrace=False)
    yield fleet[0]
    if not _asked_later(request, "embedder"):
        fleet.stop()


def _asked_later(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test after this one in the run's order uses `fixture`."""
    items = request.session.items
    try:
        later = items[items.index(request.node) + 1:]
    except ValueError:
        return True
    return _asked_in(later, fixture)


def _asked_in(items: list[pytest.Item], fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _EARLY_EMBED:  # launched and never taken (an interrupted run)
        _EARLY_EMBED.pop().stop()
