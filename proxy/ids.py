"""Identifiers minted per request: unique and cheap. Request and hold ids need uniqueness, not
secrecy (they are never credentials), so they come from a PRNG seeded once from the OS instead
of a system call each; task ids, which a client may hold on to, stay uuid4."""

from __future__ import annotations

import random
import uuid

_random = random.Random()  # seeded from os.urandom when the process starts


def hex_id() -> str:
    """128 random bits as 32 hex digits."""
    return f"{_random.getrandbits(128):032x}"


def task_id(mode: str) -> str:
    """`direct:<uuid>` or `network:<uuid>` (spec)."""
    return f"{mode}:{uuid.uuid4()}"
