"""Identifiers minted per request: unique and cheap. Request and hold ids need uniqueness, not
secrecy (they are never credentials): a random per-process prefix and a counter, no system call
and no random draw per id. Task ids, which a client may hold on to, stay uuid4."""

from __future__ import annotations

import itertools
import secrets
import uuid

_PREFIX = secrets.token_hex(8)  # 64 random bits: two processes never share a prefix in practice
_COUNTER = itertools.count(1)


def hex_id() -> str:
    """32 hex digits: the process's prefix, then its count."""
    return f"{_PREFIX}{next(_COUNTER):016x}"


def task_id(mode: str) -> str:
    """`direct:<uuid>` or `network:<uuid>` (spec)."""
    return f"{mode}:{uuid.uuid4()}"


# What `task_id` makes, as the OpenAPI document states it.
TASK_ID_PATTERN = "^(direct|network):[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
