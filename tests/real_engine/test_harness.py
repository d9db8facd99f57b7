"""The tier's harness reports why it cannot run instead of skipping (no replica needed: these
run in the fast tier too). The fixtures turn `EngineSetupError` into a failed test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import real_engines as engines
from tests.support.processes import free_port


@pytest.fixture
def broken_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache where vLLM cannot be installed (no Python to make its venv with)."""
    monkeypatch.setattr(engines, "CACHE", tmp_path / "cache")
    monkeypatch.setenv("PYTHON", "/nonexistent/python3.11")
    return tmp_path


@pytest.mark.parametrize("script", [engines.CHAT_SCRIPT, engines.WHISPER_SCRIPT])
def test_a_failed_install_says_why(broken_cache: Path, script: str) -> None:
    log = broken_cache / "prepare.log"
    with pytest.raises(engines.EngineSetupError) as failed:
        engines.prepare(log, script)
    message = str(failed.value)
    assert "installing vLLM or building the tiny model failed" in message
    assert "/nonexistent/python3.11" in message  # the log's tail: the reason itself


@pytest.mark.parametrize("script", [engines.CHAT_SCRIPT, engines.WHISPER_SCRIPT])
def test_a_replica_that_exits_while_starting_says_why(broken_cache: Path, script: str) -> None:
    replica = engines.Replica("r", free_port(), 0, broken_cache / "r.log", script=script)
    replica.start()
    try:
        deadline = time.monotonic() + 60
        with pytest.raises(engines.EngineSetupError) as failed:
            while time.monotonic() < deadline:
                replica.poll_ready()
                time.sleep(0.1)
        assert "exited during startup" in str(failed.value)
        assert "/nonexistent/python3.11" in str(failed.value)
    finally:
        replica.stop()
