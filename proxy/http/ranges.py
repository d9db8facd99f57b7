"""`Range: bytes=...` on a stored media file (RFC 9110 §14). Pure.

One range is served (several are answered with the first); a range that cannot be satisfied is
the caller's 416. Numbers are read without ever building an integer longer than the file's own
size needs: a client's 4,301-digit number is a range past the end, not an error.
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str, size: int) -> tuple[int, int] | None:
    """The first `bytes=a-b`, `bytes=a-` or `bytes=-n` of `header` as (first, last) byte
    offsets within `size` bytes; None when it is unsatisfiable or not a byte range."""
    match = _RANGE.fullmatch(header.split(",")[0].strip())
    if match is None or (not match[1] and not match[2]) or size == 0:
        return None
    if not match[1]:  # the last n bytes (all of them when n is larger); n = 0 asks for none
        last = _bounded(match[2], size)
        return (size - last, size - 1) if last else None
    first = _bounded(match[1], size)
    end = _bounded(match[2], size - 1) if match[2] else size - 1
    return (first, end) if first <= end else None


def _bounded(digits: str, cap: int) -> int:
    """`digits` as a number, or `cap` when it is larger."""
    return cap if len(digits) > len(str(cap)) else min(int(digits), cap)
