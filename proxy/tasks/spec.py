"""What a queued task carries (everything a worker needs to run it again), and how its record
answers a poll. Pure.

A task is admitted when it is submitted (rate limit counted, worst case held); the worker that
runs it produces the answer exactly as the request path would, stores it, and settles the hold.
"""

from __future__ import annotations

from typing import Any

import msgspec


class TaskSpec(msgspec.Struct, kw_only=True, frozen=True):
    id: str  # "direct:<uuid>" (spec), the poll id
    route: str  # which route's path runs it: "tts", "asr", "image", "video", "chat:<style>"
    body: bytes  # the client's JSON body, as sent
    params: dict[str, str] = {}  # the route's path parameters (an image/video provider)
    headers: dict[str, str] = {}  # the client's headers backends may get (forward_headers)
    account: str
    tier: str
    kind: str  # principal kind: "key", "jwt", "guest"
    key_id: str | None = None
    request_id: str
    mode: str
    model: str
    hold_id: str = ""  # "" for guests
    held: int = 0
    details: dict[str, Any] = {}  # the journal fields known at admission
    cap: int | None = None  # chat: the completion cap the hold assumed
    created_at: int
    traceparent: str = ""  # the submitting request's span (W3C), when it was traced


ENCODER = msgspec.json.Encoder()
DECODER = msgspec.json.Decoder(TaskSpec)


def poll_answer(task_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """`{task_id, status, result | error, created_at, updated_at}` from a stored record."""
    out: dict[str, Any] = {"task_id": task_id, "status": fields.get("status", "running"),
                           "created_at": int(fields.get("created_at", "0")),
                           "updated_at": int(fields.get("updated_at", "0"))}
    if "result" in fields:
        out["result"] = msgspec.json.decode(fields["result"])
    if "error" in fields:
        out["error"] = msgspec.json.decode(fields["error"])
    if "task_address" in fields:
        out["task_address"] = fields["task_address"]
    if "agreement" in fields:
        out["agreement"] = msgspec.json.decode(fields["agreement"])
    return out
