"""API key format (K1): prefix, length, alphabet, entropy, checksum, digest, redaction."""

from __future__ import annotations

import hashlib
import math
import re
import string
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.identity import apikeys

PREFIX = "igw"
BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
KEY_RE = re.compile(r"igw_sk_[0-9A-Za-z]{38}")


def base62(value: int, width: int) -> str:
    out = ""
    while value:
        value, rem = divmod(value, 62)
        out = BASE62[rem] + out
    return out.rjust(width, "0")


SECRET = b"the store's seal secret, 32 bytes"


@pytest.fixture(scope="module")
def sample() -> list[str]:
    return [apikeys.generate(PREFIX, SECRET) for _ in range(25)]


def test_format_and_length(sample: list[str]) -> None:
    for key in sample:
        assert KEY_RE.fullmatch(key), key
        assert len(key) == len("igw_sk_") + 32 + 6 == apikeys.key_length(PREFIX)
        assert apikeys.well_formed(key, PREFIX)


def test_other_prefix() -> None:
    key = apikeys.generate("acme2", SECRET)
    assert key.startswith("acme2_sk_")
    assert apikeys.well_formed(key, "acme2")
    assert not apikeys.well_formed(key, PREFIX)


def test_random_part_has_at_least_128_bits() -> None:
    assert apikeys.ALPHABET == BASE62
    assert apikeys.RANDOM_CHARS == 32 and apikeys.SEAL_CHARS == 8
    assert pytest.approx(24 * math.log2(62)) == apikeys.RANDOM_BITS
    assert apikeys.RANDOM_BITS >= 128  # reliability K1


def test_a_key_is_sealed_by_the_secret_that_made_it(sample: list[str]) -> None:
    for key in sample:
        assert apikeys.sealed(key, SECRET)
        assert not apikeys.sealed(key, b"another store's secret")
    # A key made before seals: 32 random characters and a checksum, still well formed.
    head = "igw_sk_" + "".join(BASE62[i % 62] for i in range(7, 39))
    legacy = head + apikeys.checksum(head)
    assert apikeys.well_formed(legacy, PREFIX) and not apikeys.sealed(legacy, SECRET)
    # The seal covers the random part: change one character and it no longer fits.
    key = sample[0]
    twin = key[:10] + ("A" if key[10] != "A" else "B") + key[11:-6]
    assert not apikeys.sealed(twin + apikeys.checksum(twin), SECRET)


def test_keys_are_unique_and_use_the_whole_alphabet() -> None:
    keys = [apikeys.generate(PREFIX, SECRET) for _ in range(2000)]
    assert len(set(keys)) == len(keys)
    randoms = "".join(k[len("igw_sk_"):-6] for k in keys)
    assert set(randoms) == set(BASE62)
    # 64,000 draws over 62 symbols: each should be near 1,032; a biased generator is far off.
    counts = [randoms.count(c) for c in BASE62]
    assert min(counts) > 800 and max(counts) < 1300


def test_checksum_is_crc32_in_base62(sample: list[str]) -> None:
    for key in sample:
        body, check = key[:-6], key[-6:]
        assert check == base62(zlib.crc32(body.encode()), 6)
        assert apikeys.checksum(body) == check


def test_every_single_character_typo_fails(sample: list[str]) -> None:
    alphabet = BASE62 + "_-"
    for key in sample:
        for i, original in enumerate(key):
            for c in alphabet:
                if c != original:
                    typo = key[:i] + c + key[i + 1:]
                    assert not apikeys.well_formed(typo, PREFIX), (i, c)
            assert not apikeys.well_formed(key[:i] + key[i + 1:], PREFIX)  # dropped
            assert not apikeys.well_formed(key[:i] + "x" + key[i:], PREFIX)  # inserted
            if i + 1 < len(key) and key[i] != key[i + 1]:  # neighbours swapped
                assert not apikeys.well_formed(key[:i] + key[i + 1] + key[i] + key[i + 2:], PREFIX)


@pytest.mark.parametrize("text", [
    "", "igw_sk_", "igw_sk_" + "a" * 38, "IGW_sk_" + "a" * 38, "igw_pk_" + "a" * 38,
    "igw_sk_" + "é" * 38, "igw_sk_" + "a" * 37 + " ",
])
def test_malformed(text: str) -> None:
    assert not apikeys.well_formed(text, PREFIX)


def test_non_alphabet_character_with_matching_checksum_is_refused() -> None:
    body = "igw_sk_" + "+" * 32
    assert not apikeys.well_formed(body + apikeys.checksum(body), PREFIX)


@given(st.text(max_size=60))
def test_arbitrary_text_is_not_a_key(text: str) -> None:
    assert not apikeys.well_formed(text, PREFIX)


def test_digest_and_key_id(sample: list[str]) -> None:
    key = sample[0]
    digest = apikeys.digest(key)
    assert digest == hashlib.sha256(key.encode()).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    kid = apikeys.key_id(digest)
    assert kid == "key_" + digest[:12]
    assert apikeys.is_key_id(kid)
    assert key not in kid
    assert len({apikeys.key_id(apikeys.digest(k)) for k in sample}) == len(sample)


@pytest.mark.parametrize("text", ["key_", "key_0123456789AB", "key_0123456789abc", "igw_sk_x"])
def test_not_a_key_id(text: str) -> None:
    assert not apikeys.is_key_id(text)


def test_redact(sample: list[str]) -> None:
    for key in sample:
        shown = apikeys.redact(key)
        assert shown == "igw_sk_..." + key[-4:]
        assert key[len("igw_sk_"):-6] not in shown
    assert apikeys.redact("short") == "..."
    assert apikeys.redact("") == "..."
    assert "secret" not in apikeys.redact("Bearer secret")
