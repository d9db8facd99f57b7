"""schemathesis hooks for what the OpenAPI document states in words only, because JSON Schema
cannot: a value that must name another value of the same request, and a header whose meaning
is "the same request as before". Each touches schema-valid (positive) requests only, and only
that one value; everything else schemathesis generates goes out as generated. One more keeps
the run's own API key alive: schemathesis learns key ids from responses (GET /v2/account,
GET /admin/keys) and would revoke the key every other request is made with.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from urllib.parse import unquote

import schemathesis
from schemathesis import Case, Response
from schemathesis.core.failures import Failure
from schemathesis.hooks import HookContext

from proxy.credits.idempotency import HEADER as IDEMPOTENCY_KEY
from proxy.credits.idempotency import MAX_KEY_LENGTH


@schemathesis.hook
def filter_case(context: HookContext, case: Case) -> bool:
    own = os.environ.get("ST_KEY_ID")
    return not (case.method == "DELETE" and (case.path_parameters or {}).get("key_id") == own)


@schemathesis.hook
def map_case(context: HookContext, case: Case) -> Case:
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return case
    _fresh_idempotency_key(case)
    _fetchable_audio(case)
    _existing_task(case)
    return case


def _existing_task(case: Case) -> None:
    """A task id or media key names something made earlier by the same account: any string is
    schema-valid, only one that exists is found. Valid ones get the run's own finished task."""
    names = {"/v2/tasks/{task_id}": ("task_id", "ST_TASK_ID"),
             "/v2/audio/media/{media_key}": ("media_key", "ST_MEDIA_KEY")}
    if case.path in names and case.path_parameters is not None:
        name, variable = names[case.path]
        case.path_parameters[name] = os.environ[variable]


def _fetchable_audio(case: Case) -> None:
    """`audio_url` and `custom_voice.url` name audio the gateway fetches: any well-formed URL is
    schema-valid, but only one that answers with audio (from a host the fetch policy allows)
    gets past the gateway's documented 422. A valid one gets the stack's audio file; so does an
    upload, whose bytes must be audio (read from the content), which no schema can say."""
    body = case.body
    if not isinstance(body, dict):
        return
    url = os.environ["ST_AUDIO_URL"]
    if case.path.startswith("/v2/compat/v1/audio/") and "file" in body:  # an upload
        body["file"] = Path(os.environ["ST_AUDIO_FILE"]).read_bytes()
    if isinstance(body.get("audio_url"), str):
        body["audio_url"] = url
    voice = body.get("custom_voice")
    if isinstance(voice, dict) and isinstance(voice.get("url"), str):
        voice["url"] = url


def _fresh_idempotency_key(case: Case) -> None:
    """An Idempotency-Key means "this very request again": the same key with another body is
    refused (422), as documented. Generated cases would reuse keys across bodies by chance, so a
    valid key gets a value of its own."""
    headers = case.headers or {}
    key = headers.get(IDEMPOTENCY_KEY)
    if isinstance(key, str) and 0 < len(key) <= MAX_KEY_LENGTH:
        headers[IDEMPOTENCY_KEY] = f"st-{uuid.uuid4().hex}"


@schemathesis.hook
def filter_failure(context: HookContext, failure: Failure, case: Case,
                   response: Response) -> bool:
    """Failures only a schema's blindness explains (see `_not_audio`), or schemathesis's own
    (see `_unresolved_link`); the run's summary counts what is dropped."""
    return not (_not_audio(case, response) or _unresolved_link(case, response))


def _unresolved_link(case: Case, response: Response) -> bool:
    """The stateful phase follows a link whose value the earlier answer did not hold (an
    overview listing no account yet, as on a busy machine) by sending the path's template
    itself, `/admin/accounts/{account}/...` (once percent-encoded, `%7Baccount%7D`): braces
    the parameter's pattern forbids, so the documented 422 is no "schema-valid request
    rejected"."""
    values = [unquote(v) for v in (case.path_parameters or {}).values() if isinstance(v, str)]
    return response.status_code == 422 and ("{" in unquote(case.formatted_path) or any(
        v.startswith("{") and v.endswith("}") for v in values))


def _not_audio(case: Case, response: Response) -> bool:
    """An upload whose bytes are not audio is the documented 422 (the format is read from the
    content); the cases map_case cannot reach (the coverage phase's) may carry any bytes."""
    if not case.path.startswith("/v2/compat/v1/audio/") or response.status_code != 422:
        return False
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(detail, list) and [i.get("type") for i in detail] == ["not_audio"]
