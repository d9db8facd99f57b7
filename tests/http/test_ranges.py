"""Byte ranges of stored media: what is served, what is 416 (RFC 9110 §14)."""

from __future__ import annotations

import pytest

from proxy.http.ranges import byte_range

SIZE = 51_884


@pytest.mark.parametrize(("header", "span"), [
    ("bytes=0-99", (0, 99)),
    ("bytes=100-", (100, SIZE - 1)),
    ("bytes=-100", (SIZE - 100, SIZE - 1)),
    ("bytes=-99999999", (0, SIZE - 1)),  # a suffix longer than the file: all of it
    ("bytes=10-99999999", (10, SIZE - 1)),  # an end past the file: up to its end
    ("bytes=0-0, 5-9", (0, 0)),  # several: the first
    ("bytes=10-" + "9" * 4301, (10, SIZE - 1)),  # an end of 4,301 digits: past the end
])
def test_what_is_served(header: str, span: tuple[int, int]) -> None:
    assert byte_range(header, SIZE) == span


@pytest.mark.parametrize("header", [
    "bytes=-0",  # the last zero bytes: nothing to send (was 206 "bytes 51884-51883/51884")
    "bytes=" + "4" * 4301 + "-",  # a start of 4,301 digits (was a 500: int() refuses it)
    f"bytes={SIZE}-",  # starts past the end
    "bytes=9-5",  # backwards
    "bytes=-", "items=0-5", "bytes=a-b", "",
])
def test_what_is_unsatisfiable(header: str) -> None:
    assert byte_range(header, SIZE) is None


def test_an_empty_file_has_no_range() -> None:
    assert byte_range("bytes=0-", 0) is None
