"""`async: true` on every family and on chat: 202, a worker runs it, the owner polls it and
fetches its audio; holds settle at completion and are released on failure; a dead worker's task
is run by another; other accounts see 404."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config import VOICE_PRESETS
from tests.support.config_files import MODEL
from tests.support.media_stack import (
    ASR_MODEL,
    PER_1K_CHARS,
    PER_AUDIO_S,
    PER_IMAGE,
    Media,
    MediaFactory,
    assert_speech_wav,
    tone,
)

TTS, ASR = "/v2/audio/tts/engine", "/v2/audio/asr/engine"


async def get(m: Media, path: str, headers: dict[str, str] | None = None
              ) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as session, session.get(
            m.gateway.make_url(path), headers=headers or {}) as r:
        return r.status, r.headers, await r.read()


async def submitted(m: Media, path: str, body: dict[str, Any], headers: dict[str, str]
                    ) -> dict[str, Any]:
    status, _, raw = await m.post(path, {**body, "async": True}, headers)
    assert status == 202, raw
    accepted = orjson.loads(raw)
    assert accepted["status"] == "running" and accepted["task_id"].startswith("direct:")
    assert accepted["poll_url"] == f"/v2/tasks/{accepted['task_id']}" and accepted["message"]
    return accepted


async def finished(m: Media, poll_url: str, headers: dict[str, str]) -> dict[str, Any]:
    async with asyncio.timeout(10):
        while True:
            status, _, raw = await get(m, poll_url, headers)
            assert status == 200, raw
            record: dict[str, Any] = orjson.loads(raw)
            if record["status"] != "running":
                return record
            await asyncio.sleep(0.05)


async def test_async_tts_then_media_with_ranges(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("basic", "acct-a")
    text = "Async speech, fetched later."
    task = await submitted(m, TTS, {"text": text, "preset_voice": "Karen"}, headers)
    record = await finished(m, task["poll_url"], headers)
    assert record["status"] == "completed", record
    assert record["created_at"] <= record["updated_at"]
    result = record["result"]
    assert result["content_type"] == "audio/wav" and result["voice"] == "Karen"
    status, got, wav = await get(m, result["media_url"], headers)
    assert status == 200 and got["Content-Type"] == "audio/wav"
    assert len(wav) == result["bytes"]
    assert assert_speech_wav(wav) == pytest.approx(len(text) * 0.06, abs=0.01)
    status, got, part = await get(m, result["media_url"], {**headers, "Range": "bytes=0-43"})
    assert status == 206 and part == wav[:44]
    assert got["Content-Range"] == f"bytes 0-43/{len(wav)}"
    status, _, tail = await get(m, result["media_url"], {**headers, "Range": "bytes=-10"})
    assert status == 206 and tail == wav[-10:]
    assert (await get(m, result["media_url"], {**headers, "Range": "bytes=99999999-"}))[0] == 416
    [charge] = await m.charges("acct-a")
    assert charge["status"] == "completed" and charge["characters"] == len(text)
    assert charge["cost"] == -(-len(text) * PER_1K_CHARS // 1000)


async def test_async_asr_chat_image(media: MediaFactory, simulator: Any) -> None:
    m = await media()
    headers = await m.key("max", "acct-b")
    url = m.serve("/a.wav", tone(1.5))
    asr = await submitted(m, ASR, {"audio_url": url, "return_timestamps": True}, headers)
    image = await submitted(m, "/v2/image/acme/generate", {"prompt": "x", "n": 2}, headers)
    transcript = (await finished(m, asr["poll_url"], headers))["result"]
    assert transcript["duration"] == 1.5 and transcript["language"] == "en"
    assert transcript["segments"]
    images = (await finished(m, image["poll_url"], headers))["result"]
    assert len(images["data"]) == 2
    charges = {c["model"]: c for c in await m.charges("acct-b")}
    assert charges[ASR_MODEL]["cost"] == -(-1500 * PER_AUDIO_S // 1000)
    assert charges["acme/image-gen"]["cost"] == 2 * PER_IMAGE


async def test_async_chat(gateway: Any, simulator: Any) -> None:
    gw = await gateway(await simulator())
    headers = {"X-API-Key": gw.api_key}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "async": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.make_url("/v2/compat/v1/chat/completions"), json=body,
                                headers=headers) as r:
            assert r.status == 202
            task = await r.json()
        for _ in range(200):
            async with session.get(gw.make_url(task["poll_url"]), headers=headers) as r:
                record = await r.json()
            if record["status"] != "running":
                break
            await asyncio.sleep(0.05)
    assert record["status"] == "completed", record
    completion = record["result"]
    assert completion["object"] == "chat.completion" and completion["choices"]
    assert completion["task_id"] == task["task_id"] and completion["usage"]["completion_tokens"]


async def test_a_failed_task_is_free_and_says_why(media: MediaFactory) -> None:
    m = await media()
    headers = await m.key("basic", "acct-f")
    task = await submitted(m, TTS, {"text": "Boom."}, {**headers, "x-sim-status": "500"})
    record = await finished(m, task["poll_url"], headers)
    assert record["status"] == "failed"
    assert record["error"]["type"] == "upstream_error" and record["error"]["status"] == 502
    [charge] = await m.charges("acct-f")
    assert charge["cost"] == 0  # the hold placed at submission, released


async def test_only_the_owner_sees_a_task_and_its_media(media: MediaFactory) -> None:
    m = await media()
    owner, other = await m.key("basic", "acct-o"), await m.key("basic", "acct-x")
    task = await submitted(m, TTS, {"text": "Mine."}, owner)
    result = (await finished(m, task["poll_url"], owner))["result"]
    assert (await get(m, task["poll_url"], other))[0] == 404
    assert (await get(m, task["poll_url"]))[0] == 404  # a guest
    assert (await get(m, result["media_url"], other))[0] == 404
    assert (await get(m, "/v2/tasks/direct:nope", owner))[0] == 404
    assert (await get(m, task["poll_url"], {"X-API-Key": "igw_sk_wrong"}))[0] == 401


async def test_open_tasks_are_capped_per_account(media: MediaFactory) -> None:
    m = await media(requests_toml="[tasks]\nmax_open_per_account = 2\n")
    headers = {**await m.key("basic", "acct-c"), "x-sim-delay-ms": "1500"}
    first = await submitted(m, TTS, {"text": "One."}, headers)
    await submitted(m, TTS, {"text": "Two."}, headers)
    status, got, _ = await m.post(TTS, {"text": "Three.", "async": True}, headers)
    assert status == 429 and got["Retry-After"]
    await finished(m, first["poll_url"], headers)
    await asyncio.sleep(0.1)
    assert (await m.post(TTS, {"text": "Four.", "async": True}, headers))[0] == 202
    charges = await m.charges("acct-c")
    assert sorted(c["cost"] > 0 for c in charges) == [False, True, True]  # the 429's released


async def test_presets_async_every_voice(media: MediaFactory) -> None:
    """Many tasks at once across the runners: each completes once, each charged once."""
    m = await media()
    headers = await m.key("basic", "acct-many")
    tasks = [await submitted(m, TTS, {"text": f"Voice {p}.", "preset_voice": p}, headers)
             for p in VOICE_PRESETS]
    records = [await finished(m, t["poll_url"], headers) for t in tasks]
    assert [r["result"]["voice"] for r in records] == list(VOICE_PRESETS)
    charges = await m.charges("acct-many")
    assert len(charges) == len(VOICE_PRESETS) and all(c["cost"] > 0 for c in charges)


async def test_a_dead_workers_task_runs_elsewhere(gateway: Any, simulator: Any) -> None:
    """Gateway A takes the task and stops mid-run (its entry stays pending, unacked); gateway B,
    on the same Redis, claims it once it has been idle `claim_idle_s` and completes it; the task
    is charged once."""
    sim = await simulator("tts", ("acme/csm-1b",))
    backend = {"name": "tts-a", "kind": "tts", "url": str(sim.make_url("/")).rstrip("/"),
               "models": ["acme/csm-1b"], "forward_headers": ["x-sim-*"]}
    policies = {"requests.toml": "[tasks]\nclaim_idle_s = 1\n"}
    a = await gateway(backend, policies=policies)
    headers = {"X-API-Key": a.api_key}
    async with aiohttp.ClientSession() as session:
        async with session.post(a.make_url(TTS), headers={**headers, "x-sim-delay-ms": "1000"},
                                json={"text": "Survive.", "async": True}) as r:
            assert r.status == 202
            task = await r.json()
        async with asyncio.timeout(5):  # A's runner has it: the simulator is answering
            while True:
                if await _in_flight(session, sim):
                    break
                await asyncio.sleep(0.02)
        await a.close()
        b = await gateway(backend, policies=policies)
        async with asyncio.timeout(15):
            while True:
                async with session.get(b.make_url(task["poll_url"]), headers=headers) as r:
                    record = await r.json()
                if record["status"] != "running":
                    break
                await asyncio.sleep(0.1)
        assert record["status"] == "completed", record
        async with session.get(sim.make_url("/_sim/requests")) as r:
            outcomes = [rec["outcome"] for rec in await r.json()]
    assert outcomes == ["cancelled", "completed"]  # A's run was cut off; B's finished


async def _in_flight(session: aiohttp.ClientSession, sim: Any) -> bool:
    async with session.get(sim.make_url("/_sim/requests")) as r:
        return any(rec["outcome"] is None for rec in await r.json())


async def test_results_and_media_expire(media: MediaFactory) -> None:
    """A finished task's record and its media live [tasks] result_ttl_s; the open-task count
    goes back down when it ends."""
    m = await media(requests_toml="[tasks]\nresult_ttl_s = 120\nmax_run_s = 600\n")
    headers = await m.key("basic", "acct-ttl")
    task = await submitted(m, TTS, {"text": "Short lived."}, headers)
    running_ttl = await m.redis.ttl(f"igw:{{acct-ttl}}:task:{task['task_id']}")
    assert 600 < running_ttl <= 720  # result_ttl_s + max_run_s while it may still run
    result = (await finished(m, task["poll_url"], headers))["result"]
    assert 0 < await m.redis.ttl(f"igw:{{acct-ttl}}:task:{task['task_id']}") <= 120
    expires_at = int(result["media_key"].partition("-")[0])  # the media store's own (proxy.blobs)
    assert 0 < expires_at - time.time() <= 120
    assert 0 < await m.redis.ttl("igw:{acct-ttl}:media_bytes") <= 120
    assert int(await m.redis.get("igw:{acct-ttl}:tasks_open")) == 0
