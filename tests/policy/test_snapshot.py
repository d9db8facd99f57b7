"""One policy snapshot per request: each request is held to the policies in force when it came,
and a reload rules the next request of every route alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

ADMIN_TOKEN = "admin-secret-token-for-snapshot-tests"
CHAT = "/v2/compat/v1/chat/completions"
TTS = "/v2/audio/tts/engine"


async def _post(gw: Any, path: str, body: dict[str, Any], headers: dict[str, str]
                ) -> tuple[int, Any]:
    """The status, and the answer: JSON as parsed, audio as bytes."""
    async with aiohttp.ClientSession() as session, \
            session.post(gw.make_url(path), json=body, headers=headers) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.read()


@pytest.mark.parametrize(("path", "section", "body"), [
    (CHAT, "chat", {"model": "acme/small-chat", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "x" * 3000}]}),
    (TTS, "tts", {"text": "x" * 3000}),
])
async def test_a_reload_that_lowers_a_body_cap_rules_the_next_request(
        simulator: Any, gateway: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        path: str, section: str, body: dict[str, Any]) -> None:
    """Chat read its cap from the boot-time config while the other routes followed reloads:
    after a reload the two enforced different caps. Now both follow it."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
    chat_sim = await simulator()
    tts_sim = await simulator("tts", models=("acme/csm-1b",))
    gw = await gateway(chat_sim, {"name": "speech", "kind": "tts",
                                  "url": str(tts_sim.make_url("/")).rstrip("/"),
                                  "models": ["acme/csm-1b"]})
    headers = {"X-API-Key": gw.api_key}
    status, answer = await _post(gw, path, body, headers)
    assert status == 200, answer

    requests_file = tmp_path / "config" / "policies" / "requests.toml"
    requests_file.write_text(f"[{section}]\nmax_body_bytes = 2048\n")
    status, answer = await _post(gw, "/admin/reload", {},
                                 {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200, answer

    status, answer = await _post(gw, path, body, headers)
    assert status == 413, answer
    assert answer["error"]["type"] == "payload_too_large"
    assert "2048" in answer["error"]["message"]
